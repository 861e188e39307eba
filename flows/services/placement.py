"""Where a client step runs, and the faults a test asks a flow to inject: read from the config, shared by
the arrival and round flows."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import torch
from omegaconf import DictConfig


def gpus(cfg: DictConfig) -> float:
    """GPUs each client step asks Ray for: ``flow.gpus_per_task`` when the run is on a GPU (``device=cuda...``,
    or ``auto`` with CUDA present), else 0, so that CPU runs never wait for a GPU that is not there."""
    return (
        float(cfg.flow.gpus_per_task)
        if str(cfg.device).startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
        else 0.0
    )


def faults(cfg: DictConfig, folder: Path) -> Dict[str, Any]:
    """The test faults the config asks for: ``{"fault"|"crash": (step index, marker folder)}``."""
    out = {}
    if cfg.flow.inject_fault is not None:
        out["fault"] = (int(cfg.flow.inject_fault), folder)
    if cfg.flow.inject_crash is not None:
        out["crash"] = (int(cfg.flow.inject_crash), folder)
    return out
