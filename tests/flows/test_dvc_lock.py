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


def _rows(seconds: float) -> List[dict]:
    """Two methods x two seeds of finished cells, as the grid's report reads them, that took ``seconds``."""
    rows = []
    for m, base in (("fedavg", 0.6), ("fedpad", 0.7)):
        for s in (0, 1):
            acc = base + 0.01 * s
            summary = {
                "final_avg_acc": acc,
                "final_worst_acc": acc - 0.2,
                **{f"final_acc.{d}": acc for d in ("a", "b")},
                "final_auroc.msp": acc,
                "final_oscr.msp": acc - 0.1,
                **{f"final_auroc.msp.{d}": acc for d in ("a", "b")},
                "avg_inc_acc": acc,
                "final_acc": acc - 0.1,
                "forgetting": 0.1,
                "agg_seconds_mean": seconds / 1000,
                "bytes_per_round": 2.0**20,
            }
            rows.append(
                {"method": m, "seed": s, "summary": summary, "seconds": seconds, "rounds": 4}
                | {"acc_seen": [acc, acc - 0.1], "max_epsilon": None}
            )
    return rows


def test_stage_outputs_hold_no_timing_so_a_rebuild_writes_the_recorded_bytes(tmp_path):
    """Two runs of the same cells take different times; every file a grid stage outputs must still be the same
    bytes, or ``dvc repro`` could never rebuild what dvc.lock records. The times go to timings.md (not an output)."""
    from flows.reports import plot_data
    from flows.reports.tables import write_grid_report, write_incremental_report, write_openset_report

    def write(out: Path, seconds: float) -> None:
        rows = _rows(seconds)
        write_grid_report(rows, domains=["a", "b"], out=out / "domains", title="t", target="fedpad")
        write_openset_report(
            rows,
            domains=["a", "b"],
            out=out / "openset",
            title="t",
            scores={"fedavg": ["msp"], "fedpad": ["msp"]},
            target="fedpad",
        )
        write_incremental_report(rows, out=out / "incremental", title="t", target="fedpad")
        records = [
            {"round": r, "train_loss": 1.0 / (r + 1), "agg_seconds": seconds * r, "adapt_seconds": seconds}
            for r in range(3)
        ]
        plot_data.write_records_csv(records, out / "rounds.csv")

    # Execute: the same cells, once fast and once slow
    write(tmp_path / "fast", 2.0)
    write(tmp_path / "slow", 300.0)

    # Assert: every output byte-identical; the times only in timings.md, one per report
    files = sorted(p.relative_to(tmp_path / "fast") for p in (tmp_path / "fast").rglob("*") if p.is_file())
    outputs = [f for f in files if f.name != "timings.md"]
    assert {f.name for f in outputs} >= {
        "table.md",
        "summary.json",
        "scores.json",
        "stats.md",
        "methods.png",
        "rounds.csv",
    }
    assert [
        str(f) for f in outputs if (tmp_path / "fast" / f).read_bytes() != (tmp_path / "slow" / f).read_bytes()
    ] == []
    assert (tmp_path / "fast/rounds.csv").read_text().splitlines()[0] == "round,train_loss"
    timings = [f for f in files if f.name == "timings.md"]
    assert len(timings) == 3
    for f in timings:
        assert "| fedpad |" in (tmp_path / "slow" / f).read_text() and "| 300 |" in (tmp_path / "slow" / f).read_text()
        assert (tmp_path / "fast" / f).read_text() != (tmp_path / "slow" / f).read_text()


def test_every_stage_that_writes_cell_folders_depends_on_the_code_that_writes_them():
    """A cell folder holds the CSVs of flows/reports/plot_data.py and the plots of fedcore/evaluate: a stage
    that does not list them is restored from DVC's run cache in the old format after either changes."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    missing = {}
    for name, stage in stages.items():
        stage = stage.get("do", stage)
        if any(str(o).endswith("/cells") for o in stage.get("outs", [])):
            lacking = {"flows/reports/plot_data.py", "fedcore/evaluate"} - set(stage.get("deps", []))
            if lacking:
                missing[name] = sorted(lacking)
    assert missing == {}
