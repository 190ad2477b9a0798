"""What is trained: the task abstraction every mode uses, its data and its models."""
