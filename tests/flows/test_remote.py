"""Sharing a run through the DVC remote, as a user on a second machine would.

Clone A builds a two-stage pipeline (written with the project's own .dvc/config and .dvcignore) and
pushes; clone B, fresh, pulls. The stages log every run to a file outside both clones, so "rebuilds
nothing" is checked by counting runs, not by trusting DVC's message.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.config.compose import ROOT
from flows.services import remote as R

BUILD = """\
import json, pathlib, sys
stage = sys.argv[1]
with open(sys.argv[2], "a") as log:
    log.write(stage + "\\n")
if stage == "data":
    raw = pathlib.Path("data/raw"); raw.mkdir(parents=True, exist_ok=True)
    (raw / "a.txt").write_text("alpha"); (raw / "b.txt").write_text("beta")
else:
    res = pathlib.Path("results"); res.mkdir(exist_ok=True)
    words = sorted(p.read_text() for p in pathlib.Path("data/raw").iterdir())
    (res / "table.md").write_text("| word |\\n|---|\\n" + "".join(f"| {w} |\\n" for w in words))
    (res / "summary.json").write_text(json.dumps({"words": len(words)}))
"""


def sh(*args, cwd, check=True):
    proc = subprocess.run(list(args), cwd=cwd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed in {cwd}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def dvc(*args, cwd, check=True):
    return sh(sys.executable, "-m", "dvc", *args, cwd=cwd, check=check)


def git(*args, cwd):
    return sh("git", *args, cwd=cwd)


def runs(log: Path) -> list:
    return log.read_text().split() if log.is_file() else []


def make_project(path: Path, log: Path, *, summary_cache: bool = True) -> Path:
    """A git + DVC repository with the project's remote set-up and a tiny two-stage pipeline."""
    (path / "code").mkdir(parents=True)
    git("init", "-q", cwd=path)
    dvc("init", "-q", cwd=path)
    shutil.copy(ROOT / ".dvc" / "config", path / ".dvc" / "config")
    shutil.copy(ROOT / ".dvcignore", path / ".dvcignore")
    (path / "code" / "build.py").write_text(BUILD)
    cmd = f'"{sys.executable}" code/build.py {{}} "{log}"'
    table = "results/table.md" if summary_cache else {"results/table.md": {"cache": False}}
    stages = {
        "data": {"cmd": cmd.format("data"), "deps": ["code"], "outs": ["data/raw"]},
        "summary": {
            "cmd": cmd.format("summary"),
            "deps": ["code", "data/raw"],
            "outs": [table],
            "metrics": ["results/summary.json"],
        },
    }
    (path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (path / ".gitignore").write_text("/data/\n/results/\n")
    git("add", "-A", cwd=path)
    git("commit", "-qm", "pipeline", cwd=path)
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A folder for the clones, with DVC's site cache and a git identity of its own."""
    base = tmp_path_factory.mktemp("sharing")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(R.ENV, raising=False)
        mp.setenv("DVC_SITE_CACHE_DIR", str(base / "dvc-site"))
        for who in ("AUTHOR", "COMMITTER"):
            mp.setenv(f"GIT_{who}_NAME", "fedcore tests")
            mp.setenv(f"GIT_{who}_EMAIL", "tests@fedcore.invalid")
        yield base


@pytest.fixture(autouse=True)
def _no_remote_variable(base, monkeypatch):
    monkeypatch.delenv(R.ENV, raising=False)


@pytest.fixture(scope="module")
def pushed(base):
    """Clone A: the pipeline run, dvc.lock committed, everything pushed to the default remote."""
    log = base / "runs.log"
    a = make_project(base / "a", log)
    dvc("repro", cwd=a)
    git("add", "dvc.lock", cwd=a)
    git("commit", "-qm", "run", cwd=a)
    report = R.push(a)
    return {"a": a, "log": log, "report": report, "remote": base / "fedcore-dvc-remote", "base": base}


def copy_of_a(pushed, dest: Path) -> Path:
    """Clone A with its DVC cache, for a test that changes its settings."""
    shutil.copytree(pushed["a"], dest, symlinks=True)
    return dest


def test_a_fresh_clone_pulls_everything_and_rebuilds_nothing(pushed):
    # Prepare: the default remote is the folder beside the clone, with no set-up
    a, log = pushed["a"], pushed["log"]
    assert pushed["report"].remote.url == str(pushed["remote"])
    assert sorted(pushed["report"].pushed) == ["data/raw", "results/summary.json", "results/table.md"]
    assert runs(log) == ["data", "summary"]
    b = pushed["base"] / "b"
    git("clone", "-q", str(a), str(b), cwd=pushed["base"])

    # Execute
    report = R.pull(b)
    (b / "code" / "__pycache__").mkdir()  # what importing the code leaves behind on a second machine
    (b / "code" / "__pycache__" / "build.cpython-311.pyc").write_bytes(b"\0")
    status = json.loads(dvc("status", "--json", cwd=b).stdout)
    repro = dvc("repro", cwd=b)

    # Assert: the same bytes as A, a clean status, and no stage ran again
    assert sorted(report.restored) == sorted(pushed["report"].pushed) and report.refused == []
    for rel in ("data/raw/a.txt", "data/raw/b.txt", "results/table.md", "results/summary.json"):
        assert (b / rel).read_bytes() == (a / rel).read_bytes(), rel
    assert status == {}
    assert runs(log) == ["data", "summary"], repro.stdout
    assert "Running stage" not in repro.stdout


def test_a_corrupt_file_in_the_remote_is_named_and_never_checked_out(pushed, tmp_path, monkeypatch):
    # Prepare: a copy of the remote whose object for data/raw/b.txt holds other bytes
    remote = tmp_path / "bad-remote"
    shutil.copytree(pushed["remote"], remote)
    md5 = hashlib.md5(b"beta").hexdigest()
    obj = R._object(remote, md5)
    obj.chmod(0o644)
    obj.write_bytes(b"evil")
    b = tmp_path / "b"
    git("clone", "-q", str(pushed["a"]), str(b), cwd=tmp_path)
    (b / "data" / "raw").mkdir(parents=True)
    (b / "data" / "raw" / "b.txt").write_text("mine")  # the work tree's own copy must survive
    monkeypatch.setenv(R.ENV, str(remote))

    # Execute
    with pytest.raises(R.PullError) as err:
        R.pull(b)

    # Assert: the error names the file and says why; the intact outputs arrived; nothing bad did
    msg = str(err.value)
    assert "data/raw/b.txt" in msg and f"md5 {md5}" in msg and "corrupt" in msg and str(obj) in msg
    assert [f.path for f in err.value.report.refused] == ["data/raw/b.txt"]
    assert sorted(err.value.report.restored) == ["results/summary.json", "results/table.md"]
    assert (b / "results" / "table.md").read_text() == (pushed["a"] / "results" / "table.md").read_text()
    assert (b / "data" / "raw" / "b.txt").read_text() == "mine"
    assert not (b / "data" / "raw" / "a.txt").exists()
    assert not R._object(b / ".dvc" / "cache", md5).exists()  # no bad copy left for a later `dvc checkout`
    # Plain `dvc pull` refuses it too (the remote's `verify = true`), if less clearly
    (b / "data" / "raw" / "b.txt").unlink()
    assert dvc("pull", cwd=b, check=False).returncode != 0
    assert not (b / "data" / "raw" / "b.txt").exists()
    # The repair the error advises: delete the remote's bad copy and its directory's listing (while
    # the listing is there `dvc push` skips the directory), push from a clone that has it, pull again
    listing = R._object(remote, next(o.md5 for o in R.outputs(b) if o.path == "data/raw"))
    assert f"Delete {obj} and {listing}, then `make push`" in msg
    obj.unlink()
    listing.unlink()
    R.push(copy_of_a(pushed, tmp_path / "a"))
    assert R.pull(b).refused == [] and (b / "data" / "raw" / "b.txt").read_text() == "beta"


def test_a_partly_pushed_run_pulls_what_was_pushed_and_exits_zero(pushed, tmp_path, monkeypatch):
    """A clone that built only some stages pushed only those: the rest is absent from the remote, which is
    no error unless those stages were asked for by name; corruption stays an error (test above)."""
    # Prepare: a remote that holds only stage summary's outputs, and a fresh clone that points at it
    remote = tmp_path / "partial-remote"
    monkeypatch.setenv(R.ENV, str(remote))
    assert sorted(R.push(copy_of_a(pushed, tmp_path / "a"), ["summary"]).pushed) == [
        "results/summary.json",
        "results/table.md",
    ]
    b = tmp_path / "b"
    git("clone", "-q", str(pushed["a"]), str(b), cwd=tmp_path)

    def pull(*stages):
        return sh(
            sys.executable, "-m", "flows.services.remote", "pull", *stages, "--root", str(b), cwd=ROOT, check=False
        )

    # Execute
    everything, asked = pull(), pull("data")

    # Assert: exit 0, the pushed outputs restored, the absent one reported once, by stage, with both ways
    assert everything.returncode == 0, everything.stderr
    assert "restored 2 outputs" in everything.stdout and "every one intact" in everything.stdout
    assert "Not in the remote, because no clone has pushed them: 1 outputs of 1 stages: data (1)" in everything.stdout
    assert (
        "`dvc repro data`" in everything.stdout and "did not arrive intact" not in everything.stdout + everything.stderr
    )
    assert (b / "results" / "table.md").read_text() == (pushed["a"] / "results" / "table.md").read_text()
    assert not (b / "data" / "raw").exists()
    # a stage asked for by name that the remote lacks is an error, and says so without calling it corrupt
    assert asked.returncode == 1
    assert "data (1)" in asked.stderr and "did not arrive intact" not in asked.stderr


def test_the_remote_variable_is_kept_out_of_git(pushed, tmp_path, monkeypatch):
    # Prepare
    a = copy_of_a(pushed, tmp_path / "a")
    other = tmp_path / "shared" / "fedcore"
    (tmp_path / "shared").mkdir()
    monkeypatch.setenv(R.ENV, str(other))

    # Execute
    report = R.push(a)

    # Assert: pushed there, recorded in the git-ignored .dvc/config.local, .dvc/config untouched
    assert report.remote.url == str(other) and R.ENV in report.remote.origin
    assert R._object(other, hashlib.md5(b"alpha").hexdigest()).is_file()
    assert git("status", "--porcelain", cwd=a).stdout == ""
    assert str(other) in (a / ".dvc" / "config.local").read_text()


def test_an_ssh_key_is_written_beside_the_url(pushed, tmp_path, monkeypatch):
    a = copy_of_a(pushed, tmp_path / "a")
    key = tmp_path / "keys" / "client_key"
    monkeypatch.setenv(R.ENV, "ssh://fedcore@127.0.0.1:2299/srv/dvc")
    monkeypatch.setenv(R.KEYFILE_ENV, str(key))

    remote = R.configure(a)

    local = (a / ".dvc" / "config.local").read_text()
    assert remote.url == "ssh://fedcore@127.0.0.1:2299/srv/dvc" and f"keyfile = {key}" in local
    assert git("status", "--porcelain", cwd=a).stdout == ""


def test_a_nightly_whose_push_fails_completes_and_names_the_command_that_pushes_later(monkeypatch, caplog):
    from prefect import flow

    from flows.runs import nightly as N

    def fails(error):
        def share(stages, root):
            raise error

        return share

    @flow
    def run() -> str:
        return N._share(["fedpad@quick"], None, True, root="/srv/fedcore")

    monkeypatch.setattr(N, "share", fails(R.RemoteUnreachable("remote 'fedcore' (ssh://...) is not reachable")))
    said = run()
    assert said.startswith("NOT pushed") and "python -m flows.services.remote push fedpad@quick" in said
    assert "pushing it to the DVC remote failed after retries" in caplog.text and "not reachable" in caplog.text

    # recording the run failed, or the remote is set up wrong: that fails the run
    monkeypatch.setattr(N, "share", fails(R.RemoteError("`dvc commit fedpad@quick` failed")))
    with pytest.raises(R.RemoteError, match="dvc commit"):
        run()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("where", ["unmounted share", "server down"])
def test_pushing_to_an_unreachable_remote_names_it_and_how_to_set_it(where, pushed, tmp_path, monkeypatch):
    # Prepare
    a = copy_of_a(pushed, tmp_path / "a")
    url = (
        str(tmp_path / "mnt" / "team" / "fedcore")
        if where == "unmounted share"
        else f"http://127.0.0.1:{_closed_port()}/fedcore"
    )
    monkeypatch.setenv(R.ENV, url)

    # Execute
    with pytest.raises(R.RemoteError) as err:
        R.push(a)

    # Assert
    msg = str(err.value)
    assert f"remote 'fedcore' ({url}" in msg
    assert f"{R.ENV}=" in msg and "dvc remote modify --local fedcore url" in msg
    assert not (tmp_path / "mnt").exists()  # DVC would have created the folder on the local disk


def test_an_output_built_while_uncached_is_reported_with_the_fix(base, tmp_path):
    # Prepare: results/table.md built while dvc.yaml said `cache: false`, then switched to cached
    a = make_project(tmp_path / "a", tmp_path / "runs.log", summary_cache=False)
    dvc("repro", cwd=a)
    lock = (a / "dvc.lock").read_text()
    spec = yaml.safe_load((a / "dvc.yaml").read_text())
    spec["stages"]["summary"]["outs"] = ["results/table.md"]
    (a / "dvc.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))

    # Execute
    with pytest.raises(R.PushError) as err:
        R.push(a)
    R.commit(a, ["summary"])
    report = R.push(a)

    # Assert: named with the command that fixes it; `dvc commit` leaves dvc.lock as it was
    assert "results/table.md" in str(err.value) and "dvc commit summary" in str(err.value)
    assert [o.path for o in err.value.report.not_in_cache] == ["results/table.md"]
    assert (a / "dvc.lock").read_text() == lock
    assert "results/table.md" in report.pushed and report.not_in_cache == []


def test_an_unknown_stage_lists_the_recorded_ones(pushed):
    with pytest.raises(ValueError, match="Not in dvc.lock: adapt. Stages it records: data, summary"):
        R.pull(pushed["a"], ["adapt"])


def test_the_project_caches_every_output_and_names_a_remote_outside_the_work_tree():
    # Prepare
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    config = (ROOT / ".dvc" / "config").read_text()

    # Execute
    flags = [
        out
        for stage in spec["stages"].values()
        for key in ("outs", "metrics")
        for out in (stage.get("do", stage).get(key) or [])
        if isinstance(out, dict)
    ]
    url = next(ln.split("=", 1)[1].strip() for ln in config.splitlines() if ln.strip().startswith("url"))
    target = (ROOT / ".dvc" / url).resolve()

    # Assert: a fresh clone restores every output from the remote, which lives beside the clone
    assert all(v.get("cache", True) for out in flags for v in out.values()), flags
    assert "remote = fedcore" in config and "verify = true" in config
    assert target.parent == ROOT.resolve().parent and target.name == "fedcore-dvc-remote"


def test_the_nightly_records_and_pushes_what_it_built(base, tmp_path):
    # Prepare: the stages' code run outside `dvc repro`, as the nightly flow runs it
    from flows.runs import nightly as N

    log = tmp_path / "runs.log"
    a = make_project(tmp_path / "a", log)
    for stage in ("data", "summary"):
        sh(sys.executable, "code/build.py", stage, str(log), cwd=a)
    remote = tmp_path / "fedcore-dvc-remote"

    # Execute
    with_overrides = N._share(["data", "summary"], ["seed=1"], True, root=str(a))
    switched_off = N._share(["data", "summary"], None, False, root=str(a))
    nothing_yet = remote.exists()
    shared = N.share.fn(["data", "summary"], root=str(a))
    repro = dvc("repro", cwd=a)

    # Assert: only a run without overrides is shared; then dvc.lock records it, the remote holds
    # every object, and DVC agrees that nothing needs rebuilding
    assert "overrides" in with_overrides and "push=false" in switched_off and not nothing_yet
    assert shared.startswith("pushed 3 outputs of data, summary to remote 'fedcore'")
    outs = R.outputs(a)
    assert sorted(o.path for o in outs) == ["data/raw", "results/summary.json", "results/table.md"]
    assert all(R._object(remote, o.md5).is_file() for o in outs)
    assert json.loads(dvc("status", "--json", cwd=a).stdout) == {}
    assert runs(log) == ["data", "summary"], repro.stdout


def test_every_nightly_deployment_pushes_after_a_run():
    # Prepare
    import inspect

    from flows.runs import nightly as N

    spec = yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())

    # Execute
    pushes = {d["name"]: d["parameters"].get("push") for d in spec["deployments"]}
    flows = {d["name"]: getattr(N, d["entrypoint"].split(":")[1]) for d in spec["deployments"]}

    # Assert: switched on in the deployment, and a parameter the flow takes
    from flows import systems

    assert pushes == {f"nightly-{name}": True for name in systems.names()}
    assert all("push" in inspect.signature(f.fn).parameters for f in flows.values())


@pytest.mark.slow
def test_a_real_stage_round_trips_through_the_remote(base, tmp_path, monkeypatch):
    # Prepare: clone A is this work tree's tracked files; it builds FedPAD's quick partition
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    stage = "partition_domains@quick"
    a = tmp_path / "a"
    for rel in git("ls-files", "-z", cwd=ROOT).stdout.split("\0"):
        if rel and (ROOT / rel).is_file():
            (a / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, a / rel)
    git("init", "-q", cwd=a)
    git("add", "-A", cwd=a)
    git("commit", "-qm", "the project", cwd=a)
    dvc("repro", "--single-item", stage, cwd=a)
    git("commit", "-q", "--allow-empty", "-am", "run", cwd=a)  # dvc.lock changes only if the code moved
    pushed = R.push(a, [stage])
    b = tmp_path / "b"
    git("clone", "-q", str(a), str(b), cwd=tmp_path)

    # Execute
    pulled = R.pull(b, [stage])
    status = json.loads(dvc("status", "--json", stage, cwd=b).stdout)
    repro = dvc("repro", "--single-item", stage, cwd=b)

    # Assert: B has A's partition, DVC finds it current, and nothing is rebuilt
    assert pushed.pushed == pulled.restored == ["data/domains/fedpad/quick"]
    for f in (a / "data/domains/fedpad/quick").iterdir():
        assert (b / "data/domains/fedpad/quick" / f.name).read_bytes() == f.read_bytes(), f.name
    assert status == {}
    assert "Running stage" not in repro.stdout and "didn't change" in repro.stdout


@pytest.mark.parametrize("target", ["push", "pull"])
def test_make_targets_run_the_wrapper(target):
    # `make -n` prints the recipe without running it (nor the set-up it depends on)
    out = sh("make", "-n", target, "STAGES=adapt@mnist fedpad@quick", cwd=ROOT).stdout
    assert f"python -m flows.services.remote {target} adapt@mnist fedpad@quick" in out


@pytest.mark.parametrize("defined", [True, False], ids=["remote-defined", "no-remote"])
def test_a_missing_default_remote_names_a_command_that_sets_one(base, tmp_path, defined):
    """With no default remote, the error's command, run as written (a URL put in for ``<url>``), sets one:
    `dvc remote default` where the project's remote is still defined (adding it again would be refused)."""
    # Prepare: the project's set-up less its default; the remote itself removed too, or kept
    project = make_project(tmp_path / "p", tmp_path / "runs.log")
    dvc("config", "--unset", "core.remote", cwd=project)
    if not defined:
        dvc("remote", "remove", R.REMOTE, cwd=project)

    # Execute: the command the error names
    with pytest.raises(R.RemoteError, match="No default DVC remote") as err:
        R.configure(project)
    command = next(c for c in re.findall(r"`([^`]+)`", str(err.value)) if c.startswith("dvc remote"))
    dvc(*shlex.split(command.replace("<url>", str(tmp_path / "store")))[1:], cwd=project)

    # Assert: a remote is configured now
    assert R.configure(project).name == R.REMOTE
