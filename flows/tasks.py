"""The Prefect tasks that run on Ray workers, and the paths and inputs they share with the flows.

Kept apart from ``flows.federation`` so that a Ray worker unpickling a task imports only
Prefect, torch and fedcore: no MLflow, no matplotlib (about 2 s less per fresh worker).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from prefect import task
from prefect.cache_policies import NO_CACHE

from fedcore.aggregate import weighted_average
from fedcore.data import Partition
from fedcore.engine import AdaptResult, ModelSpec, adapt_client, pretrain_client, run_arrivals
from fedcore.train import LocalResult
from flows import config as C

# ------------------------------------------------------------------------------------ tasks


def _maybe_fail(fault_marker: str | None) -> None:
    """Injected fault for tests: fail the first attempt only (a marker file remembers it)."""
    if fault_marker and not Path(fault_marker).exists():
        Path(fault_marker).parent.mkdir(parents=True, exist_ok=True)
        Path(fault_marker).write_text("failed once\n")
        raise RuntimeError(f"injected fault ({fault_marker}); Prefect should retry this task")


@task(name="pretrain-client", cache_policy=NO_CACHE)
def pretrain_client_task(global_state: Dict[str, torch.Tensor], spec: ModelSpec, x: np.ndarray, y: np.ndarray,
                         cfg: Any, seed: int, client_id: int) -> LocalResult:
    return pretrain_client(global_state=global_state, spec=spec, x=x, y=y, cfg=cfg, seed=seed, client_id=client_id)


@task(name="fedavg-aggregate", cache_policy=NO_CACHE)
def aggregate_task(updates: List) -> Dict[str, torch.Tensor]:
    return weighted_average(updates)


@task(name="adapt-client", cache_policy=NO_CACHE)
def adapt_client_task(global_state: Dict[str, torch.Tensor], spec: ModelSpec, client: Any, cfg: Any, seed: int,
                      arrival: int, source_x: np.ndarray | None = None, refused: bool = False,
                      fault_marker: str | None = None, threads: int = 1) -> AdaptResult:
    _maybe_fail(fault_marker)
    torch.set_num_threads(threads)  # arrivals are sequential: the one running task may use every CPU
    return adapt_client(global_state=global_state, spec=spec, client=client, cfg=cfg, seed=seed, arrival=arrival,
                        source_x=source_x, refused=refused)


@task(name="run-cell", cache_policy=NO_CACHE)
def run_cell_task(cfg_dict: Dict[str, Any], method: str, aggregator: str, seed: int,
                  form: str | None = None) -> Dict[str, Any]:
    """One whole sweep cell, in one worker: the plain driver over the fedcore steps."""
    cfg = OmegaConf.create(cfg_dict)
    acfg = C.arrival_config(cfg, method=method, aggregator=aggregator, seed=seed, form=form)
    partition, spec, source = load_inputs(cfg)
    ckpt = _ckpt_dir(cfg, cell_name(acfg))
    t0 = time.perf_counter()
    res = run_arrivals(partition, spec, source, acfg, checkpoint_dir=ckpt, resume=bool(cfg.flow.resume),
                       stop_after=cfg.flow.stop_after)
    return {"method": method, "aggregator": aggregator, "seed": seed, "form": acfg.form, "result": res,
            "seconds": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------ helpers


def source_model_path(cfg: DictConfig) -> Path:
    return C.resolve_path(cfg.paths.models) / f"source-{cfg.data.name}-{cfg.model.name}-{cfg.model.norm}.pt"


def partition_dir(cfg: DictConfig) -> Path:
    return C.resolve_path(cfg.paths.partitions) / cfg.data.name


def prepared_path(cfg: DictConfig) -> Path:
    return C.resolve_path(cfg.paths.prepared) / f"{cfg.data.name}.npz"


def cell_name(acfg) -> str:
    """method-aggregator[-form]-s<seed>; the plain form keeps the short name."""
    form = "" if acfg.form == "plain" else f"-{acfg.form}"
    return f"{acfg.method}-{acfg.aggregator}{form}-s{acfg.seed}"


def _ckpt_dir(cfg: DictConfig, cell: str) -> Path:
    return C.resolve_path(cfg.paths.checkpoints) / f"{cfg.data.name}-{cfg.model.name}-{cfg.model.norm}" / cell


def load_source(path: Path, spec: ModelSpec) -> Dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"source model {path} is missing. Build it with `dvc repro pretrain` "
                                "(or `python -m flows.stages pretrain`).")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=False)
        state = blob["state"]
    except Exception as exc:
        raise ValueError(f"source model {path} is corrupt or not a fedcore checkpoint ({exc}); "
                         "rebuild it with `dvc repro pretrain`") from exc
    if blob.get("spec") != asdict(spec):
        raise ValueError(f"source model {path} was trained for {blob.get('spec')}, not {asdict(spec)}; "
                         "rebuild it with `dvc repro pretrain`")
    return state


def load_inputs(cfg: DictConfig):
    spec = C.model_spec(cfg)
    partition = Partition.load(partition_dir(cfg))
    return partition, spec, load_source(source_model_path(cfg), spec)
