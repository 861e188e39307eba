"""Where a client step runs, and the faults a test asks a flow to inject: read from the config, shared by
the arrival and round flows."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import torch
from omegaconf import DictConfig


def gpus(cfg: DictConfig) -> float:
    """GPUs each client step asks Ray for: ``flow.gpus_per_task`` when the run is on a GPU (``device=cuda...``,
    or ``auto`` with CUDA here or GPUs in the Ray cluster the run joined), else 0, so that CPU runs never
    wait for a GPU that is not there. With ``auto`` a task that lands on a node whose torch sees no CUDA
    keeps its model on the CPU and says so (:func:`flows.services.runtime.cpu_fallback_note`)."""
    on_gpu = str(cfg.device).startswith("cuda") or (
        cfg.device == "auto" and (torch.cuda.is_available() or _cluster_gpus() > 0)
    )
    return float(cfg.flow.gpus_per_task) if on_gpu else 0.0


def _cluster_gpus() -> float:
    """The GPUs of the Ray cluster this process is connected to (0 when it is not)."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0


def faults(cfg: DictConfig, folder: Path) -> Dict[str, Any]:
    """The test faults the config asks for: ``{"fault"|"crash": (step index, marker folder)}``."""
    out = {}
    if cfg.flow.inject_fault is not None:
        out["fault"] = (int(cfg.flow.inject_fault), folder)
    if cfg.flow.inject_crash is not None:
        out["crash"] = (int(cfg.flow.inject_crash), folder)
    return out
