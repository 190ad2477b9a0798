"""Whole parameter-server jobs on engines that place and restart processes: torchrun (and so
Slurm and Kubernetes) and Ray.
"""

from .roles import reachable_host, server_settings, worker_settings

__all__ = ["reachable_host", "server_settings", "worker_settings"]
