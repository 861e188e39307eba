"""Domain-silo data: the domain sets, their stand-ins, and the one-domain-per-client partition."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from fedcore.data.domains import (
    DOMAIN_SETS,
    FASHION_CLASSES,
    FONT_FILES,
    DomainPartition,
    DomainSet,
    abs_diff_blend,
    build_domain_partition,
    fonts_used,
    load_domains,
    mnist_halves,
    read_idx,
    shard_sizes,
    to_rgb,
)
from fedcore.data.partition import sha256_arrays
from fedcore.data.sources import CIFAR10_CLASSES


def _shared_root() -> Path | None:
    here = Path(__file__).resolve().parents[3] / "shared" / "data"
    if here.is_dir():
        return here
    env = os.environ.get("FEDCORE_SHARED_DATA")
    return Path(env) if env and Path(env).is_dir() else None


SHARED = _shared_root()


def shared_file(name: str) -> Path:
    """The shared data root; a missing file fails, naming where it was looked for.

    The project always runs beside ../shared/data (CI included), so a missing file is a broken
    set-up, not a reason to skip the tests of the real domains.
    """
    missing = (
        "needs ../shared/data (or FEDCORE_SHARED_DATA): not found"
        if SHARED is None
        else f"needs {name} under {SHARED}: not found"
        if not (SHARED / name).is_file()
        else None
    )
    if missing is not None:
        pytest.fail(f"{missing}; clone beside ../shared/data or set FEDCORE_SHARED_DATA (see ../shared/data/README.md)")
    return SHARED


def grey(x: np.ndarray) -> bool:
    return bool(np.array_equal(x[..., 0], x[..., 1]) and np.array_equal(x[..., 1], x[..., 2]))


# ---------------------------------------------------------------------------------------------
# Domain sets
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local16():
    return load_domains("digits_local", None, size=16, seed=0, max_per_domain=300)


@pytest.fixture(scope="module")
def digits16():
    """The whole 'digits' set at 16 px (about 19k images, ~2 s)."""
    return load_domains("digits", shared_file("cifar10-jpeg.zip") and shared_file("usps.npz"), size=16, seed=0)


def check_domain_set(ds: DomainSet, size: int) -> None:
    n = len(ds)
    assert ds.x.dtype == np.uint8 and ds.x.shape == (n, size, size, 3)
    assert ds.y.dtype == np.int64 and ds.y.shape == (n,)
    assert ds.d.dtype == np.int64 and ds.d.shape == (n,)
    assert ds.source_index.dtype == np.int64 and ds.source_index.shape == (n,)
    assert 0 <= ds.y.min() and ds.y.max() < len(ds.classes)
    assert sorted(np.unique(ds.d).tolist()) == list(range(len(ds.domains)))
    for k, name in enumerate(ds.domains):
        x = ds.x[ds.d == k]
        assert len(np.unique(ds.y[ds.d == k])) == len(ds.classes), f"{name} misses a class"
        assert x.max() >= 200 and x.min() <= 60, f"{name} images do not span the 0..255 range"
        assert x.astype(np.float32).std(axis=(1, 2, 3)).min() > 5, f"{name} has a blank image"
        assert len(np.unique(ds.source_index[ds.d == k])) == len(x), f"{name} repeats a source image"


def test_local_set_shapes_and_caps(local16):
    check_domain_set(local16, 16)
    assert local16.domains == ("mnist", "fonts", "sklearn") == DOMAIN_SETS["digits_local"]
    assert local16.classes == tuple("0123456789")
    assert local16.counts() == {"mnist": 300, "fonts": 300, "sklearn": 300}
    for k in range(3):  # class-stratified cap of (near-)balanced domains: 30 per class, within 2
        c = np.bincount(local16.y[local16.d == k], minlength=10)
        assert c.max() - c.min() <= 2, c
    assert grey(local16.x[local16.d == 0]) and grey(local16.x[local16.d == 2])
    assert not grey(local16.x[local16.d == 1]), "fonts are rendered in colour"


def test_digits_full_counts_shapes_and_colour(digits16):
    check_domain_set(digits16, 16)
    assert digits16.domains == ("mnist", "usps", "fonts", "mnist_on_cifar", "sklearn")
    assert digits16.counts() == {"mnist": 2500, "usps": 9298, "fonts": 3000, "mnist_on_cifar": 2500, "sklearn": 1797}
    for name in ("mnist", "usps", "sklearn"):
        assert grey(digits16.x[digits16.rows(name)]), name
    assert not grey(digits16.x[digits16.rows("mnist_on_cifar")])


def test_mnist_and_mnist_on_cifar_share_no_digit(digits16):
    a = digits16.source_index[digits16.rows("mnist")]
    b = digits16.source_index[digits16.rows("mnist_on_cifar")]
    assert not set(a.tolist()) & set(b.tolist())
    assert sorted(np.r_[a, b].tolist()) == list(range(5000)), "the two halves cover the 5k once"
    for name in ("mnist", "mnist_on_cifar"):
        assert np.bincount(digits16.y[digits16.rows(name)]).tolist() == [250] * 10


def test_mnist_halves_disjoint_and_seeded():
    y = np.repeat(np.arange(10), 500)
    a, b = mnist_halves(y, 0)
    assert not set(a.tolist()) & set(b.tolist()) and len(a) == len(b) == 2500
    assert np.bincount(y[a]).tolist() == [250] * 10
    assert np.array_equal(mnist_halves(y, 0)[0], a)
    assert not np.array_equal(mnist_halves(y, 1)[0], a)


def test_abs_diff_blend_is_the_mnist_m_formula():
    digit = np.array([[0, 255], [100, 0]], np.uint8)
    bg = np.array([[[10, 20, 30], [10, 250, 255]], [[100, 0, 200], [7, 7, 7]]], np.uint8)
    out = abs_diff_blend(digit, bg)
    assert out.dtype == np.uint8
    assert out.tolist() == [[[10, 20, 30], [245, 5, 0]], [[0, 100, 100], [7, 7, 7]]]
    with pytest.raises(ValueError, match="background must be digit.shape"):
        abs_diff_blend(digit, bg[..., :1])


@pytest.mark.shared_data
def test_mnist_on_cifar_is_its_mnist_digit_on_a_cifar_background():
    """At 32 px the crop is a whole CIFAR image: each image must be |bg - digit| for one pool image."""
    from fedcore.data.domains import _mnist5k, cifar_backgrounds, to_rgb

    root = shared_file("cifar10-jpeg.zip")
    ds = load_domains("digits", root, size=32, seed=0, max_per_domain=20, domains=["mnist_on_cifar"])
    bgs = cifar_backgrounds(root)
    x5k, y5k = _mnist5k(str(root))
    assert np.array_equal(ds.y, y5k[ds.source_index])
    digits = to_rgb(x5k[ds.source_index], 32)[..., 0]
    for out, digit in zip(ds.x, digits):
        cands = np.abs(bgs.astype(np.int16) - digit[None, ..., None].astype(np.int16))
        assert (cands == out[None]).all(axis=(1, 2, 3)).any(), "no CIFAR background explains this image"


def test_same_seed_same_data_other_seed_other_data():
    kw = dict(size=16, max_per_domain=60, fonts_per_class=20)
    a = load_domains("digits_local", None, seed=0, **kw)
    b = load_domains("digits_local", None, seed=0, **kw)
    c = load_domains("digits_local", None, seed=1, **kw)
    assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y) and np.array_equal(a.source_index, b.source_index)
    for name in ("mnist", "fonts", "sklearn"):
        same = np.array_equal(a.x[a.rows(name)], c.x[c.rows(name)])
        assert not same, f"{name} did not change with the seed"


@pytest.mark.shared_data
def test_mnist_on_cifar_is_seeded():
    root = shared_file("cifar10-jpeg.zip")
    kw = dict(size=16, max_per_domain=50, domains=["mnist_on_cifar"])
    a = load_domains("digits", root, seed=0, **kw)
    assert np.array_equal(a.x, load_domains("digits", root, seed=0, **kw).x)
    assert not np.array_equal(a.x, load_domains("digits", root, seed=1, **kw).x)


def test_a_capped_domain_is_a_subset_of_the_full_one():
    full = load_domains("digits_local", None, size=16, seed=3, domains=["fonts", "sklearn"], fonts_per_class=30)
    cap = load_domains(
        "digits_local", None, size=16, seed=3, domains=["fonts", "sklearn"], fonts_per_class=30, max_per_domain=40
    )
    for name in ("fonts", "sklearn"):
        f, c = full.rows(name), cap.rows(name)
        pos = {s: i for i, s in enumerate(full.source_index[f])}
        back = f[[pos[s] for s in cap.source_index[c]]]
        assert np.array_equal(full.x[back], cap.x[c]) and np.array_equal(full.y[back], cap.y[c])


def test_domain_subset_keeps_the_given_order(local16):
    ds = load_domains("digits_local", None, size=16, seed=0, max_per_domain=300, domains=["sklearn", "mnist"])
    assert ds.domains == ("sklearn", "mnist")
    assert np.array_equal(ds.x[ds.rows("sklearn")], local16.x[local16.rows("sklearn")])


def test_fonts_are_balanced_and_readable():
    ds = load_domains("digits_local", None, size=16, seed=0, domains=["fonts"], fonts_per_class=100)
    assert np.bincount(ds.y, minlength=10).tolist() == [100] * 10
    import cv2

    feats = []
    for im in ds.x:  # the ink, whatever its colour, cropped to its box: position- and colour-free
        g = im.astype(np.float32).mean(-1)
        ink = np.abs(g - np.median(np.r_[g[0], g[-1], g[:, 0], g[:, -1]]))
        ink /= ink.max() + 1e-6
        ys, xs = np.nonzero(ink > 0.5)
        feats.append(
            cv2.resize(
                ink[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1], (12, 12), interpolation=cv2.INTER_AREA
            ).ravel()
        )
    f = np.stack(feats)
    f = (f - f.mean(1, keepdims=True)) / (f.std(1, keepdims=True) + 1e-6)
    perm = np.random.default_rng(0).permutation(len(ds))
    tr, te = perm[: len(ds) // 2], perm[len(ds) // 2 :]

    def nearest_centroid(labels):
        cent = np.stack([f[tr][labels[tr] == c].mean(0) for c in range(10)])
        pred = np.argmin(((f[te][:, None] - cent[None]) ** 2).sum(-1), axis=1)
        return float((pred == labels[te]).mean())

    assert nearest_centroid(ds.y) > 0.5, "rendered digits are not recognisable"
    shuffled = np.random.default_rng(1).permutation(ds.y)
    assert nearest_centroid(shuffled) < 0.3, "the check itself must fail on meaningless labels"


def test_fonts_kept_are_digit_fonts():
    used = fonts_used()
    assert set(used) <= set(FONT_FILES) and len(used) >= 10
    assert "DejaVuSans.ttf" in used
    for bad in (
        "cmsy10.ttf",
        "cmex10.ttf",
        "STIXSizOneSymReg.ttf",
        "LastResortHE-Regular.ttf",
        "DejaVuSansDisplay.ttf",
        "STIXNonUni.ttf",
    ):
        assert bad not in used


@pytest.mark.shared_data
def test_pacs_shapes_names_and_cap():
    root = shared_file("pacs64.npz")
    ds = load_domains("pacs", root, size=32, seed=0, max_per_domain=100)
    check_domain_set(ds, 32)
    assert ds.domains == ("photo", "art_painting", "cartoon", "sketch")
    assert ds.classes == ("dog", "elephant", "giraffe", "guitar", "horse", "house", "person")
    assert ds.counts() == dict.fromkeys(ds.domains, 100)
    sub = load_domains("pacs", root, size=32, seed=0, max_per_domain=100, domains=["sketch"])
    assert np.array_equal(sub.x, ds.x[ds.rows("sketch")])
    with pytest.raises(ValueError, match="valid names for that set are: photo, art_painting, cartoon, sketch"):
        load_domains("pacs", root, size=32, seed=0, domains=["clipart"])


def test_missing_files_name_the_file_and_root(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"usps.npz not found under data root {tmp_path}"):
        load_domains("digits", tmp_path, size=16, seed=0, max_per_domain=20)
    with pytest.raises(FileNotFoundError, match=f"cifar10-jpeg.zip not found under data root {tmp_path}"):
        load_domains("digits", tmp_path, size=16, seed=0, max_per_domain=20, domains=["mnist_on_cifar"])
    with pytest.raises(FileNotFoundError, match=f"pacs64.npz not found under data root {tmp_path}"):
        load_domains("pacs", tmp_path, size=32, seed=0)
    with pytest.raises(FileNotFoundError, match="use 'digits_local'"):
        load_domains("digits", None, size=16, seed=0, domains=["usps"])


# ---------------------------------------------------------------------------------------------
# Single-domain sets: Fashion-MNIST and CIFAR-10
# ---------------------------------------------------------------------------------------------


FASHION_GZ = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


def idx_bytes(arr: np.ndarray, magic: int | None = None, dims: tuple | None = None) -> bytes:
    """An uncompressed IDX file of uint8 ``arr`` (header magic / dims overridable to corrupt it)."""
    arr = np.asarray(arr, np.uint8)
    magic = 0x0800 + arr.ndim if magic is None else magic
    dims = arr.shape if dims is None else dims
    return magic.to_bytes(4, "big") + np.asarray(dims, ">u4").tobytes() + arr.tobytes()


def write_gz(path: Path, raw: bytes) -> Path:
    path.write_bytes(gzip.compress(raw))
    return path


@pytest.fixture(scope="module")
def fashion1k():
    return load_domains(
        "fashion", shared_file("fashion-mnist/train-images-idx3-ubyte.gz"), size=28, seed=0, max_per_domain=1000
    )


@pytest.mark.shared_data
def test_fashion_shapes_names_and_balance(fashion1k):
    ds = fashion1k
    check_domain_set(ds, 28)
    assert ds.name == "fashion" and ds.domains == ("fashion",) == DOMAIN_SETS["fashion"]
    assert ds.classes == FASHION_CLASSES and len(ds.classes) == 10 and ds.classes[0] == "T-shirt/top"
    assert ds.counts() == {"fashion": 1000} and (ds.d == 0).all()
    assert np.bincount(ds.y, minlength=10).tolist() == [100] * 10  # 7,000 per class: exactly stratified
    assert grey(ds.x)
    # source_index is the row of train + test (train first) in the original IDX files.
    folder = SHARED / "fashion-mnist"
    raw_x = np.concatenate([read_idx(folder / FASHION_GZ[0], ndim=3), read_idx(folder / FASHION_GZ[2], ndim=3)])
    raw_y = np.concatenate([read_idx(folder / FASHION_GZ[1], ndim=1), read_idx(folder / FASHION_GZ[3], ndim=1)])
    assert ds.source_index.max() < 70000 and (ds.source_index >= 60000).any()
    assert np.array_equal(ds.x[..., 0], raw_x[ds.source_index]) and np.array_equal(ds.y, raw_y[ds.source_index])


@pytest.mark.shared_data
def test_fashion_full_set_cap_seed_and_partition(fashion1k):
    root = shared_file("fashion-mnist/train-images-idx3-ubyte.gz")
    full = load_domains("fashion", root, size=28, seed=0)
    assert full.x.shape == (70000, 28, 28, 3) and full.x.dtype == np.uint8
    assert np.bincount(full.y).tolist() == [7000] * 10
    assert np.array_equal(full.source_index, np.arange(70000))
    assert np.array_equal(full.x[fashion1k.source_index], fashion1k.x), "a capped set is a subset of the full one"
    other = load_domains("fashion", root, size=28, seed=1, max_per_domain=1000)
    assert not np.array_equal(other.source_index, fashion1k.source_index)
    big = load_domains("fashion", root, size=32, seed=0, max_per_domain=1000)
    assert big.x.shape == (1000, 32, 32, 3) and np.array_equal(big.source_index, fashion1k.source_index)
    part = build_domain_partition(
        fashion1k, clients_per_domain={"fashion": 1}, test_fraction=0.3, size_skew=0.0, seed=0
    )
    assert part.num_clients == 1 and part.domains == ("fashion",) and part.classes == FASHION_CLASSES
    assert len(part.client_y[0]) == 700 and len(part.test_y[0]) == 300
    assert np.bincount(part.test_y[0]).tolist() == [30] * 10


def test_read_idx_reads_a_good_file(tmp_path):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    out = read_idx(write_gz(tmp_path / "ok.gz", idx_bytes(arr)), ndim=3, count=2, shape=(3, 4))
    assert out.dtype == np.uint8 and np.array_equal(out, arr)


@pytest.mark.parametrize(
    "raw, kwargs, match",
    [
        (None, dict(ndim=1), "is not a readable gzip file"),  # not gzip at all
        (b"truncated", dict(ndim=1), "is not a readable gzip file"),  # gzip cut short
        (idx_bytes(np.zeros(5, np.uint8), magic=0x0803), dict(ndim=1), "magic number 0x00000803, expected 0x00000801"),
        (idx_bytes(np.zeros((2, 2, 2), np.uint8), magic=0x0D03), dict(ndim=3), "magic number 0x00000d03"),  # floats
        (b"\x00\x00", dict(ndim=1), "shorter than 4 bytes"),
        (b"\x00\x00\x08\x03\x00\x00", dict(ndim=3), "ends inside its IDX header"),
        (idx_bytes(np.zeros(5, np.uint8), dims=(6,)), dict(ndim=1), r"header gives shape \(6,\).*but 5 bytes follow"),
        (idx_bytes(np.zeros(5, np.uint8)) + b"x", dict(ndim=1), "but 6 bytes follow"),
        (idx_bytes(np.zeros(5, np.uint8)), dict(ndim=1, count=60000), "holds 5 items, expected 60000"),
        (
            idx_bytes(np.zeros((2, 3, 3), np.uint8)),
            dict(ndim=3, shape=(28, 28)),
            r"shape \(3, 3\), expected \(28, 28\)",
        ),
    ],
)
def test_read_idx_rejects_corrupt_files(tmp_path, raw, kwargs, match):
    path = tmp_path / "bad-idx1-ubyte.gz"
    if raw is None:
        path.write_bytes(b"this is not gzip")
    elif raw == b"truncated":
        path.write_bytes(gzip.compress(idx_bytes(np.arange(200, dtype=np.uint8)))[:-12])
    else:
        write_gz(path, raw)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + match):
        read_idx(path, **kwargs)


def test_fashion_rejects_a_corrupt_file_in_its_folder(tmp_path):
    folder = tmp_path / "fashion-mnist"
    folder.mkdir()
    for name in FASHION_GZ:  # valid IDX files, but 3 items instead of 60,000 / 10,000
        arr = np.zeros((3, 28, 28) if "images" in name else (3,), np.uint8)
        write_gz(folder / name, idx_bytes(arr))
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz holds 3 items, expected 60000"):
        load_domains("fashion", tmp_path, size=28, seed=0, max_per_domain=10)


def test_fashion_missing_files_name_the_file_and_folder(tmp_path, monkeypatch):
    import fedcore.data.domains as dm

    monkeypatch.setattr(dm, "FASHION_SYSTEM_DIR", tmp_path / "no-system-copy")
    with pytest.raises(
        FileNotFoundError,
        match=re.escape("needs fashion-mnist/train-images-idx3-ubyte.gz")
        + ".*"
        + re.escape(f"{tmp_path / 'fashion-mnist'} does not exist")
        + ".*dataset-fashion-mnist",
    ):
        load_domains("fashion", tmp_path, size=28, seed=0, max_per_domain=10)
    with pytest.raises(FileNotFoundError, match="no root was given"):
        load_domains("fashion", None, size=28, seed=0, max_per_domain=10)
    folder = tmp_path / "fashion-mnist"
    folder.mkdir()
    for name in FASHION_GZ[:3]:
        (folder / name).write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=re.escape(f"t10k-labels-idx1-ubyte.gz not found in {folder}")):
        load_domains("fashion", tmp_path, size=28, seed=0, max_per_domain=10)


@pytest.mark.shared_data
def test_fashion_falls_back_to_the_system_folder(tmp_path, monkeypatch, fashion1k):
    import fedcore.data.domains as dm

    shared = shared_file("fashion-mnist/train-images-idx3-ubyte.gz") / "fashion-mnist"
    monkeypatch.setattr(dm, "FASHION_SYSTEM_DIR", shared)  # stands in for /usr/share/datasets/fashion-mnist
    for root in (tmp_path, None):  # no fashion-mnist/ under the root, or no root at all
        ds = load_domains("fashion", root, size=28, seed=0, max_per_domain=1000)
        assert np.array_equal(ds.x, fashion1k.x) and np.array_equal(ds.y, fashion1k.y)


@pytest.fixture(scope="module")
def cifar500():
    """500 CIFAR-10 images; the first load in a process decodes all 60,000 jpgs (~10 s)."""
    return load_domains("cifar10", shared_file("cifar10-jpeg.zip"), size=32, seed=0, max_per_domain=500)


@pytest.mark.shared_data
def test_cifar10_shapes_names_and_balance(cifar500):
    ds = cifar500
    assert ds.x.shape == (500, 32, 32, 3) and ds.x.dtype == np.uint8
    check_domain_set(ds, 32)
    assert ds.name == "cifar10" and ds.domains == ("cifar10",) == DOMAIN_SETS["cifar10"]
    assert ds.classes == CIFAR10_CLASSES
    assert np.bincount(ds.y, minlength=10).tolist() == [50] * 10
    assert not grey(ds.x)
    assert ds.source_index.max() < 60000 and (ds.source_index >= 50000).any(), "train and test rows both drawn"


@pytest.mark.shared_data
def test_cifar10_decodes_once_resizes_and_partitions(cifar500):
    import fedcore.data.domains as dm

    root = shared_file("cifar10-jpeg.zip")
    misses = dm._cifar10_arrays.cache_info().misses
    small = load_domains("cifar10", root, size=16, seed=0, max_per_domain=500)
    other = load_domains("cifar10", root, size=32, seed=1, max_per_domain=500)
    assert dm._cifar10_arrays.cache_info().misses == misses, "the zip was decoded a second time"
    assert small.x.shape == (500, 16, 16, 3) and np.array_equal(small.source_index, cifar500.source_index)
    assert np.array_equal(small.x, to_rgb(cifar500.x, 16)) and np.array_equal(small.y, cifar500.y)
    assert not np.array_equal(other.source_index, cifar500.source_index)
    part = build_domain_partition(cifar500, clients_per_domain={"cifar10": 2}, test_fraction=0.3, size_skew=0.0, seed=0)
    assert part.num_clients == 2 and [len(y) for y in part.client_y] == [175, 175]
    assert np.bincount(part.test_y[0]).tolist() == [15] * 10


def test_cifar10_missing_file_names_the_file_and_root(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"cifar10-jpeg.zip not found under data root {tmp_path}")):
        load_domains("cifar10", tmp_path, size=32, seed=0, max_per_domain=10)
    with pytest.raises(FileNotFoundError, match="'cifar10' domain set needs cifar10-jpeg.zip.*no root was given"):
        load_domains("cifar10", None, size=32, seed=0, max_per_domain=10)
    with pytest.raises(ValueError, match=r"unknown domain\(s\) \['svhn'\] for the 'cifar10' set"):
        load_domains("cifar10", tmp_path, size=32, seed=0, domains=["svhn"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(name="mnist"),
            "unknown domain set 'mnist'; valid names are: digits, pacs, digits_local, fashion, cifar10",
        ),
        (
            dict(domains=["svhn"]),
            r"unknown domain\(s\) \['svhn'\] .*valid names for that set are: mnist, fonts, sklearn",
        ),
        (dict(domains=["mnist", "mnist"]), "repeats a name"),
        (dict(domains="mnist"), r"write domains=\['mnist'\]"),
        (dict(size=4), "size must be an int >= 8"),
        (dict(max_per_domain=0), "max_per_domain must be a positive int or None"),
        (dict(seed=-1), "seed must be an int >= 0"),
    ],
)
def test_bad_load_arguments(kwargs, match):
    args = dict(name="digits_local", size=16, seed=0, max_per_domain=20) | kwargs
    name = args.pop("name")
    with pytest.raises(ValueError, match=match):
        load_domains(name, None, **args)


# ---------------------------------------------------------------------------------------------
# Partition
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def four():
    """Four synthetic domains of 400 images (40 per class), 8x8: fast and exact."""
    rng = np.random.default_rng(0)
    n = 1600
    return DomainSet(
        x=rng.integers(0, 256, size=(n, 8, 8, 3), dtype=np.uint8),
        y=np.tile(np.arange(10), n // 10),
        d=np.repeat(np.arange(4), 400),
        domains=("photo", "art_painting", "cartoon", "sketch"),
        classes=tuple("abcdefghij"),
        name="toy",
    )


SPLIT = {"photo": 3, "art_painting": 4, "cartoon": 2, "sketch": 1}


@pytest.fixture(scope="module")
def part(four):
    return build_domain_partition(four, clients_per_domain=SPLIT, test_fraction=0.2, seed=5, num_clients=10)


def test_clients_are_numbered_domain_by_domain(part):
    assert part.client_domain == [0, 0, 0, 1, 1, 1, 1, 2, 2, 3]
    assert part.num_clients == 10 and part.dataset == "toy" and part.num_classes == 10
    assert [part.domain_of(i) for i in (0, 3, 7, 9)] == ["photo", "art_painting", "cartoon", "sketch"]
    assert part.clients_of("cartoon") == [7, 8]
    with pytest.raises(ValueError, match="client_id must be in 0..9"):
        part.domain_of(10)


def test_shards_and_test_sets_partition_each_domain(part, four):
    for k, name in enumerate(part.domains):
        shards = [part.client_indices[i] for i in part.clients_of(name)]
        test = part.test_indices[k]
        joined = np.concatenate(shards + [test])
        assert len(np.unique(joined)) == len(joined), f"{name}: a row is in two places"
        assert np.array_equal(np.sort(joined), four.rows(name)), f"{name}: rows lost or foreign"
        assert (four.d[joined] == four.domain_index(name)).all()
        # a class-stratified 20% test set: 8 of each class's 40 rows
        assert np.bincount(four.y[test], minlength=10).tolist() == [8] * 10
    for i, idx in enumerate(part.client_indices):
        assert np.array_equal(part.client_x[i], four.x[idx]) and np.array_equal(part.client_y[i], four.y[idx])
    for k, idx in enumerate(part.test_indices):
        assert np.array_equal(part.test_x[k], four.x[idx]) and np.array_equal(part.test_y[k], four.y[idx])


def test_equal_shards_without_skew(part):
    for name in part.domains:
        sizes = [len(part.client_indices[i]) for i in part.clients_of(name)]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 320, (name, sizes)


def test_size_skew_gives_strictly_decreasing_shards(four):
    p = build_domain_partition(four, clients_per_domain=SPLIT, size_skew=1.0, seed=5)
    for name in p.domains:
        sizes = [len(p.client_indices[i]) for i in p.clients_of(name)]
        assert all(a > b for a, b in zip(sizes, sizes[1:])), (name, sizes)
        assert min(sizes) >= 10 and sum(sizes) == 320
    assert shard_sizes(100, 4, 1.0).tolist() == [48, 24, 16, 12]
    assert shard_sizes(10, 3, 0.0).tolist() == [4, 3, 3]


def test_default_partitions_are_pinned(four, part):
    """Golden manifests (computed before label_alpha existed): options added later leave the defaults alone."""

    def digest(p):
        return hashlib.sha256(json.dumps(p.manifest()).encode()).hexdigest()

    assert digest(part) == "9f31e71cc7fe3df3f6fd2548f98b41ac3640c865395941c89b08ca23ad6bcffc"
    skewed = build_domain_partition(four, clients_per_domain=SPLIT, size_skew=1.0, seed=5)
    assert digest(skewed) == "e345ad08e061e5fe9ee6e0fcdcf1e4b3298503838d64750c54fe61893f9bf09c"


def test_label_alpha_skews_labels_and_keeps_every_row(four):
    """Dirichlet label skew: the same rows and test sets as the unskewed split, dealt by class."""
    one = {"photo": 5}
    skew = build_domain_partition(four, clients_per_domain=one, test_fraction=0.2, seed=5, label_alpha=0.3)
    flat = build_domain_partition(four, clients_per_domain=one, test_fraction=0.2, seed=5)
    assert np.array_equal(np.sort(np.concatenate(skew.client_indices)), np.sort(np.concatenate(flat.client_indices)))
    assert np.array_equal(skew.test_indices[0], flat.test_indices[0])  # the test split ignores the skew
    assert min(len(i) for i in skew.client_indices) >= 10 and skew.config["label_alpha"] == 0.3
    assert "label_alpha" not in flat.config  # unskewed partitions keep their old manifests

    def spread(p):  # mean over clients of the largest class share
        return np.mean([np.bincount(y, minlength=10).max() / len(y) for y in p.client_y])

    assert spread(skew) > spread(flat) + 0.1
    near_iid = build_domain_partition(four, clients_per_domain=one, test_fraction=0.2, seed=5, label_alpha=1000.0)
    assert spread(near_iid) < spread(skew)
    again = build_domain_partition(four, clients_per_domain=one, test_fraction=0.2, seed=5, label_alpha=0.3)
    assert json.dumps(again.manifest()) == json.dumps(skew.manifest())


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"label_alpha": 0.0}, "label_alpha must be a finite number > 0"),
        ({"label_alpha": float("nan")}, "label_alpha must be a finite number > 0"),
        ({"label_alpha": 1.0, "size_skew": 1.0}, "set size_skew: 0 or label_alpha: null"),
    ],
)
def test_label_alpha_rejects_bad_values(four, kw, match):
    with pytest.raises(ValueError, match=match):
        build_domain_partition(four, clients_per_domain={"photo": 3}, **kw)


def test_label_alpha_names_the_domain_it_cannot_split(four):
    with pytest.raises(
        ValueError,
        match=r"domain 'photo': 320 training rows cannot give 40 clients 10 rows each; "
        r"lower clients_per_domain\['photo'\] or raise max_per_domain",
    ):
        build_domain_partition(four, clients_per_domain={"photo": 40}, label_alpha=1.0)
    with pytest.raises(
        ValueError, match=r"label_alpha=0.001 left a client with fewer than 10 rows .* raise label_alpha"
    ):
        build_domain_partition(four, clients_per_domain={"photo": 30}, label_alpha=0.001)


def test_test_split_does_not_depend_on_client_counts(four, part):
    other = build_domain_partition(
        four, clients_per_domain={"photo": 1, "art_painting": 2, "cartoon": 5, "sketch": 3}, test_fraction=0.2, seed=5
    )
    for a, b in zip(part.test_indices, other.test_indices):
        assert np.array_equal(a, b)


def test_a_domain_with_no_clients_is_dropped(four):
    p = build_domain_partition(four, clients_per_domain={"photo": 2, "cartoon": 0, "sketch": 1}, seed=0)
    assert p.domains == ("photo", "sketch") and p.client_domain == [0, 0, 1] and len(p.test_x) == 2
    assert p.config["clients_per_domain"] == {"photo": 2, "art_painting": 0, "cartoon": 0, "sketch": 1}


def test_partition_is_seeded(four, part):
    again = build_domain_partition(four, clients_per_domain=SPLIT, test_fraction=0.2, seed=5, num_clients=10)
    assert json.dumps(again.manifest()) == json.dumps(part.manifest())
    other = build_domain_partition(four, clients_per_domain=SPLIT, test_fraction=0.2, seed=6, num_clients=10)
    assert not np.array_equal(other.client_indices[0], part.client_indices[0])


def test_manifest_names_every_sample(part):
    m = part.manifest()
    assert (m["dataset"], m["seed"], m["domains"]) == ("toy", 5, ["photo", "art_painting", "cartoon", "sketch"])
    assert m["config"]["num_clients"] == 10 and m["config"]["test_fraction"] == 0.2
    for rec, x, y, idx in zip(m["clients"], part.client_x, part.client_y, part.client_indices):
        assert rec["indices"] == idx.tolist() and rec["sha256"] == sha256_arrays(x, y)
        assert sum(rec["class_counts"]) == len(y)
    assert [t["domain"] for t in m["test"]] == list(part.domains)
    json.dumps(m)


def test_save_load_round_trip(tmp_path, part):
    folder = part.save(tmp_path / "p")
    assert sorted(f.name for f in folder.iterdir()) == ["manifest.json", "partition.npz"]
    back = DomainPartition.load(folder)
    assert json.dumps(back.manifest()) == json.dumps(part.manifest())
    assert back.client_domain == part.client_domain and back.domains == part.domains
    assert back.classes == part.classes and back.config == part.config
    for a, b in zip(back.client_x + back.test_x, part.client_x + part.test_x):
        assert np.array_equal(a, b) and a.dtype == b.dtype


def test_a_flipped_byte_is_caught_on_load(tmp_path, part):
    folder = part.save(tmp_path / "p")
    with np.load(folder / "partition.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays["c3_x"] = arrays["c3_x"].copy()
    arrays["c3_x"].reshape(-1)[17] ^= 0x01
    np.savez(folder / "partition.npz", **arrays)
    with pytest.raises(ValueError, match=r"client 3 \(domain 'art_painting'\) .* does not match its manifest sha256"):
        DomainPartition.load(folder)


@pytest.mark.parametrize("damage", ["empty", "truncate", "garble", "manifest"])
def test_a_truncated_or_garbled_partition_names_the_file_and_the_rebuild(tmp_path, damage):
    from fedcore.data.partition import read_arrays, write_arrays

    folder = write_arrays(tmp_path / "p", {"x": np.arange(4096, dtype=np.int64)}, {"clients": 1})
    npz, raw = folder / "partition.npz", (folder / "partition.npz").read_bytes()
    if damage == "empty":
        npz.write_bytes(b"")
    elif damage == "truncate":
        npz.write_bytes(raw[:200])
    elif damage == "garble":  # a flipped byte inside the stored array: the zip's CRC no longer matches
        npz.write_bytes(raw[:1000] + bytes([raw[1000] ^ 0xFF]) + raw[1001:])
    else:
        (folder / "manifest.json").write_text("{not json")
    with pytest.raises(
        ValueError,
        match=rf"the domain partition at {folder} cannot be read .*truncated or corrupt\. "
        r"Move it away and rebuild it with `dvc repro partition_domains@quick`",
    ):
        read_arrays(folder, what="domain partition", build="`dvc repro partition_domains@quick`")


def test_missing_partition_says_how_to_build_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"Build it with `dvc repro partition_domains@<grid>` for the grid"):
        DomainPartition.load(tmp_path / "none")
    with pytest.raises(FileNotFoundError, match=r"Build it with `dvc repro partition_domains@pacs`\.$"):
        DomainPartition.load(tmp_path / "none", build="`dvc repro partition_domains@pacs`")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(clients_per_domain={"photo": 2, "clipart": 1}),
            r"unknown domain\(s\) \['clipart'\].*valid names for this set are: photo, art_painting, cartoon, sketch",
        ),
        (dict(clients_per_domain={"photo": -1}), r"clients_per_domain\['photo'\] must be an int >= 0"),
        (dict(clients_per_domain={"photo": 0, "sketch": 0}), "0 clients in total; give at least one"),
        (
            dict(clients_per_domain={"photo": 3, "art_painting": 4, "cartoon": 2, "sketch": 2}, num_clients=10),
            "the domain split 3/4/2/2 .* sums to 11, not num_clients=10; change clients_per_domain or num_clients",
        ),
        (dict(test_fraction=0.0), r"test_fraction must be in \(0, 1\), got 0.0"),
        (dict(test_fraction=1.0), r"test_fraction must be in \(0, 1\), got 1.0"),
        (dict(size_skew=-0.5), "size_skew must be a finite number >= 0"),
        (dict(clients_per_domain={"sketch": 40}), "lower size_skew or the number of clients"),
        (dict(clients_per_domain={"sketch": 8}, size_skew=2.0), r"smallest shard \d+\); lower size_skew"),
        (dict(clients_per_domain=[3, 4, 2, 1]), "clients_per_domain must map domain names to client counts"),
    ],
)
def test_bad_partition_arguments(four, kwargs, match):
    args = dict(clients_per_domain=SPLIT) | kwargs
    with pytest.raises(ValueError, match=match):
        build_domain_partition(four, **args)


def test_partition_of_real_local_domains(local16):
    p = build_domain_partition(
        local16, clients_per_domain={"mnist": 2, "fonts": 2, "sklearn": 1}, seed=0, num_clients=5
    )
    assert p.dataset == "digits_local" and p.client_domain == [0, 0, 1, 1, 2]
    assert [len(t) for t in p.test_y] == [60, 60, 60]
    assert sum(len(y) for y in p.client_y) + sum(len(t) for t in p.test_y) == len(local16)
    assert p.client_x[0].shape[1:] == (16, 16, 3) and p.config["image_size"] == 16


def test_sklearn_domain_is_load_digits():
    from sklearn.datasets import load_digits

    from fedcore.data.domains import _sklearn_digits

    images, target = _sklearn_digits()
    ref = load_digits()
    assert np.array_equal(images, ref.images) and np.array_equal(target, ref.target)


def test_rows_per_client_gives_every_client_the_same_shard_from_its_own_domain(four):
    """Equal shards across domains (the FedPAD paper's aim): domains differ in client count only."""
    counts = {"photo": 3, "art_painting": 4, "cartoon": 2, "sketch": 1}
    eq = build_domain_partition(four, clients_per_domain=counts, test_fraction=0.2, seed=5, rows_per_client=75)
    plain = build_domain_partition(four, clients_per_domain=counts, test_fraction=0.2, seed=5)
    assert [len(i) for i in eq.client_indices] == [75] * 10
    for i, rows in enumerate(eq.client_indices):
        assert set(four.d[rows]) == {four.domains.index(eq.domain_of(i))}
    every = np.concatenate(eq.client_indices)
    assert len(np.unique(every)) == len(every)  # disjoint
    assert all(np.array_equal(a, b) for a, b in zip(eq.test_indices, plain.test_indices))  # same test sets
    assert eq.config["rows_per_client"] == 75 and "rows_per_client" not in plain.config
    with pytest.raises(ValueError, match=r"'art_painting': 320 training rows cannot give 4 clients.*at most 80"):
        build_domain_partition(four, clients_per_domain=counts, test_fraction=0.2, seed=5, rows_per_client=81)
    with pytest.raises(ValueError, match="set size_skew: 0"):
        build_domain_partition(four, clients_per_domain=counts, seed=5, size_skew=1.0, rows_per_client=50)
