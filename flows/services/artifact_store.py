"""A self-contained tracking store: artifacts live next to the SQLite file, addressed relative to it.

MLflow stores an absolute artifact path in every run, so a copied or moved project keeps reading
from, and writing into, the folder it came from. An experiment that the flows create in a local
SQLite store has instead the artifact location ``fedcore-project:/mlartifacts/<experiment>``:
a path relative to the folder that holds the database. This module is the artifact repository for
that scheme. It resolves the path against the tracking store in use:

* the tracking URI that MLflow passes to the repository;
* else the backend store of ``mlflow ui`` / ``mlflow server``;
* else the process's tracking URI.

Copy or move the project, open ``sqlite:///<new place>/mlruns.db``, and every run, plot and
registered model is found under ``<new place>/mlartifacts``. (Copy ``mlruns.db*`` together: the
store's latest commits may still be in ``mlruns.db-wal``, :func:`flows.services.tracking.write_ahead_log`.)
The scheme is registered through the package's entry point (``mlflow.artifact_repository``), so
``mlflow ui`` run from this environment serves these artifacts; :func:`register` also registers it
in-process.

A tracking server (``infra/mlflow-server.sh``) is relocatable in its own way: runs hold
``mlflow-artifacts:`` URIs and the server maps them to its ``--artifacts-destination``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlparse

from mlflow.exceptions import MlflowException
from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

SCHEME = "fedcore-project"
FOLDER = "mlartifacts"  # beside the database
_SERVER_STORE_ENV = "_MLFLOW_SERVER_FILE_STORE"  # where `mlflow server` / `mlflow ui` put --backend-store-uri
_NAME = re.compile(r"[^\w\-.]")


def is_local_sqlite(uri: str | None) -> bool:
    return bool(uri) and str(uri).startswith("sqlite:///")


def location(experiment: str) -> str:
    """The artifact location of a new experiment in a local SQLite store."""
    return f"{SCHEME}:/{FOLDER}/{_NAME.sub('_', experiment)}"


def store_root(tracking_uri: str | None = None) -> Path:
    """The folder that holds the SQLite tracking store in use: the root of relative artifact paths."""
    import mlflow

    for uri in (tracking_uri, os.environ.get(_SERVER_STORE_ENV), mlflow.get_tracking_uri()):
        if is_local_sqlite(uri):
            return Path(str(uri)[len("sqlite:///") :]).resolve().parent
    raise MlflowException(
        f"{SCHEME}: artifacts are stored relative to a local SQLite tracking store (sqlite:///<folder>/mlruns.db), "
        f"but the tracking URI is {tracking_uri or mlflow.get_tracking_uri()!r}; open the project's store with "
        "mlflow.set_tracking_uri('sqlite:///<project>/mlruns.db') or mlflow ui --backend-store-uri "
        "sqlite:///<project>/mlruns.db"
    )


class ProjectArtifactRepository(LocalArtifactRepository):
    """Files under ``<folder of the SQLite store>/<path of the URI>``."""

    def __init__(self, artifact_uri: str, tracking_uri: str | None = None, registry_uri: str | None = None) -> None:
        parsed = urlparse(artifact_uri)
        if parsed.scheme != SCHEME:
            raise MlflowException(f"not a {SCHEME}: URI: {artifact_uri!r}")
        local = store_root(tracking_uri) / parsed.path.lstrip("/")
        super().__init__(str(local), tracking_uri, registry_uri)


def register() -> None:
    """Register the scheme in this process (the entry point does so for every MLflow process)."""
    from mlflow.store.artifact.artifact_repository_registry import _artifact_repository_registry

    _artifact_repository_registry.register(SCHEME, ProjectArtifactRepository)
