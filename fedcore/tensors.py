"""uint8 image arrays -> normalised float tensors, and small device helpers."""

from __future__ import annotations

import numpy as np
import torch


def to_tensor(x: np.ndarray, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """uint8 (N, H, W, C) -> float32 (N, C, H, W) in [-1, 1]."""
    t = torch.from_numpy(np.array(x, copy=True)).to(device)  # the npz arrays are read-only
    return t.permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0)


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (cuda when present)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but torch sees no GPU; use device=cpu or device=auto")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"unknown device {name!r}; valid values are: auto, cpu, cuda, cuda:N")
    return torch.device(name)


def batches(n: int, batch_size: int):
    for start in range(0, n, batch_size):
        yield slice(start, min(start + batch_size, n))


def state_to_cpu(state: dict) -> dict:
    return {k: v.detach().to("cpu").clone() for k, v in state.items()}
