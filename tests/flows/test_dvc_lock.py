"""The committed dvc.lock records the committed code and config.

A stage's lock entry holds the hash of each code file or folder and each param it read when it last ran.
If the code changes and the lock does not, ``dvc repro`` in a fresh clone reruns stages nobody meant to
rerun, ``make pull`` restores outputs that this code did not build, and ``flows.services.integrity`` checks inputs
against a lock that is out of date. Only what a fresh clone has is compared: git-tracked code and conf/
(through params.yaml); a dependency that is another stage's output (or a folder holding such outputs) is
absent there, and rebuilt by DVC.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import pytest
import yaml

from flows.config.compose import ROOT


def stale_code_deps(root: Path) -> Dict[str, List[str]]:
    """``{stage: ["<dependency>: <status>", ...]}`` for every stage dvc.lock records whose code or params
    differ from the working tree (``modified``, ``deleted``); deps that are stage outputs are left out."""
    from dvc.dependency.param import ParamsDependency
    from dvc.repo import Repo

    recorded = set((yaml.safe_load((root / "dvc.lock").read_text()) or {}).get("stages", {}))
    stale: Dict[str, List[str]] = {}
    with Repo(str(root)) as repo:
        stages = list(repo.index.stages)
        outs = [Path(o.fs_path) for s in stages for o in s.outs]
        for stage in stages:
            if stage.name not in recorded:
                continue  # never run here: nothing recorded, so nothing stale
            for dep in stage.deps:
                if not isinstance(dep, ParamsDependency):
                    path = Path(dep.fs_path)
                    if any(path == o or o in path.parents or path in o.parents for o in outs):
                        continue  # another stage's output, inside one, or a folder of them (stress_report)
                for name, status in dep.status().items():
                    what = ", ".join(f"{k} {v}" for k, v in status.items()) if isinstance(status, dict) else status
                    if what:
                        stale.setdefault(stage.name, []).append(f"{name}: {what}")
    return stale


@pytest.mark.slow  # dvc status over every stage: about 30 s
def test_dvc_lock_records_the_committed_code_and_params():
    # Execute
    stale = stale_code_deps(ROOT)

    # Assert
    names = " ".join(sorted(stale))
    assert not stale, (
        "dvc.lock does not record the code and params these stages now depend on:\n"
        + "\n".join(f"  {s}: {'; '.join(d)}" for s, d in sorted(stale.items()))
        + f"\nRebuild them and commit dvc.lock: `dvc repro {names}`. If the change cannot change their "
        f"outputs (a comment, a docstring, a new file the stages do not read), record the new hashes with the "
        f"outputs in place instead: `dvc commit -f {names}` (after `make pull` in a fresh clone)."
    )
