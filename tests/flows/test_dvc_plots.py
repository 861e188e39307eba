"""dvc.yaml's plots: each one reads a table its stage writes, and ``dvc plots show`` renders every one.

The fast tests check the tables' writer and that every file a plot names is a table the stage owning it
writes for its configured cells (a renamed cell or table fails here, not silently as an empty plot). The
slow one writes each named table in a throwaway repository through the stage code on tiny data (the
arrival and round engines, then the functions the flows call on their results) and asks ``dvc plots show``.
"""

from __future__ import annotations

import csv
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest

from flows.config import compose as C
from flows.config.compose import ROOT
from flows.reports import plot_data, plot_page
from tests.dvc_repo import DVC_CONFIG, dvc, env, run
from tests.helpers import for_variant, tiny_overrides

Cell = Tuple  # ("arrivals", variant, method, aggregator, form, seed) | ("rounds", system, grid, method, seed)


def declared_plots(root: Path) -> Dict[str, List[Tuple[str, List[str]]]]:
    """``{plot id: [(file, [fields]), ...]}``: dvc.yaml's top-level plots as DVC resolves them (params
    interpolated), files relative to ``root``."""
    from dvc.dvcfile import load_file
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        defs = load_file(repo, str(root / "dvc.yaml")).plots
    out = {}
    for item in defs:
        ((pid, props),) = item.items()
        out[pid] = [(f, [fields] if isinstance(fields, str) else list(fields)) for f, fields in props["y"].items()]
    return out


