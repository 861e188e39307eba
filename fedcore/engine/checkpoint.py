"""One checkpoint mechanism for every loop: atomic, sha256-checked, refusing a changed config.

A checkpoint is a folder holding ``<name>.pt`` and ``<name>.sha256``. The payload is a plain
dict of tensors, numbers, strings, lists and dicts; a loop turns its own dataclasses into that
and back. The file and its sha256 are written to temporary names and renamed, file first, so a
killed process leaves either the old checkpoint or the new one; a kill between the two renames
leaves the new file and its digest in ``<name>.sha256.tmp``, and the next read or write finishes
the rename. A file that does not match its sha256 is never read and never overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict

import torch

from fedcore.data.partition import sha256_file

CHECKPOINT_VERSION = 2


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted. It is left on disk untouched."""


class RunInterrupted(RuntimeError):
    """Raised by ``stop_after``: the run stopped on purpose after a checkpoint."""


@dataclass(frozen=True)
class Saved:
    """A checkpoint as read back: the config fingerprint it was written under, and its payload."""

    fingerprint: str
    payload: Dict[str, Any]


def _paths(folder: Path, name: str):
    return folder / f"{name}.pt", folder / f"{name}.sha256"


def _finish_interrupted_save(path: Path, digest_path: Path) -> None:
    """A save killed between its two renames left the new file in place and its digest pending: move it in."""
    pending = digest_path.with_name(digest_path.name + ".tmp")
    if pending.exists() and path.exists() and sha256_file(path) == pending.read_text().strip():
        pending.replace(digest_path)


def save_state(folder: str | Path, payload: Dict[str, Any], *, fingerprint: str, name: str = "server_state") -> Path:
    """Atomically write ``payload`` (plus its config ``fingerprint``) and its sha256; returns the path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path, digest_path = _paths(folder, name)
    _finish_interrupted_save(path, digest_path)
    if path.exists() and digest_path.exists() and sha256_file(path) != digest_path.read_text().strip():
        raise CheckpointError(f"refusing to overwrite {path}: it does not match its sha256 (corrupt); move it away")
    tmp, pending = folder / f"{name}.pt.tmp", folder / f"{name}.sha256.tmp"
    torch.save({"version": CHECKPOINT_VERSION, "fingerprint": fingerprint, "payload": payload}, tmp)
    pending.write_text(sha256_file(tmp) + "\n")
    tmp.replace(path)
    try:
        pending.replace(digest_path)
    except FileNotFoundError:  # a reader found the new file first and finished the rename itself
        if not digest_path.exists():
            raise
    return path


def load_state(folder: str | Path, *, fingerprint: str | None = None, name: str = "server_state") -> Saved | None:
    """The saved checkpoint, or ``None`` when there is none.

    Raises :class:`CheckpointError` for a file that does not match its sha256, an old format,
    or (when ``fingerprint`` is given) a checkpoint written by another config.
    """
    folder = Path(folder)
    path, digest_path = _paths(folder, name)
    if not path.exists():
        return None
    _finish_interrupted_save(path, digest_path)
    if not digest_path.exists():
        raise CheckpointError(
            f"checkpoint {path} has no sha256 file ({digest_path.name}), so it cannot be checked; it has been left "
            "untouched. Move it away to start fresh, or restore the folder from the MLflow run's artifacts."
        )
    if sha256_file(path) != digest_path.read_text().strip():
        raise CheckpointError(
            f"checkpoint {path} does not match its sha256 file (truncated or corrupt). It has been left untouched; "
            "move it away to start fresh, or restore the folder from the MLflow run's artifacts."
        )
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {path} cannot be read as plain tensors and containers ({exc}); move it away to start fresh"
        ) from exc
    if not isinstance(raw, dict) or raw.get("version") != CHECKPOINT_VERSION:
        found = raw.get("version") if isinstance(raw, dict) else type(raw).__name__
        raise CheckpointError(
            f"checkpoint {path} has format {found}, expected {CHECKPOINT_VERSION}; move it away to start fresh"
        )
    if fingerprint is not None and raw["fingerprint"] != fingerprint:
        raise CheckpointError(
            f"checkpoint in {folder} was written by another config ({raw['fingerprint']} "
            f"!= {fingerprint}); resume with the same config or use a fresh checkpoint folder"
        )
    return Saved(fingerprint=raw["fingerprint"], payload=raw["payload"])


def has_state(folder: str | Path, *, name: str = "server_state") -> bool:
    return _paths(Path(folder), name)[0].exists()
