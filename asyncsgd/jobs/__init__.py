"""Whole parameter-server jobs on the engines that place and restart processes: torchrun
(and so Slurm and Kubernetes) in ``torchrun``, Ray in ``ray_job``; ``roles`` says which
process serves and what settings each role takes from one ``JobConfig``."""

from .roles import reachable_host, server_settings, worker_settings

__all__ = ["reachable_host", "server_settings", "worker_settings"]
