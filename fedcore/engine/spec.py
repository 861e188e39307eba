"""What a worker needs to rebuild the network, the seeded initial weights, and a network saved as data.

A saved network is a folder of two files that nothing can execute: ``spec.json`` (the
:class:`ModelSpec` it is rebuilt from, by name through the model registry) and ``state_dict.pt``
(tensors only, read back with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Dict

import torch
from torch import nn

from fedcore.tensors import state_to_cpu
from fedcore.types import ModelSpec, State


def init_state(spec: ModelSpec, seed: int) -> State:
    """The network's initial weights under ``torch.manual_seed(seed)``, on the CPU."""
    torch.manual_seed(seed)
    return state_to_cpu(spec.build().state_dict())


NETWORK_FORMAT = 1
SPEC_FILE, WEIGHTS_FILE = "spec.json", "state_dict.pt"


def save_network(folder: str | Path, spec: ModelSpec, state: Dict[str, torch.Tensor]) -> Path:
    """Write ``spec.json`` and ``state_dict.pt`` into ``folder``; returns the folder.

    Only the spec and the tensors are written, never the module object, so loading it back
    needs the installed ``fedcore`` and unpickles no code.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SPEC_FILE).write_text(json.dumps({"format": NETWORK_FORMAT, "spec": asdict(spec)}, indent=1) + "\n")
    torch.save(state_to_cpu(state), folder / WEIGHTS_FILE)
    return folder


def load_network(folder: str | Path) -> nn.Module:
    """The network saved by :func:`save_network`, rebuilt from its spec, in eval mode on the CPU.

    Raises ``ValueError`` for a folder whose spec or weights are not what :func:`save_network`
    writes; a weights file holding anything but tensors and containers (a pickle that would run
    code, for one) is refused before any of it is executed.
    """
    folder = Path(folder)
    spec_path, weights_path = folder / SPEC_FILE, folder / WEIGHTS_FILE
    if not spec_path.is_file() or not weights_path.is_file():
        raise FileNotFoundError(f"no saved network in {folder} (expected {SPEC_FILE} and {WEIGHTS_FILE})")
    try:
        raw = json.loads(spec_path.read_text())
        found = raw.get("format") if isinstance(raw, dict) else None
        if found != NETWORK_FORMAT:
            raise ValueError(f"format {found!r}, expected {NETWORK_FORMAT}")
        spec = ModelSpec(**raw["spec"])
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{spec_path} is not a fedcore network spec ({exc})") from exc
    try:
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(
            f"{weights_path} cannot be read as plain tensors ({exc}); it was not written by "
            "fedcore's save_network and has not been loaded"
        ) from exc
    model = spec.build()
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as exc:
        raise ValueError(f"{weights_path} does not fit the network {spec} ({exc})") from exc
    return model.eval()
