"""Is a stage output still what its writer recorded? Checked before anything in it is read.

``dvc repro`` records an md5 for every stage output in ``dvc.lock``, which git tracks: a file
swapped in afterwards disagrees with it, and so does a hash written beside the file by whoever
swapped it. A file is checked against

* the md5 the lock records for it. An output folder's lock entry holds the md5 of its listing
  (``<md5>.dir``); the listing itself, with an md5 per file, is in the DVC cache. Without the
  listing, the whole folder on disk must hash to the lock's entry;
* or, for files a flow wrote itself moments before (the nightly job rebuilds its inputs
  outside DVC), the md5s that flow recorded when it wrote them (:func:`record`).

A path outside the repository, or inside it but no stage's output (a file a user copied in,
a test's temporary folder), is not checked here: the loaders still read only tensors and
arrays from it, never pickled code.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Tuple

from flows.config import compose as C


class IntegrityError(ValueError):
    """A stage output that does not match the hash its writer recorded. Nothing in it was read."""


@dataclass(frozen=True)
class LockedOut:
    """One stage output as ``dvc.lock`` records it."""

    stage: str
    path: str  # relative to the repository root, POSIX separators
    md5: str  # ends in ".dir" for a folder

    @property
    def is_dir(self) -> bool:
        return self.md5.endswith(".dir")


def md5_file(path: str | Path) -> str:
    """md5 of a file: the hash DVC 3 records for it."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "md5").hexdigest()


def folder_md5(listing: Mapping[str, str]) -> str:
    """DVC's md5 of a folder, from ``{relative POSIX path: md5}`` of every file in it (ends in ``.dir``)."""
    entries = [{"md5": md5, "relpath": rel} for rel, md5 in sorted(listing.items())]
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode("utf-8")).hexdigest() + ".dir"


def lock_outs(root: Path | None = None) -> List[LockedOut]:
    """Every stage output recorded in ``<root>/dvc.lock`` (none when there is no lock).

    Parsed once per version of the file (its size and mtime) with libyaml where PyYAML has it:
    the lock holds every stage of every system, and the pure-Python parser took 0.3-0.7 s per read,
    paid before a flow's first task and again for its lineage tags.
    """
    lock = (root or C.project_root()) / "dvc.lock"
    if not lock.is_file():
        return []
    st = lock.stat()
    return list(_lock_outs(str(lock), st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _lock_outs(path: str, size: int, mtime_ns: int) -> Tuple[LockedOut, ...]:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    outs = []
    for stage, body in (yaml.load(Path(path).read_text(), Loader=loader) or {}).get("stages", {}).items():
        for o in (body or {}).get("outs", []) or []:
            if o.get("md5"):
                outs.append(LockedOut(stage=stage, path=str(o["path"]).rstrip("/"), md5=str(o["md5"])))
    return tuple(outs)


def record(*paths: str | Path) -> Dict[str, str]:
    """``{absolute path: md5}`` of every file in ``paths`` (folders recursively), for :func:`verify`.

    A flow that writes its own inputs calls this right after writing them and hands the
    result to whatever reads them next.
    """
    out: Dict[str, str] = {}
    for p in paths:
        for f in _files(_absolute(p)):
            out[str(f)] = md5_file(f)
    return out


def verify(path: str | Path, *, written: Mapping[str, str] | None = None, root: Path | None = None) -> int:
    """Refuse ``path`` (a file, or every file in a folder) if it disagrees with its writer's record.

    Parameters
    ----------
    path:
        What is about to be read.
    written:
        md5s from :func:`record`, checked instead of ``dvc.lock`` for the files they name.
    root:
        The DVC repository whose ``dvc.lock`` is the record (default: this project's root).

    Returns
    -------
    int
        How many files were checked (0: none of them is a stage output, nothing to check).

    Raises
    ------
    IntegrityError
        A file differs from the md5 recorded for it; the message names the fix.
    """
    root = _absolute(root or C.project_root())
    outs: List[LockedOut] | None = None  # the lock is parsed once, and only if some file needs it
    listings: Dict[LockedOut, Dict[str, str]] = {}
    checked = 0
    for f in _files(_absolute(path)):
        if written and str(f) in written:
            _compare(
                f,
                written[str(f)],
                "the md5 recorded when this flow wrote it",
                "it changed after it was written; rerun the flow",
            )
            checked += 1
            continue
        if not f.is_relative_to(root):
            continue
        rel = f.relative_to(root).as_posix()
        outs = lock_outs(root) if outs is None else outs
        out = next((o for o in outs if rel == o.path or rel.startswith(o.path + "/")), None)
        if out is None:
            continue
        if out.is_dir:
            if out not in listings:
                listings[out] = _listing(root, out)
            expected = listings[out].get(rel[len(out.path) + 1 :])
            if expected is None:
                continue  # not a file the stage wrote
        else:
            expected = out.md5
        _compare(f, expected, f"the md5 dvc.lock records for stage {out.stage!r}", _fix(out))
        checked += 1
    return checked


def _absolute(path: str | Path) -> Path:
    # Not Path.resolve(): a DVC output linked into its cache stays where the lock names it.
    return Path(os.path.abspath(path))


def _files(path: Path) -> List[Path]:
    if path.is_file():
        return [path]
    return sorted(q for q in path.rglob("*") if q.is_file()) if path.is_dir() else []


def _fix(out: LockedOut) -> str:
    return (
        f"restore the recorded copy with `dvc checkout --force {out.path}` (it replaces what is there; where this "
        f"clone's DVC cache lacks it, `make pull` fetches it first) or rebuild it with `dvc repro {out.stage}` (if "
        f"you rebuilt it yourself outside DVC, `dvc commit --force {out.stage}` records it)"
    )


def _compare(path: Path, expected: str, where: str, fix: str) -> None:
    actual = md5_file(path)
    if actual != expected:
        raise IntegrityError(
            f"{path} does not match {where} (expected md5 {expected}, found {actual}), so it was not loaded: {fix}"
        )


def _listing(root: Path, out: LockedOut) -> Dict[str, str]:
    """``{relative path: md5}`` of the files in an output folder as the lock records them.

    From the listing in the DVC cache when it is there; otherwise from the folder on disk,
    which must then hash to the lock's entry as a whole.
    """
    digest = out.md5[: -len(".dir")]
    cached = root / ".dvc" / "cache" / "files" / "md5" / digest[:2] / f"{digest[2:]}.dir"
    if cached.is_file():
        return {e["relpath"]: e["md5"] for e in json.loads(cached.read_text())}
    folder = root / out.path
    on_disk = {q.relative_to(folder).as_posix(): md5_file(q) for q in sorted(folder.rglob("*")) if q.is_file()}
    found = folder_md5(on_disk)
    if found != out.md5:
        raise IntegrityError(
            f"{folder} does not match the md5 dvc.lock records for stage {out.stage!r} (expected {out.md5}, found "
            f"{found}), and the DVC cache holds no listing to check its files one by one, so nothing in it was "
            f"loaded: {_fix(out)}"
        )
    return on_disk
