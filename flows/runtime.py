"""The only module that imports Ray: Prefect API set-up and the Ray task runner.

With no Prefect API URL set, every Ray worker would start its own temporary Prefect server
(~170 MB and 5-6 s each). We start one temporary server here in the driver, or use the URL the
user exported, and pass it to the workers through Ray's ``runtime_env``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Dict, Iterator

log = logging.getLogger(__name__)
_SERVER = None


def ensure_prefect_api() -> str:
    """The Prefect API URL to use: ``PREFECT_API_URL`` if set, else one temporary local server."""
    global _SERVER
    url = os.environ.get("PREFECT_API_URL")
    if url:
        return url
    from prefect.server.api.server import SubprocessASGIServer

    _SERVER = SubprocessASGIServer()
    _SERVER.start(timeout=120)
    url = _SERVER.api_url
    os.environ["PREFECT_API_URL"] = url
    log.info("started a temporary Prefect server at %s", url)
    return url


def stop_prefect_api() -> None:
    global _SERVER
    if _SERVER is not None:
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=5)  # send queued flow/task logs while the server is still there
        _SERVER.stop()
        os.environ.pop("PREFECT_API_URL", None)
        _SERVER = None


def ray_init_kwargs(*, num_cpus: int, prefect_api_url: str, root: Path) -> Dict[str, Any]:
    # OMP_NUM_THREADS is left to Ray (it sets it from each task's num_cpus); tasks that get
    # several CPUs call torch.set_num_threads themselves.
    env = {"PREFECT_API_URL": prefect_api_url,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH", "")]))}
    for key in ("MLFLOW_TRACKING_URI", "PREFECT_LOGGING_LEVEL"):
        if key in os.environ:
            env[key] = os.environ[key]
    return {"num_cpus": num_cpus, "include_dashboard": False, "log_to_driver": True,
            "runtime_env": {"env_vars": env}}


def make_task_runner(*, address: str | None, num_cpus: int, root: Path):
    """prefect-ray's runner: a local Ray with ``num_cpus`` CPUs, or the cluster at ``address``."""
    from prefect_ray import RayTaskRunner

    url = ensure_prefect_api()
    kwargs = ray_init_kwargs(num_cpus=num_cpus, prefect_api_url=url, root=root)
    if address:
        kwargs.pop("num_cpus")
        kwargs.pop("include_dashboard")
    return RayTaskRunner(address=address, init_kwargs=kwargs)


@contextlib.contextmanager
def task_resources(*, num_gpus: float = 0, num_cpus: float = 1) -> Iterator[None]:
    """Ray resources for the tasks submitted inside the block (GPUs when the device asks)."""
    from prefect_ray.context import remote_options

    opts: Dict[str, Any] = {"num_cpus": num_cpus}
    if num_gpus:
        opts["num_gpus"] = num_gpus
    with remote_options(**opts):
        yield


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
