"""Who holds what: source clients with Dirichlet label skew, and corrupted target clients.

The split is a pure function of (dataset, config, seed). Every client's exact sample indices
go into a manifest together with a sha256 of its arrays, so lineage can name the samples.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Union, cast

import numpy as np

from fedcore.data.sources import ImageSet

STREAM_ORDERS = ("shuffled", "class_sorted")


def sha256_file(path: str | Path) -> str:
    """sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_arrays(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def write_arrays(folder: str | Path, arrays: Dict[str, np.ndarray], manifest: Dict) -> Path:
    """Write ``partition.npz`` and ``manifest.json`` into ``folder``, each atomically (tmp, then rename)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "partition.tmp.npz"
    np.savez(tmp, **cast(Dict[str, Any], arrays))  # Any: numpy's stub checks **kwargs values against allow_pickle: bool
    tmp.replace(folder / "partition.npz")
    tmp_m = folder / "manifest.json.tmp"
    tmp_m.write_text(json.dumps(manifest, indent=1))
    tmp_m.replace(folder / "manifest.json")
    return folder


# the default variant's commands (a flow names the stage of the variant it runs: flows.runs.tasks.build_hint)
BUILD_PARTITION = "`dvc repro partition@mnist` (or `python -m flows.stages partition`)"
Build = Union[str, Callable[[], str]]  # the command that writes a file, or what works it out when it is missing


def build_text(build: Build) -> str:
    return build() if callable(build) else build


def read_arrays(folder: str | Path, *, what: str, build: Build) -> tuple[Dict[str, np.ndarray], Dict]:
    """``(arrays, manifest)`` written by :func:`write_arrays`; missing or unreadable -> ``build``, the command
    that writes them."""
    folder = Path(folder)
    npz, man = folder / "partition.npz", folder / "manifest.json"
    if not npz.is_file() or not man.is_file():
        raise FileNotFoundError(
            f"no {what} at {folder} (expected partition.npz and manifest.json). Build it with {build_text(build)}."
        )
    try:
        with np.load(npz, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        manifest = json.loads(man.read_text())
    except (
        OSError,
        EOFError,
        ValueError,
        zipfile.BadZipFile,
    ) as exc:  # empty, truncated, garbled (a bad CRC), not JSON
        raise ValueError(
            f"the {what} at {folder} cannot be read ({type(exc).__name__}: {exc}): it is truncated or "
            f"corrupt. Move it away and rebuild it with {build_text(build)}."
        ) from exc
    return arrays, manifest


@dataclass(frozen=True)
class Split:
    """Disjoint index sets into the loaded dataset."""

    source_train: np.ndarray
    source_test: np.ndarray
    target_stream_pool: np.ndarray
    target_holdout_pool: np.ndarray


def split_dataset(
    data: ImageSet,
    *,
    source_fraction: float,
    source_test_fraction: float,
    holdout_fraction: float,
    seed: int,
    official_train_size: int | None = None,
) -> Split:
    """Split rows into a clean source part and a target pool, stratified by class.

    With ``official_train_size`` (CIFAR-10: 50,000) the source part is drawn from the
    official training rows and the target pool from the official test rows, as in CIFAR-10-C.
    """
    for name, v in (
        ("source_fraction", source_fraction),
        ("source_test_fraction", source_test_fraction),
        ("holdout_fraction", holdout_fraction),
    ):
        if not 0 < v < 1:
            raise ValueError(f"{name} must be in (0, 1), got {v}")
    rng = np.random.default_rng(seed)
    n = len(data)
    if official_train_size:
        train_rows = np.arange(official_train_size)
        pool = np.arange(official_train_size, n)
        train_rows = rng.permutation(train_rows)
        n_test = int(round(len(train_rows) * source_test_fraction))
        source_test, source_train = train_rows[:n_test], train_rows[n_test:]
        pool = rng.permutation(pool)
    else:
        train_parts: List[np.ndarray] = []
        test_parts: List[np.ndarray] = []
        pool_parts: List[np.ndarray] = []
        for c in range(data.num_classes):
            rows = rng.permutation(np.flatnonzero(data.y == c))
            n_src = int(round(len(rows) * source_fraction))
            n_test = int(round(n_src * source_test_fraction))
            test_parts.append(rows[:n_test])
            train_parts.append(rows[n_test:n_src])
            pool_parts.append(rows[n_src:])
        source_train, source_test = np.concatenate(train_parts), np.concatenate(test_parts)
        pool = rng.permutation(np.concatenate(pool_parts))
    n_hold = int(round(len(pool) * holdout_fraction))
    return Split(
        source_train=np.sort(source_train),
        source_test=np.sort(source_test),
        target_stream_pool=np.sort(pool[n_hold:]),
        target_holdout_pool=np.sort(pool[:n_hold]),
    )


def dirichlet_label_split(
    labels: np.ndarray, *, num_clients: int, alpha: float, seed: int, min_size: int = 10
) -> List[np.ndarray]:
    """Split rows among clients with per-class proportions drawn from Dirichlet(alpha).

    Redraws (up to 100 times) until every client holds at least ``min_size`` rows, the usual
    guard against empty clients at small alpha.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if alpha <= 0:
        raise ValueError(f"Dirichlet alpha must be > 0, got {alpha}")
    if len(labels) < num_clients * min_size:
        raise ValueError(
            f"{len(labels)} rows cannot give {num_clients} clients {min_size} rows each; lower num_clients or min_size"
        )
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(100):
        parts: List[List[int]] = [[] for _ in range(num_clients)]
        for c in classes:
            rows = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(props) * len(rows)).astype(int)[:-1]
            for k, chunk in enumerate(np.split(rows, cuts)):
                parts[k].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise ValueError(f"could not give every client {min_size} rows at alpha={alpha}; raise alpha")