def stage_outs(root: Path) -> Dict[str, List[str]]:
    """``{stage: [output path, ...]}`` from dvc.yaml, paths relative to ``root``."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return {s.name: [Path(o.fs_path).relative_to(root).as_posix() for o in s.outs] for s in repo.index.stages}


def stage_tables(stage: str) -> Dict[str, Cell]:
    """``{table path: cell}`` of every plot table ``stage`` writes with the committed config."""
    from flows.runs.tasks import cell_name, sweep_cells

    name, _, key = stage.partition("@")
    if name in ("adapt", "private"):
        variant = key or "private"
        cfg = C.compose([f"variant={variant}"])
        out = {}
        for m, a, f, s in sweep_cells(cfg):
            acfg = C.arrival_config(cfg, method=m, aggregator=a, seed=s, form=f)
            folder = f"{cfg.paths.results}/cells/{cell_name(acfg)}"
            for table in (plot_data.ARRIVALS_CSV, plot_data.ACCURACY_CSV):
                out[f"{folder}/{table}"] = ("arrivals", variant, m, a, f, s)
        return out
    if name in C.round_systems():
        cfg = C.compose([])
        g = C.grid(cfg, name, key)
        folder = f"{cfg.paths.results}/{name}/{key}/cells"
        return {
            f"{folder}/{m}-s{s}/{plot_data.ROUNDS_CSV}": ("rounds", name, key, str(m), int(s))
            for s in g.seeds
            for m in g.methods
        }
    return {}


def owner(path: str, outs: Dict[str, List[str]]) -> str:
    """The one stage whose output holds ``path``."""
    stages = [s for s, paths in outs.items() if any(path == o or path.startswith(o + "/") for o in paths)]
    assert len(stages) == 1, f"{path} lies in the outputs of {stages or 'no stage'}: one stage must build it"
    return stages[0]


# ------------------------------------------------------------------------------------ fast


def test_records_csv_has_one_header_and_blank_cells_for_missing_or_nan(tmp_path):
    # Prepare: records that grow a field, hold a NaN, a bool, numpy scalars and a list
    records = [
        {"round": 0, "acc.task0": 0.5, "weight_drift": math.nan, "clients": [0, 1], "refused": True},
        {
            "round": np.int64(1),
            "acc.task0": np.float32(0.25),
            "acc.task1": 0.75,
            "weight_drift": 0.1,
            "clients": [1],
            "refused": False,
        },
    ]

    # Execute
    path = plot_data.write_records_csv(records, tmp_path / "rounds.csv")

    # Assert
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == ["round", "acc.task0", "weight_drift", "refused", "acc.task1"]
    assert rows[0] == {"round": "0", "acc.task0": "0.5", "weight_drift": "", "refused": "1", "acc.task1": ""}
    assert rows[1] == {"round": "1", "acc.task0": "0.25", "weight_drift": "0.1", "refused": "0", "acc.task1": "0.75"}


def test_accuracy_csv_is_the_matrix_in_long_form_without_unseen_clients(tmp_path):
    # Prepare: 3 arrivals over 2 clients; client 1 is not seen until arrival 1
    acc = np.array([[0.5, np.nan], [0.6, 0.7], [0.55, 0.8]])

    # Execute
    path = plot_data.write_accuracy_csv(acc, ["fog", "snow"], tmp_path / "accuracy.csv")

    # Assert: one row per finite entry, and the matrix back from the rows
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == np.isfinite(acc).sum() == 5
    back = np.full_like(acc, np.nan)
    for r in rows:
        back[int(r["arrival"]), int(r["client_id"])] = float(r["acc"])
    np.testing.assert_allclose(back, acc)
    assert {r["corruption"] for r in rows} == {"0:fog", "1:snow"}


@pytest.mark.slow  # runs the stage code of every plotted stage
def test_every_plot_reads_a_table_that_the_stage_owning_it_writes():
    # Prepare
    plots = declared_plots(ROOT)
    outs = stage_outs(ROOT)

    # Execute / Assert: each file is inside one stage's outputs (cached, rebuilt) and is a table that stage
    # writes for one of its configured cells
    assert plots, "dvc.yaml declares no plots"
    for pid, series in plots.items():
        for path, fields in series:
            stage = owner(path, outs)
            tables = stage_tables(stage)
            assert path in tables, (
                f"plot {pid!r} reads {path}, which stage {stage} does not write; it writes {sorted(tables)[:6]} ..."
            )
            assert fields, pid


# ------------------------------------------------------------------------------------ slow


def _arrival_tables(folder: Path, cell: Cell, tmp: Path, partition: Path) -> None:
    """One arrival cell on the tiny digits federation (plain driver, untrained source), its tables written by
    the function :func:`flows.runs.federation._log_experiment` calls."""
    from fedcore.data import Partition
    from fedcore.engine import run_arrivals

    _, variant, m, a, f, s = cell
    cfg = C.compose(for_variant(tiny_overrides(tmp) + [f"variant={variant}", "adapt.passes=1"]))
    part = Partition.load(partition)
    spec = C.model_spec(cfg)
    acfg = C.arrival_config(cfg, method=m, aggregator=a, seed=s, form=f)
    res = run_arrivals(part, spec, spec.build().state_dict(), acfg)
    plot_data.write_arrival_tables(folder, res.records, res.acc_matrix, [t.corruption for t in part.targets])


TINY_GRIDS = {
    "fedpad": ["fedpad.grids.quick.max_per_domain=120", "fedpad.grids.quick.rounds=2"],
    "fedpd": [
        "fedpd.grids.quick.max_per_domain=150",
        "fedpd.grids.quick.rounds=2",
        "fedpd.grids.quick.trainer.closed_rounds=1",
    ],
    "ppfcil": [
        "ppfcil.grids.quick.max_per_domain=300",
        "ppfcil.grids.quick.tasks=2",
        "ppfcil.grids.quick.rounds_per_task=2",
        "ppfcil.grids.quick.clients=2",
        "ppfcil.grids.quick.participation=1.0",
    ],
}


def _round_tables(folder: Path, cell: Cell, tmp: Path) -> None:
    """One round cell of a quick grid, shrunk, as the grid's Ray task runs it; written by the flow's
    :func:`flows.runs.rounds._cell_outputs`."""
    from fedcore.engine import run_rounds
    from flows.reports.evaluations import round_inputs
    from flows.runs.rounds import _cell_outputs, _headline_score
    from flows.runs.steps import partition_domains as _partition_domains
    from flows.runs.tasks import load_domain_partition

    _, system, grid, m, s = cell
    cfg = C.compose([f"paths.domains={tmp}/domains", f"{system}.grid={grid}", *TINY_GRIDS[system]])
    if not C.domains_dir(cfg, system, grid).is_dir():
        _partition_domains(cfg, system)
    rcfg = C.round_config(cfg, system, method=m, seed=s, grid_name=grid)
    part = load_domain_partition(cfg, system, grid)
    data, spec, evaluate = round_inputs(cfg, system, grid, part, rcfg, method=m)
    res = run_rounds(data, spec, rcfg, evaluate=evaluate)
    _cell_outputs(
        res,
        part,
        folder,
        title=f"{system} {grid}: {m}",
        system=system,
        score=_headline_score(cfg, system, m, rcfg.trainer),
    )


@pytest.mark.slow
def test_plots_show_renders_every_declared_plot_from_tables_the_stage_code_writes(tmp_path):
    # Prepare: a repository with the pipeline's plot definitions, and each table a plot names, written by
    # the stage code on tiny data
    from flows.runs.federation import partition_dir
    from flows.runs.steps import partition as _partition
    from flows.runs.steps import prepare as _prepare

    repo = tmp_path / "repo"
    (repo / ".dvc").mkdir(parents=True)
    shutil.copytree(ROOT / ".dvc" / "plots", repo / ".dvc" / "plots")
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / name, repo / name)
    (repo / ".dvc" / "config").write_text(DVC_CONFIG)
    plot_page.write(repo)  # and .dvc/config.local names it, as make setup does
    run(repo, "git", "init", "-q")
    plots = declared_plots(ROOT)
    outs = stage_outs(ROOT)
    tiny = tmp_path / "tiny"
    cfg = C.compose(tiny_overrides(tiny))
    _prepare(cfg)
    _partition(cfg)
    cells = {}
    for series in plots.values():
        for path, _ in series:
            cells[path] = stage_tables(owner(path, outs))[path]
    for path, cell in cells.items():
        folder = repo / Path(path).parent
        if (repo / path).is_file():
            continue  # written with another table of its cell
        if cell[0] == "arrivals":
            _arrival_tables(folder, cell, tiny, partition_dir(cfg))
        else:
            _round_tables(folder, cell, tiny)

    # Execute
    shown = json.loads(dvc(repo, "plots", "show", "--json").stdout)
    dvc(repo, "plots", "show", "-o", "page")
    html = (repo / "page" / "index.html").read_text()

    # Assert: every declared plot, each of its files and fields with a value in every row
    assert not shown.get("errors"), shown["errors"]
    data = shown.get("data", shown)
    assert set(data) == set(plots)
    for pid, series in plots.items():
        values = [v for item in data[pid] for v in item["content"]["data"]["values"]]
        for path, fields in series:
            rows = [v for v in values if path.endswith(v.get("filename", path))]
            assert rows, (pid, path)
            for field in fields:
                assert all(str(v.get(field, "")).strip() not in ("", "nan") for v in rows), (pid, path, field)
    # the page carries Vega itself, so it renders offline: no script is fetched from anywhere
    assert "window.vegaEmbed=" in html and "vegaEmbed('#" in html
    assert not re.search(r"<script[^>]+src=", html), "the page loads a script from elsewhere"
    # arrivals are read as text from the CSV: the matrix turns them into numbers, so 2 sorts before 10
    matrix = data["accuracy matrix"][0]["content"]
    assert {"calculate": "toNumber(datum.arrival)", "as": "arrival"} in matrix["transform"]
    assert matrix["encoding"]["y"]["sort"] == "ascending"
    # a table gone (its stage not run here): the plot that reads it is named, the others still drawn
    gone = plots["weight drift"][0][0]
    (repo / gone).unlink()
    named = subprocess.run(
        [sys.executable, "-m", "flows.reports.plots", "-o", "page2"],
        cwd=repo,
        capture_output=True,
        text=True,
        env={**env(), "PYTHONPATH": str(ROOT)},  # the code is not copied into this repository
    )
    assert named.returncode == 0 and f"- weight drift: no {gone};" in named.stderr, named.stderr[-2000:]
    assert (repo / "page2" / "index.html").is_file()


def test_a_plot_without_data_is_named_with_the_stage_that_writes_it(tmp_path, monkeypatch, capsys):
    from flows.reports import plots

    # Prepare: DVC's errors for a workspace without the private grid's tables, and a lock that records them
    (tmp_path / "dvc.lock").write_text(
        json.dumps(
            {
                "schema": "2.0",
                "stages": {
                    "private": {"cmd": "true", "outs": [{"path": "results/private/cells", "md5": "0" * 32 + ".dir"}]}
                },
            }
        )
    )
    errors = [
        {"name": "privacy ledger, ε per arrival", "rev": "workspace", "source": f"results/private/cells/e{e}.csv"}
        for e in (1, 5, 10)
    ] + [{"name": "weight drift", "rev": "main", "source": "results/cells/x.csv"}]  # another revision's
    calls = []

    def dvc(args, root):
        calls.append(list(args))
        if args[:1] == ["--json"]:
            return subprocess.CompletedProcess(args, 0, json.dumps({"errors": errors, "data": {}}), "")
        return subprocess.CompletedProcess(
            args, 0, "file:///page/index.html\n", f"DVC {plots.FAILED} for: 'workspace'.\n"
        )

    monkeypatch.setattr(plots, "_dvc", dvc)
    monkeypatch.chdir(tmp_path)

    # Execute
    code = plots.main(["-o", "page", "results/private/cells"])

    # Assert: DVC's own run and output, then the plot, its files and the stage that writes them
    err = capsys.readouterr().err
    assert code == 0 and calls == [["-o", "page", "results/private/cells"], ["--json", "results/private/cells"]]
    assert "1 plot(s) have no data in this workspace" in err
    assert (
        "- privacy ledger, ε per arrival: no results/private/cells/e1.csv, results/private/cells/e5.csv and 1 "
        "more; build it with `dvc repro private`, or fetch a pushed run with `make pull`"
    ) in err
    assert "weight drift" not in err
