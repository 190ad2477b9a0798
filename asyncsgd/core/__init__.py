"""What is trained: the task every mode uses, its data and models, and the pace each rank is
held to.
"""
