"""The Model Registry holds what a user would deploy: one registered model per system and dataset.

A sweep logs every cell's model on that cell's run. Only the cells that the config names become
registry versions (``flow.register``): by default the configured cell, i.e. the root config's
method, aggregator, privacy form and seed. Each version carries tags and a one-line description:
its lineage (git commit, data and partition hashes, the config fingerprint) and the run's headline
metrics. Two kinds of alias move:

* ``champion`` moves to a new version only when it beats the current champion on
  ``flow.champion_metric`` (higher is better). A tie keeps the older champion.
* ``flow.aliases`` (the nightly job passes ``nightly``) always move to the newest version.

Load a version by number or alias with :func:`flows.services.tracking.load_registered`.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, Iterable, Mapping

import mlflow
from omegaconf import DictConfig

from fedcore.engine.spec import WEIGHTS_FILE
from fedcore.registry import check_choice
from flows.config import compose as C
from flows.services import tracking

CHAMPION = "champion"
REGISTER_CHOICES = ("configured", "all", "none")
CHAMPION_METRICS = ("final_avg_holdout_acc", "final_worst_holdout_acc", "final_avg_online_acc")  # higher is better
LINEAGE_TAGS = (
    "git_commit",
    "git_changes",
    "dvc_lock_sha256",
    "data_sha256",
    "partition_manifest_sha256",
    "config_fingerprint",
    "source_model_sha256",
    "system",
    "grid",
    "trainer",
    "strategy",
)  # copied from the run when present
# what makes two versions the same model: its weights' sha256 (tracking.log_model) and its config
IDENTITY_TAGS = (tracking.MODEL_SHA256_TAG + WEIGHTS_FILE, "config_fingerprint")
_log = logging.getLogger(__name__)


def model_name(cfg: DictConfig, default: str | None = None) -> str | None:
    """The registered model for this config: ``flow.register_model``, or ``default`` when that is null
    (a grid's is ``<system>-<grid>``; without one, ``<the variant's system>-<data>``).

    An empty name, or ``flow.register=none``, means nothing is registered.
    """
    if str(cfg.flow.register) == "none":
        return None
    name = cfg.flow.register_model
    if name is not None:
        return str(name) or None
    if default is not None:
        return default
    return f"{C.variant_system(cfg, str(cfg.get('variant', 'mnist')))}-{cfg.data.name}"


def check(cfg: DictConfig) -> None:
    """Fail before any work on a registry setting that cannot work."""
    check_choice("flow.register", str(cfg.flow.register), REGISTER_CHOICES)
    check_choice("flow.champion_metric", str(cfg.flow.champion_metric), CHAMPION_METRICS)


def wanted(cfg: DictConfig, cell: tuple, configured: tuple) -> bool:
    """Whether a cell becomes a version: every cell (``all``), or the configured one (``configured``)."""
    mode = str(cfg.flow.register)
    return mode == "all" or (mode == "configured" and tuple(cell) == tuple(configured))


def configured_cell(cfg: DictConfig) -> tuple:
    """(method, aggregator, privacy form, seed): the sweep cell the root config selects."""
    a = C.arrival_config(cfg)
    return (a.method, a.aggregator, a.form, int(cfg.seed))


def register(
    model_uri: str,
    *,
    name: str,
    run_id: str,
    summary: Mapping[str, float],
    metric: str,
    aliases: Iterable[str] = (),
    description: str = "",
    client: "mlflow.MlflowClient | None" = None,
):
    """Register ``model_uri`` (a logged model) as a new version of ``name``; tag it and move its aliases.

    Returns the :class:`mlflow.entities.model_registry.ModelVersion`. ``summary`` holds the
    run's headline metrics; ``metric`` (one of them) decides the ``champion`` alias.
    """
    if metric not in summary:
        raise ValueError(
            f"flow.champion_metric={metric!r} is not a headline metric of this run; "
            f"use one of {', '.join(sorted(summary))}"
        )
    client = client or mlflow.MlflowClient()
    run_tags = client.get_run(run_id).data.tags
    tags: Dict[str, str] = {
        k: run_tags[k]
        for k in ("method", "aggregator", "privacy_form", "seed", *LINEAGE_TAGS, *IDENTITY_TAGS)
        if k in run_tags
    }
    tags.update({f"metric.{k}": repr(float(v)) for k, v in summary.items()})  # exact: the champion rule reads it
    tags["champion_metric"] = metric
    same = identical_version(client, name, tags)
    if same is not None:  # a rerun of the same config to the same weights: the version it already has
        _log.info(
            "%s version %s holds these weights from this config already: not registered again", name, same.version
        )
        version = same
    else:
        version = mlflow.register_model(model_uri, name, tags=tags)
        if description:
            client.update_model_version(name, version.version, description=description)
    moved = []
    if same is None and _beats_champion(client, name, metric, float(summary[metric])):
        client.set_registered_model_alias(name, CHAMPION, version.version)
        moved.append(CHAMPION)
    for alias in aliases:
        client.set_registered_model_alias(name, str(alias), version.version)
        moved.append(str(alias))
    _log.info(
        "registered %s version %s (%s=%.4f)%s",
        name,
        version.version,
        metric,
        float(summary[metric]),
        f"; aliases {', '.join(moved)}" if moved else "",
    )
    return version


def identical_version(client: "mlflow.MlflowClient", name: str, tags: Mapping[str, str]):
    """The version of ``name`` with the same weights (sha256) from the same config (fingerprint), or None.
    Without both tags nothing counts as identical."""
    if not all(tags.get(k) for k in IDENTITY_TAGS):
        return None
    from mlflow.exceptions import MlflowException

    try:
        versions = client.search_model_versions(f"name='{name}'")
    except MlflowException:
        return None
    for v in versions:
        if all(v.tags.get(k) == tags[k] for k in IDENTITY_TAGS):
            return v
    return None


def _beats_champion(client: "mlflow.MlflowClient", name: str, metric: str, value: float) -> bool:
    """True when there is no champion yet, or when ``value`` is strictly above the champion's ``metric``."""
    from mlflow.exceptions import MlflowException

    if not math.isfinite(value):
        return False
    try:
        champion = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return True
    best = champion.tags.get(f"metric.{metric}")
    return best is None or value > float(best)


def describe(what: str, summary: Mapping[str, Any], metric: str) -> str:
    """The version's one-line description: what it is and its headline metric."""
    return f"{what}: {metric} {float(summary[metric]):.4f}"