@dataclass
class TargetClient:
    """One unlabelled client: a corruption domain with a stream and a labelled hold-out."""

    client_id: int
    corruption: str
    severity: int
    stream_indices: np.ndarray
    holdout_indices: np.ndarray
    stream_x: np.ndarray = field(repr=False)
    stream_y: np.ndarray = field(repr=False)  # kept for online accuracy only, never shown to adaptation
    holdout_x: np.ndarray = field(repr=False)
    holdout_y: np.ndarray = field(repr=False)

    def sha256(self) -> str:
        return sha256_arrays(self.stream_x, self.stream_y, self.holdout_x, self.holdout_y)


def order_stream(labels: np.ndarray, *, order: str, rng: np.random.Generator) -> np.ndarray:
    """A permutation of a client's stream: shuffled (default) or class-sorted (temporally correlated)."""
    if order == "shuffled":
        return rng.permutation(len(labels))
    if order == "class_sorted":
        # Shuffled within a class, classes in a random order: the non-i.i.d. stream that breaks BN.
        perm = rng.permutation(len(labels))
        class_rank = {c: r for r, c in enumerate(rng.permutation(np.unique(labels)))}
        keys = np.array([class_rank[c] for c in labels[perm]])
        return perm[np.argsort(keys, kind="stable")]
    raise ValueError(f"unknown stream order {order!r}; valid names are: {', '.join(STREAM_ORDERS)}")


def make_target_clients(
    data: ImageSet,
    split: Split,
    *,
    corruptions: Sequence[str],
    severity: int,
    stream_size: int,
    holdout_size: int,
    stream_order: str,
    seed: int,
) -> List[TargetClient]:
    """Build one target client per corruption, each with its own stream and hold-out draw."""
    # here, not at the top: OpenCV, scikit-image and scipy.ndimage cost every process that only reads
    # partitions (a Ray worker) 0.4 s of import
    from fedcore.data.corruptions import CORRUPTION_NAMES, corrupt

    unknown = [c for c in corruptions if c not in CORRUPTION_NAMES]
    if unknown:
        raise ValueError(f"unknown corruption(s) {unknown}; valid names are: {', '.join(CORRUPTION_NAMES)}")
    if len(set(corruptions)) != len(corruptions):
        raise ValueError(f"each target client holds one corruption domain; {list(corruptions)} repeats one")
    if stream_size > len(split.target_stream_pool) or holdout_size > len(split.target_holdout_pool):
        raise ValueError(
            f"stream_size={stream_size}/holdout_size={holdout_size} exceed the target pools "
            f"({len(split.target_stream_pool)}/{len(split.target_holdout_pool)}); lower them"
        )
    clients = []
    for k, name in enumerate(corruptions):
        rng = np.random.default_rng([seed, 1000 + k])
        s_idx = rng.choice(split.target_stream_pool, size=stream_size, replace=False)
        h_idx = np.sort(rng.choice(split.target_holdout_pool, size=holdout_size, replace=False))
        s_idx = s_idx[order_stream(data.y[s_idx], order=stream_order, rng=rng)]
        clients.append(
            TargetClient(
                client_id=k,
                corruption=name,
                severity=severity,
                stream_indices=s_idx,
                holdout_indices=h_idx,
                stream_x=corrupt(data.x[s_idx], name, severity, seed=seed * 7919 + 2 * k),
                stream_y=data.y[s_idx],
                holdout_x=corrupt(data.x[h_idx], name, severity, seed=seed * 7919 + 2 * k + 1),
                holdout_y=data.y[h_idx],
            )
        )
    return clients


