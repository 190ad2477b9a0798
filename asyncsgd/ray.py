"""``asyncsgd.ray``: a whole parameter-server job on Ray, as ``asyncsgd ray-job`` runs it
(``asyncsgd.jobs.ray_job`` says how). Needs the ``ray`` extra: pip install 'asyncsgd[ray]'.

    import asyncsgd.ray

    if __name__ == "__main__":
        result = asyncsgd.ray.run(task="mnist1d-cnn", workers=2, target=0.85, epochs=1000)
        print(result.summary["final_metric"], result.restarts, result.run_dir)

``run`` starts a Ray of its own on this host (or joins $RAY_ADDRESS, ``address=...``, or
the Ray this process is connected to already) and returns a ``RayJobResult``; ``start``
returns the running ``RayJob`` (``job.address``, ``job.incarnations()``, ``job.wait()``).
"""

from .config import RayJobConfig
from .jobs.ray_job import RayJob, RayJobResult, run, start

__all__ = ["RayJob", "RayJobConfig", "RayJobResult", "run", "start"]
