"""What every run keeps and owns: its directory, metrics, checkpoints, the recorder
that writes them, progress, signals, and the child processes it starts."""
