"""Real data, corruptions and partitions."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedcore.data.partition import Build, Partition, build_partition, build_text, sha256_arrays, sha256_file
from fedcore.data.sources import LOADERS, ImageSet, load_dataset

__all__ = [
    "CORRUPTION_NAMES",
    "corrupt",
    "Partition",
    "build_partition",
    "ImageSet",
    "load_dataset",
    "LOADERS",
    "save_prepared",
    "load_prepared",
    "sha256_arrays",
    "sha256_file",
]


def __getattr__(name: str):
    # the corruptions on first use: OpenCV, scikit-image and scipy.ndimage are 0.4 s of import that a
    # process reading partitions (a Ray worker) never needs
    if name in ("CORRUPTION_NAMES", "corrupt"):
        from fedcore.data import corruptions

        return getattr(corruptions, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def save_prepared(data: ImageSet, path: str | Path) -> str:
    """Write a loaded dataset as one npz; returns the sha256 of its arrays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, x=data.x, y=data.y, num_classes=np.int64(data.num_classes))
    tmp.replace(path)
    return sha256_arrays(data.x, data.y)


def load_prepared(
    path: str | Path,
    *,
    build: Build = "`dvc repro prepare@mnist` (or `python -m flows.stages prepare`)",
) -> ImageSet:
    """The images :func:`save_prepared` wrote; ``build``: the command that writes them (or what works it out),
    for the error when they are missing."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prepared data {path} is missing. Build it with {build_text(build)}.")
    with np.load(path) as z:
        return ImageSet(z["x"], z["y"], int(z["num_classes"]))
