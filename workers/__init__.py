"""Parameter-server workers, CPU and GPU (built on the asyncsgd core)."""
