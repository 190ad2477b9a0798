"""``asyncsgd.ray``: a whole parameter-server job on Ray, as ``asyncsgd ray-job`` runs it. Needs
the ``ray`` extra (pip install 'asyncsgd[ray]').

    result = asyncsgd.ray.run(task="mnist1d-cnn", workers=2, target=0.85)   # under __main__
"""

from .config import RayJobConfig
from .jobs.ray_job import RayJob, RayJobResult, run, start

__all__ = ["RayJob", "RayJobConfig", "RayJobResult", "run", "start"]
