"""Every command an error names works as written, run in the situation that produces the error.

A copy of the project's tracked files, as a fresh clone holds them: nothing built yet. Each step runs
what a new user would, takes the commands its error names (DVC's and the plain one), runs them, and
checks that the step then gets past that input. The commands that would take minutes here (pretraining,
a result grid) are checked by what DVC would run for them instead: the stage exists and writes the file.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NAMED = re.compile(r"`((?:dvc|python -m|make) [^`]+)`")


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """The tracked files in a git repository of their own, with this environment's ``.venv`` beside them."""
    root = tmp_path_factory.mktemp("fixes") / "fedcore"
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    for rel in listed.stdout.split("\0"):
        if rel and (ROOT / rel).is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, root / rel)
    (root / ".venv").symlink_to(Path(sys.executable).parents[1])
    for name in ("pyproject.toml", "constraints.txt"):  # installed: `make` must not reinstall into the shared .venv
        os.utime(root / name, (1, 1))
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "GIT_AUTHOR_NAME": "fedcore tests",
        "GIT_COMMITTER_NAME": "fedcore tests",
        "GIT_AUTHOR_EMAIL": "tests@fedcore.invalid",
        "GIT_COMMITTER_EMAIL": "tests@fedcore.invalid",
    }
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "the project"]):
        subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True)
    return root, env


def run(clone, command: str) -> subprocess.CompletedProcess:
    root, env = clone
    args = shlex.split(command)
    if args[0] == "python":
        args[0] = sys.executable
    return subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=600)


def fails_naming(clone, command: str, what: str) -> list[str]:
    """Run ``command``; it must fail on ``what`` and name the commands that build it: returns them."""
    done = run(clone, command)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert what in done.stderr, done.stderr[-2000:]
    named = NAMED.findall(done.stderr)
    assert named, done.stderr[-2000:]
    return named


def works(clone, command: str) -> None:
    done = run(clone, command)
    assert done.returncode == 0, f"`{command}` failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


def test_the_pipelines_missing_inputs_name_commands_that_build_them(clone):
    root, _ = clone

    # a partition before the data is prepared: DVC's stage builds it
    named = fails_naming(clone, "python -m flows.stages partition", "prepared data")
    assert named == ["dvc repro prepare@mnist", "python -m flows.stages prepare variant=mnist"]
    works(clone, named[0])
    assert (root / "data/prepared/mnist5k.npz").is_file()

    # pretraining before the partition exists: the plain command builds it
    named = fails_naming(clone, "python -m flows.stages pretrain", "no partition at")
    assert named == ["dvc repro partition@mnist", "python -m flows.stages partition variant=mnist"]
    works(clone, named[1])
    assert (root / "data/partitions/mnist5k/partition.npz").is_file()

    # adapting before pretraining: the stage it names writes that very file (pretraining takes minutes here)
    named = fails_naming(clone, "python -m flows.stages adapt", "source model")
    assert named[:2] == ["dvc repro pretrain@mnist", "python -m flows.stages pretrain variant=mnist"]
    stage = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]["pretrain"]
    assert stage["foreach"]["mnist"]["models"] == "models"
    dry = run(clone, f"{named[0]} --dry")
    assert dry.returncode == 0 and "Running stage 'pretrain@mnist'" in dry.stdout, dry.stderr[-2000:]


def test_a_grid_before_its_partition_names_the_stage_that_builds_it(clone):
    root, _ = clone
    named = fails_naming(clone, "python -m flows.stages fedpad", "no fedpad partition for grid 'quick'")
    assert named == ["dvc repro partition_domains@quick", "python -m flows.stages partition_domains fedpad.grid=quick"]
    works(clone, named[0])
    assert (root / "data/domains/fedpad/quick/partition.npz").is_file()
    dry = run(clone, "dvc status partition_domains@quick")
    assert dry.returncode == 0 and "changed" not in dry.stdout, dry.stdout


def test_a_missing_params_file_names_the_make_target_that_writes_it(clone):
    root, _ = clone
    params = root / "params.yaml"
    kept = params.read_bytes()
    params.unlink()
    try:
        named = fails_naming(clone, "python -m flows.stages prepare --params params.yaml", "params.yaml is missing")
        assert named == ["make params"]
        works(clone, "make params")
        assert params.read_bytes() == kept
    finally:
        if not params.exists():
            params.write_bytes(kept)


def test_a_report_before_its_grids_names_the_stage_that_writes_each_missing_table(clone):
    root, _ = clone
    named = fails_naming(clone, "python -m flows.stages fedpad_report", "scores.json is missing")
    assert named == ["dvc repro fedpad@digits"]  # the first grid of fedpad.report; a full grid takes minutes
    stage = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]["fedpad"]["do"]
    assert "results/fedpad/${item}/scores.json" in stage["outs"]
    listed = run(clone, "dvc stage list --name-only")  # (a dry run stops at the partition it would build first)
    assert listed.returncode == 0 and "fedpad@digits" in listed.stdout.split(), listed.stderr[-2000:]
