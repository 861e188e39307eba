"""``python -m flows.reports.exp``: the columns it keeps out of every one ``dvc exp show`` would print."""

from __future__ import annotations

import re

from flows.config import compose as C
from flows.reports import exp


def test_the_view_keeps_each_systems_headline_and_the_settings_a_user_changes():
    cmd = exp.command(C.compose([]), ["--csv"])
    assert cmd[-1] == "--csv" and cmd[cmd.index("--drop") + 1] == ".*"
    keep = re.compile(cmd[cmd.index("--keep") + 1])
    kept = [
        "Experiment",
        "Created",
        "headline.final_avg_holdout_acc",
        "results/private/summary.json:headline.avg_online_acc",  # two metrics files with the same key
        "fedpad.worst_acc",
        "fedpd++.auroc",  # FedPD++'s target method, not the system's name
        "ppfcil.avg_inc_acc",
        "fedpad.grid",
        "method.name",
        "adapt.passes",
        "seed",
    ]
    dropped = [
        "fedpad.grids.quick.rounds",
        "fedpad.avg_acc_std",
        "fedpad.acc.mnist",
        "fedavg.worst_acc",  # a baseline's: in --all and exp diff
        "fedpd.auroc",
        "ppfcil.target",
        "ppfcil.avg_inc_acc_std",
        "data/partitions",
        "method.params.lr",
    ]
    assert [c for c in kept if not keep.match(c)] == []
    assert [c for c in dropped if keep.match(c)] == []
    assert keep.match("rev")  # in CSV, the column that names the workspace and main rows
    table = exp.command(C.compose([]), [])
    assert not re.match(table[table.index("--keep") + 1], "rev")  # the table shows them under Experiment


def test_all_passes_every_column_through():
    cmd = exp.command(C.compose([]), ["--all", "--json"])
    assert cmd[-4:] == ["dvc", "exp", "show", "--json"]
