"""Share what a run built: ``dvc push`` and ``dvc pull`` against the project's remote, with errors that say what to do.

    python -m flows.services.remote push [stage ...]   # every output in dvc.lock (or these stages') -> the remote
    python -m flows.services.remote pull [stage ...]   # fetch, check every file's md5 against dvc.lock, then check out
    python -m flows.services.remote where              # the remote's name and URL, and how to change it

``make push`` and ``make pull`` run the first two. The remote is ``fedcore`` in ``.dvc/config``: a
folder beside the clone (``../fedcore-dvc-remote``), so a fresh clone knows it and the first push
needs no set-up. ``FEDCORE_DVC_REMOTE`` (a folder, ``s3://bucket/path`` with the ``s3`` extra, or
``ssh://user@host:port/path`` with the ``deploy`` extra and the key in ``FEDCORE_DVC_REMOTE_KEYFILE``)
points this clone elsewhere. Both are written to ``.dvc/config.local``, which git ignores, so plain
``dvc push`` and ``dvc pull`` agree with ``make`` afterwards.

Why pull does more than ``dvc pull``: DVC trusts the remote by default, and in DVC 3.67 a corrupt
object reaches the work tree silently, after which ``dvc status`` reports nothing. The remote is
configured with ``verify = true``, so DVC drops such an object, but its error then says only
"Checkout failed ... Is your cache up to date?". Here every object is hashed against dvc.lock after
the fetch and before any checkout. Outputs whose files are all intact are checked out. The others
stay as they are in the work tree, and the error names each bad file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import yaml

REMOTE = "fedcore"
ENV = "FEDCORE_DVC_REMOTE"
KEYFILE_ENV = "FEDCORE_DVC_REMOTE_KEYFILE"  # the private key of an ssh:// remote (the ``ssh`` extra)
HOW_TO_SET = (
    f"Set the remote with {ENV}=<folder or s3://bucket/path> (for example "
    f"`{ENV}=/mnt/team/fedcore-dvc make push`), or with `dvc remote modify --local {REMOTE} url <url>`. "
    "The README's 'Sharing a run' section has the S3 settings."
)


class RemoteError(RuntimeError):
    """A push or pull that could not reach the remote, or did not complete."""


@dataclass(frozen=True)
class Remote:
    name: str
    url: str
    origin: str  # the config file (or variable) the URL came from

    @property
    def is_folder(self) -> bool:
        return "://" not in self.url

    def describe(self) -> str:
        return f"remote '{self.name}' ({self.url}, from {self.origin})"


@dataclass(frozen=True)
class Output:
    """One output of one stage, as dvc.lock records it."""

    stage: str
    path: str
    md5: str  # ends in ``.dir`` for a directory


@dataclass(frozen=True)
class BadFile:
    """A file that did not arrive intact: not checked out."""

    path: str  # in the work tree, e.g. ``data/partitions/digits/partition.npz``
    md5: str  # what dvc.lock says it hashes to
    reason: str


@dataclass(frozen=True)
class PushReport:
    remote: Remote
    pushed: List[str] = field(default_factory=list)  # outputs now in the remote
    not_in_cache: List[Output] = field(default_factory=list)  # in the work tree, not in the DVC cache
    not_built: List[str] = field(default_factory=list)  # neither here nor cached: nothing to push from here


@dataclass(frozen=True)
class PullReport:
    remote: Remote
    restored: List[str] = field(default_factory=list)
    refused: List[BadFile] = field(default_factory=list)  # in the remote, but did not arrive intact
    absent: List[Output] = field(default_factory=list)  # not in the remote: never pushed from any clone


class RemoteUnreachable(RemoteError):
    """A push that reached no remote (a server that is down, a share that is not mounted): worth trying again
    later, unlike a remote that is set up wrong."""


class PushError(RemoteError):
    def __init__(self, message: str, report: PushReport):
        super().__init__(message)
        self.report = report


class PullError(RemoteError):
    def __init__(self, message: str, report: PullReport):
        super().__init__(message)
        self.report = report


def _dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    # `python -m dvc` finds the DVC of this interpreter even when the venv's bin/ is not on PATH.
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, capture_output=True, text=True)


def _errors(proc: subprocess.CompletedProcess, lines: int = 8) -> str:
    out = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    picked = [ln for ln in out if "ERROR" in ln] or out
    return "\n".join("    " + ln for ln in picked[-lines:])


def _settings(root: Path) -> Dict[str, Tuple[str, str]]:
    """Every DVC setting of the repository as key -> (value, origin), the winning level last.

    One ``dvc config --list --show-origin`` call: DVC merges the levels and resolves relative paths.
    """
    proc = _dvc(root, "config", "--list", "--show-origin")
    if proc.returncode != 0:
        raise RemoteError(f"`dvc config --list` failed in {root}:\n{_errors(proc)}")
    found = {}
    for line in proc.stdout.splitlines():
        origin, _, setting = line.partition("\t")
        key, _, value = setting.partition("=")
        found[key] = (value, origin)
    return found


def _setup(root: Path) -> Tuple[Remote, Path]:
    """The default remote, after applying ``FEDCORE_DVC_REMOTE`` to ``.dvc/config.local``, and the cache."""
    settings = _settings(root)
    name = settings.get("core.remote", ("", ""))[0]
    if not name:
        make_default = (
            f"make it the default with `dvc remote default {REMOTE}`"
            if f"remote.{REMOTE}.url" in settings
            else f"add one with `dvc remote add -d {REMOTE} <url>`"
        )
        raise RemoteError(
            f"No default DVC remote in {root}: .dvc/config should name '{REMOTE}' "
            f"(core.remote). Restore it with `git checkout .dvc/config`, or {make_default}. {HOW_TO_SET}"
        )
    url, origin = settings.get(f"remote.{name}.url", ("", ""))
    wanted = os.environ.get(ENV, "").strip()
    if wanted:
        if "://" not in wanted:  # config.local resolves a relative folder against .dvc/, not the caller's directory
            wanted = str(Path(wanted).expanduser().resolve())
        if url != wanted:
            proc = _dvc(root, "remote", "modify", "--local", name, "url", wanted)
            if proc.returncode != 0:
                raise RemoteError(f"Could not point remote '{name}' at {ENV}={wanted}:\n{_errors(proc)}")
        url, origin = wanted, f"{ENV}, saved in .dvc/config.local"
    keyfile = os.environ.get(KEYFILE_ENV, "").strip()
    if keyfile:  # an SSH remote's private key
        keyfile = str(Path(keyfile).expanduser().resolve())
        if settings.get(f"remote.{name}.keyfile", ("", ""))[0] != keyfile:
            proc = _dvc(root, "remote", "modify", "--local", name, "keyfile", keyfile)
            if proc.returncode != 0:
                raise RemoteError(f"Could not give remote '{name}' the key {KEYFILE_ENV}={keyfile}:\n{_errors(proc)}")
    if not url:
        raise RemoteError(f"The default DVC remote '{name}' has no URL. {HOW_TO_SET}")
    cache = settings.get("cache.dir", (str(root / ".dvc" / "cache"), ""))[0]
    return Remote(name=name, url=url, origin=origin), Path(cache)


def _plugin_hint(proc: subprocess.CompletedProcess) -> str:
    """How to install the DVC plugin an object-store URL needs, when DVC says one is missing."""
    if "requires 'dvc-s3'" in proc.stderr:
        return "Install S3 support with `pip install -c constraints.txt -e '.[s3]'`. "
    if "requires 'dvc-ssh'" in proc.stderr:
        return "Install SSH support with `pip install -c constraints.txt -e '.[deploy]'`. "
    return (
        "Install the DVC plugin it names (`pip install 'dvc[<scheme>]'`). " if "to be installed" in proc.stderr else ""
    )


def configure(root: Path) -> Remote:
    """The default remote, after applying ``FEDCORE_DVC_REMOTE`` to ``.dvc/config.local`` if it is set."""
    return _setup(Path(root))[0]


def check_reachable(remote: Remote, *, for_push: bool) -> None:
    """Fail early, naming the remote, where a folder remote cannot be the one meant.

    DVC creates a missing folder remote with all its parents, so a share that is not mounted
    would silently become a new folder on the local disk.
    """
    if not remote.is_folder:
        return  # an object store answers for itself; a failure is reported with DVC's own error
    path = Path(remote.url)
    if path.is_dir():
        return
    if path.exists():
        raise RemoteError(f"{remote.describe()} is not a folder. {HOW_TO_SET}")
    if not for_push:
        raise RemoteError(
            f"{remote.describe()} does not exist here: nothing has been pushed to it, or the run "
            f"was pushed elsewhere. Point {ENV} at the remote the run was pushed to. {HOW_TO_SET}"
        )
    if not path.parent.is_dir():
        raise RemoteUnreachable(
            f"{remote.describe()} is not reachable: its parent folder {path.parent} does not "
            f"exist (a share that is not mounted?). Nothing was pushed. {HOW_TO_SET}"
        )


def outputs(root: Path, stages: Optional[Sequence[str]] = None) -> List[Output]:
    """The outputs dvc.lock records, for every stage or for the ones named."""
    lock = root / "dvc.lock"
    recorded = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}) if lock.is_file() else {}
    unknown = [s for s in (stages or []) if s not in recorded]
    if unknown:
        raise ValueError(
            f"Not in dvc.lock: {', '.join(unknown)}. Stages it records: "
            f"{', '.join(sorted(recorded)) or 'none (run `dvc repro` first)'}."
        )
    found = []
    for stage in stages or list(recorded):
        for out in recorded[stage].get("outs", []):
            if out.get("hash") != "md5":
                raise ValueError(
                    f"{out['path']} (stage {stage}) was recorded by DVC 2; rebuild it with "
                    f"`dvc repro {stage}` or record it again with `dvc commit {stage}`."
                )
            found.append(Output(stage=stage, path=out["path"], md5=out["md5"]))
    return found


def _object(base: Path, md5: str) -> Path:
    return base / "files" / "md5" / md5[:2] / md5[2:]


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _intact(path: Path, md5: str) -> Tuple[bool, str]:
    """Whether the object at ``path`` exists and hashes to ``md5``; the hash it has otherwise."""
    if not path.is_file():
        return False, ""
    got = _md5(path)
    return got == md5.removesuffix(".dir"), got


def _files(out: Output, cache: Path) -> List[Tuple[str, str]]:
    """(work-tree path, md5) of every file of an output whose directory listing is intact in the cache."""
    if not out.md5.endswith(".dir"):
        return [(out.path, out.md5)]
    listing = json.loads(_object(cache, out.md5).read_text())
    return [(f"{out.path}/{entry['relpath']}", entry["md5"]) for entry in listing]


def _why(remote: Remote, md5: str, listing: str) -> str:
    """Why an object is not in the cache intact, judged from the remote's copy where we can read it.

    ``listing`` is the md5 of the directory listing the object belongs to ("" for a single file):
    `dvc push` skips every file of a directory whose listing the remote has, so a repair deletes both.
    """
    skips = "`dvc push` skips what the remote already has" + (
        ", and every file of a listed directory" if listing else ""
    )
    if not remote.is_folder:
        names = " and ".join(f"files/md5/{m[:2]}/{m[2:]}" for m in (md5, listing) if m)
        return (
            "it did not arrive intact from the remote: it is missing there, or its content does not match "
            f"its md5 (DVC's `verify` drops such a download). Delete {names} under {remote.url}, then "
            f"`make push` from a clone that holds it intact ({skips})"
        )
    where = _object(Path(remote.url), md5)
    ok, got = _intact(where, md5)
    if ok:
        return f"the remote's copy ({where}) is intact but the fetch did not bring it: run the pull again"
    stale = " and ".join(str(_object(Path(remote.url), m)) for m in (md5, listing) if m)
    repair = f"Delete {stale}, then `make push` from a clone that holds it intact ({skips})"
    if got:
        return f"the remote's copy is corrupt: {where} hashes to {got}. {repair}"
    return f"it is not in the remote ({where}). {repair.replace(', then', ' where present, then', 1)}"


def _check(path: str, md5: str, cache: Path, remote: Remote, listing: str = "") -> List[BadFile]:
    """[] if the cached object of ``md5`` is intact; else the bad file, after removing a corrupt copy."""
    obj = _object(cache, md5)
    ok, got = _intact(obj, md5)
    if ok:
        return []
    if got:  # left in the cache, a later plain `dvc checkout` would put it in the work tree
        obj.unlink()
    return [BadFile(path=path, md5=md5, reason=_why(remote, md5, listing))]


def verify(outs: Sequence[Output], cache: Path, remote: Remote) -> Tuple[List[Output], Dict[Output, List[BadFile]]]:
    """Hash every object of ``outs`` in the cache against dvc.lock; remove a corrupt one from the cache.

    Returns the outputs whose files are all intact, and for each other output the files that are not.
    """
    intact, bad = [], {}
    for out in outs:
        wrong = []
        if out.md5.endswith(".dir"):
            wrong = _check(f"{out.path}/ (its file listing)", out.md5, cache, remote)
        if not wrong:
            listing = out.md5 if out.md5.endswith(".dir") else ""
            for path, md5 in _files(out, cache):
                wrong += _check(path, md5, cache, remote, listing)
        if wrong:
            bad[out] = wrong
        else:
            intact.append(out)
    return intact, bad


def never_pushed(root: Path, remote: Remote, outs: Sequence[Output], cache: Path) -> List[Output]:
    """Which of ``outs`` the remote does not hold at all (for a directory: not even its file listing), as
    opposed to holding a copy that did not arrive intact."""
    if not outs:
        return []
    if remote.is_folder:
        return [o for o in outs if not _object(Path(remote.url), o.md5).is_file()]
    # DVC's view of any other remote: "missing" is neither in the cache nor in the remote
    proc = _dvc(root, "status", "--cloud", "--json", *[o.path for o in outs])
    try:
        status = json.loads(proc.stdout or "{}")
    except json.JSONDecodeError:
        return []  # say nothing we do not know: each is then reported as not arrived intact
    # a directory whose listing the remote lacks is left out of DVC's answer: absent if the cache lacks it too
    return [
        o
        for o in outs
        if status.get(o.path) == "missing"
        or (o.path not in status and o.md5.endswith(".dir") and not _object(cache, o.md5).is_file())
    ]


def pull(root: Path, stages: Optional[Sequence[str]] = None) -> PullReport:
    """Fetch the outputs of ``stages`` (default: all in dvc.lock), verify them, check out the intact ones.

    An output the remote does not hold at all (no clone pushed it: ``make push`` says which outputs it did
    not build) is reported in ``absent``, not as an error, unless its stage was named in ``stages``.

    Raises
    ------
    RemoteError
        if the remote cannot be found, or the checkout fails (it keeps files changed in the work tree).
    PullError
        if a file the remote holds did not arrive intact, or a stage named in ``stages`` is not in the
        remote; the intact outputs are checked out first, and the error's ``report`` lists both.
    """
    root = Path(root)
    outs = outputs(root, stages)
    remote, cache = _setup(root)
    check_reachable(remote, for_push=False)
    fetched = _dvc(root, "fetch", *(stages or []))
    intact, failed = verify(outs, cache, remote)
    absent = never_pushed(root, remote, list(failed), cache)
    bad = [b for out, files in failed.items() if out not in absent for b in files]
    if intact:
        done = _dvc(root, "checkout", *[o.path for o in intact])
        if done.returncode != 0:
            raise RemoteError(
                f"`dvc checkout` failed after a verified fetch from {remote.describe()}:\n"
                f"{_errors(done)}\nA file you changed in the work tree is kept: "
                f"`dvc checkout --force <path>` replaces it."
            )
    report = PullReport(remote=remote, restored=[o.path for o in intact], refused=bad, absent=absent)
    asked = [o for o in absent if stages]
    if bad or asked:
        parts = [f"Pulled from {remote.describe()}: {len(intact)} of {len(outs)} outputs restored."]
        if bad:
            lines = "\n".join(f"  {b.path} (md5 {b.md5}): {b.reason}" for b in bad)
            parts.append(
                "These files are in the remote but did not arrive intact, so their outputs were not checked "
                f"out and the work tree keeps what it had there:\n{lines}"
            )
            if fetched.returncode != 0:
                parts.append(f"DVC's fetch said:\n{_errors(fetched)}\n{_plugin_hint(fetched)}{HOW_TO_SET}")
        if asked:
            parts.append(describe_absent(asked))
        raise PullError("\n".join(parts), report)
    return report


def describe_absent(absent: Sequence[Output]) -> str:
    """The outputs no clone has pushed, by stage, with the two ways to get them."""
    by_stage: Dict[str, int] = {}
    for o in absent:
        by_stage[o.stage] = by_stage.get(o.stage, 0) + 1
    names = " ".join(sorted(by_stage))
    listed = ", ".join(f"{s} ({n})" for s, n in sorted(by_stage.items()))
    return (
        f"Not in the remote, because no clone has pushed them: {len(absent)} outputs of {len(by_stage)} "
        f"stages: {listed}. Build them here with `dvc repro {names}`, or `make push` from a clone that built them."
    )


def push(root: Path, stages: Optional[Sequence[str]] = None) -> PushReport:
    """Push the cached outputs of ``stages`` (default: all in dvc.lock) to the remote.

    Raises
    ------
    RemoteUnreachable
        if the remote cannot be reached, naming it and how to set it.
    RemoteError
        if it is set up wrong (no URL, a missing DVC plugin).
    PushError
        if an output is in the work tree but not in the DVC cache, after pushing the rest.
    """
    root = Path(root)
    outs = outputs(root, stages)
    remote, cache = _setup(root)
    check_reachable(remote, for_push=True)
    ready, uncached, absent = [], [], []
    for out in outs:
        listing = _object(cache, out.md5)
        cached = listing.is_file() and all(_object(cache, md5).is_file() for _, md5 in _files(out, cache))
        (ready if cached else uncached if (root / out.path).exists() else absent).append(out)
    if ready:
        proc = _dvc(root, "push", *[o.path for o in ready])
        if proc.returncode != 0:
            hint = _plugin_hint(proc)  # a plugin missing here is set-up, not reachability
            raise (RemoteError if hint else RemoteUnreachable)(
                f"`dvc push` to {remote.describe()} failed; run it again once the remote is "
                f"reachable (what already arrived is not sent twice).\n{_errors(proc)}\n"
                f"{hint}{HOW_TO_SET}"
            )
    report = PushReport(
        remote=remote, pushed=[o.path for o in ready], not_in_cache=uncached, not_built=[o.path for o in absent]
    )
    if uncached:
        names = sorted({o.stage for o in uncached})
        raise PushError(
            f"Pushed {len(ready)} outputs to {remote.describe()}, but these are in the work tree and "
            f"not in the DVC cache, so they were not pushed: {', '.join(o.path for o in uncached)}. "
            f"They were built outside `dvc repro`, or while dvc.yaml did not cache them. If "
            f"`dvc status` shows them unchanged, `dvc commit {' '.join(names)}` records them in the "
            f"cache without changing dvc.lock; then push again.",
            report,
        )
    return report


def commit(root: Path, stages: Sequence[str]) -> None:
    """Record what a run outside ``dvc repro`` wrote for ``stages`` (dvc.lock and the cache)."""
    proc = _dvc(Path(root), "commit", "--force", *stages)
    if proc.returncode != 0:
        raise RemoteError(f"`dvc commit {' '.join(stages)}` failed:\n{_errors(proc)}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m flows.services.remote",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("command", choices=["push", "pull", "where"])
    ap.add_argument(
        "stages", nargs="*", help="stage names as in dvc.lock, e.g. adapt@mnist fedpad@quick (default: all)"
    )
    ap.add_argument("--root", default=".", help="the repository (default: the current directory)")
    args = ap.parse_args(argv)
    root = Path(args.root).resolve()
    try:
        if args.command == "where":
            print(f"{configure(root).describe()}\n{HOW_TO_SET}")
        elif args.command == "push":
            report = push(root, args.stages)
            print(f"pushed {len(report.pushed)} outputs to {report.remote.describe()}")
            if report.not_built:
                print(f"not built here, so not pushed: {', '.join(report.not_built)}")
        else:
            report = pull(root, args.stages)
            print(
                f"restored {len(report.restored)} outputs from {report.remote.describe()}, every one intact; "
                "`dvc status` shows what still differs from dvc.lock"
            )
            if report.absent:
                print(describe_absent(report.absent))
    except (RemoteError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
