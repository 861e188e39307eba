"""A throwaway git + DVC repository holding this project's pipeline, for tests that run ``dvc`` itself."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, List, Mapping

from flows.config.compose import ROOT

# What the stages import or DVC hashes. Copied, not linked: DVC hashes a dependency's content, and a
# stage run in the copy must import the copy's code (python -m puts the working directory first).
CODE = ("fedcore", "flows", "conf", "hydra_plugins")
GITIGNORE = "__pycache__/\n*.pyc\n/mlruns.db\n/mlruns.db-wal\n/mlruns.db-shm\n/mlartifacts/\n/checkpoints/\n"
DVC_CONFIG = "[core]\n    autostage = false\n    analytics = false\n[hydra]\n    enabled = true\n"


def env() -> dict:
    """The environment a ``dvc`` or stage command runs with: this interpreter's bin first, services quiet."""
    e = dict(os.environ)
    e.update(
        PATH=os.pathsep.join([str(Path(sys.executable).parent), e.get("PATH", "")]),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        MLFLOW_ENABLE_TELEMETRY="false",
        DO_NOT_TRACK="1",
        DVC_NO_ANALYTICS="1",
        PREFECT_LOGGING_LEVEL="WARNING",
        GIT_AUTHOR_NAME="test",
        GIT_AUTHOR_EMAIL="test@localhost",
        GIT_COMMITTER_NAME="test",
        GIT_COMMITTER_EMAIL="test@localhost",
    )
    e.pop("PREFECT_API_URL", None)  # each stage starts its own temporary server, as under `dvc repro`
    e.pop("PYTHONPATH", None)
    return e


def run(repo: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``args`` in ``repo``; a failure shows its output."""
    proc = subprocess.run(list(args), cwd=repo, env=env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def dvc(repo: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return run(repo, sys.executable, "-m", "dvc", *args, timeout=timeout)


def make_repo(dest: Path, *, defaults: Mapping[str, str] = (), settings: Mapping[str, Any] = ()) -> Path:
    """A git repository at ``dest`` with the project's dvc.yaml, code and conf/, committed.

    Parameters
    ----------
    defaults:
        Config groups to select in the copy's conf/config.yaml, e.g. ``{"data": "digits"}``.
    settings:
        Values merged into the copy's conf/config.yaml, e.g. ``{"pretrain": {"rounds": 2}}``.
        params.yaml is composed from the result (``make params``), as DVC's Hydra integration does on
        ``dvc exp run``. Every ``paths.*`` is relative, so each one points into ``dest``.
    """
    from omegaconf import OmegaConf

    dest.mkdir(parents=True, exist_ok=True)
    for name in CODE:
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("dvc.yaml", ".dvcignore"):  # .dvcignore: bytecode the stages leave is no change of their code
        shutil.copy(ROOT / name, dest / name)
    shutil.copytree(ROOT / ".dvc" / "plots", dest / ".dvc" / "plots")
    (dest / ".dvc" / "config").write_text(DVC_CONFIG)
    (dest / ".gitignore").write_text(GITIGNORE)
    conf = OmegaConf.load(dest / "conf" / "config.yaml")
    groups = dict(defaults)
    conf.defaults = [
        {k: groups.pop(k)} if isinstance(d, Mapping) and (k := next(iter(d))) in groups else d for d in conf.defaults
    ]
    if groups:
        raise ValueError(f"no config group {sorted(groups)} in conf/config.yaml's defaults")
    OmegaConf.save(OmegaConf.merge(conf, dict(settings)), dest / "conf" / "config.yaml")
    run(dest, sys.executable, "-m", "flows.config.params")
    run(dest, "git", "init", "-q")
    commit(dest, "the pipeline")
    return dest


def commit(repo: Path, message: str, paths: List[str] | None = None) -> None:
    run(repo, "git", "add", *(paths or ["-A"]))
    run(repo, "git", "commit", "-q", "-m", message)