@dataclass
class Partition:
    """Everything the federation needs, as arrays, plus the manifest that names it."""

    dataset: str
    num_classes: int
    source_clients: List[np.ndarray]  # row indices into the dataset
    source_x: List[np.ndarray]
    source_y: List[np.ndarray]
    source_test_x: np.ndarray
    source_test_y: np.ndarray
    targets: List[TargetClient]
    seed: int
    config: Dict

    def manifest(self) -> Dict:
        return {
            "dataset": self.dataset,
            "seed": self.seed,
            "config": self.config,
            "source_clients": [
                {"client_id": i, "indices": idx.tolist(), "sha256": sha256_arrays(x, y)}
                for i, (idx, x, y) in enumerate(zip(self.source_clients, self.source_x, self.source_y))
            ],
            "source_test": {
                "size": int(len(self.source_test_y)),
                "sha256": sha256_arrays(self.source_test_x, self.source_test_y),
            },
            "target_clients": [
                {
                    "client_id": t.client_id,
                    "corruption": t.corruption,
                    "severity": t.severity,
                    "stream_indices": t.stream_indices.tolist(),
                    "holdout_indices": t.holdout_indices.tolist(),
                    "sha256": t.sha256(),
                }
                for t in self.targets
            ],
        }

    def save(self, folder: str | Path) -> Path:
        """Write ``partition.npz`` and ``manifest.json``; returns the folder."""
        arrays = {"source_test_x": self.source_test_x, "source_test_y": self.source_test_y}
        for i, (idx, x, y) in enumerate(zip(self.source_clients, self.source_x, self.source_y)):
            arrays.update({f"src{i}_idx": idx, f"src{i}_x": x, f"src{i}_y": y})
        for t in self.targets:
            k = t.client_id
            arrays.update(
                {
                    f"tgt{k}_sidx": t.stream_indices,
                    f"tgt{k}_hidx": t.holdout_indices,
                    f"tgt{k}_sx": t.stream_x,
                    f"tgt{k}_sy": t.stream_y,
                    f"tgt{k}_hx": t.holdout_x,
                    f"tgt{k}_hy": t.holdout_y,
                }
            )
        return write_arrays(folder, arrays, self.manifest())

    @classmethod
    def load(cls, folder: str | Path, *, build: Build = BUILD_PARTITION) -> "Partition":
        """Read a partition written by :meth:`save`, checking each target client against the manifest sha256.
        ``build``: the command that writes it, for the error when it is missing or corrupt."""
        a, m = read_arrays(folder, what="partition", build=build)
        npz = Path(folder) / "partition.npz"
        src = range(len(m["source_clients"]))
        targets = [
            TargetClient(
                client_id=t["client_id"],
                corruption=t["corruption"],
                severity=t["severity"],
                stream_indices=a[f"tgt{t['client_id']}_sidx"],
                holdout_indices=a[f"tgt{t['client_id']}_hidx"],
                stream_x=a[f"tgt{t['client_id']}_sx"],
                stream_y=a[f"tgt{t['client_id']}_sy"],
                holdout_x=a[f"tgt{t['client_id']}_hx"],
                holdout_y=a[f"tgt{t['client_id']}_hy"],
            )
            for t in m["target_clients"]
        ]
        for t, rec in zip(targets, m["target_clients"]):
            if t.sha256() != rec["sha256"]:
                raise ValueError(
                    f"target client {t.client_id} in {npz} does not match its manifest sha256; "
                    f"the file is corrupt: rebuild it with {build_text(build)}"
                )
        return cls(
            dataset=m["dataset"],
            num_classes=int(m["config"]["num_classes"]),
            source_clients=[a[f"src{i}_idx"] for i in src],
            source_x=[a[f"src{i}_x"] for i in src],
            source_y=[a[f"src{i}_y"] for i in src],
            source_test_x=a["source_test_x"],
            source_test_y=a["source_test_y"],
            targets=targets,
            seed=int(m["seed"]),
            config=m["config"],
        )


def build_partition(
    data: ImageSet,
    *,
    dataset: str,
    num_source_clients: int,
    dirichlet_alpha: float,
    corruptions: Sequence[str],
    severity: int,
    stream_size: int,
    holdout_size: int,
    stream_order: str = "shuffled",
    source_fraction: float = 0.5,
    source_test_fraction: float = 0.15,
    holdout_fraction: float = 0.3,
    official_train_size: int | None = None,
    seed: int = 0,
) -> Partition:
    """Split ``data`` into source clients, a clean source test set and K corrupted target clients."""
    split = split_dataset(
        data,
        source_fraction=source_fraction,
        source_test_fraction=source_test_fraction,
        holdout_fraction=holdout_fraction,
        seed=seed,
        official_train_size=official_train_size,
    )
    parts = dirichlet_label_split(
        data.y[split.source_train], num_clients=num_source_clients, alpha=dirichlet_alpha, seed=seed
    )
    src_idx = [split.source_train[p] for p in parts]
    targets = make_target_clients(
        data,
        split,
        corruptions=corruptions,
        severity=severity,
        stream_size=stream_size,
        holdout_size=holdout_size,
        stream_order=stream_order,
        seed=seed,
    )
    config = dict(
        num_classes=data.num_classes,
        num_source_clients=num_source_clients,
        dirichlet_alpha=dirichlet_alpha,
        corruptions=list(corruptions),
        severity=severity,
        stream_size=stream_size,
        holdout_size=holdout_size,
        stream_order=stream_order,
        source_fraction=source_fraction,
        source_test_fraction=source_test_fraction,
        holdout_fraction=holdout_fraction,
    )
    return Partition(
        dataset=dataset,
        num_classes=data.num_classes,
        source_clients=src_idx,
        source_x=[data.x[i] for i in src_idx],
        source_y=[data.y[i] for i in src_idx],
        source_test_x=data.x[split.source_test],
        source_test_y=data.y[split.source_test],
        targets=targets,
        seed=seed,
        config=config,
    )
