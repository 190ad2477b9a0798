"""What is trained: the task abstraction every mode uses, its data and its models, and
the pace each rank is held to (stragglers staged on purpose)."""
