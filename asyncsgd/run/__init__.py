"""What every run keeps and owns: its directory, metrics, checkpoints, progress, signals, and
the child processes it starts.
"""
