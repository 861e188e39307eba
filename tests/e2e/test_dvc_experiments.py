"""``dvc exp run -S`` on the real dvc.yaml, then ``dvc exp show`` / ``dvc exp diff`` / ``dvc plots diff`` (slow).

In a throwaway git repository with this project's dvc.yaml, code and conf/, set to the tests' tiny digits
federation. Only ``adapt@mnist`` runs under ``dvc exp run`` (twice, each through Prefect, Ray and MLflow
as ``dvc repro`` runs it): its inputs are built in this process by the stage code (prepare, partition, and
the plain driver for FedAvg pretraining, which equals the flow) and recorded with ``dvc commit``, as a
clone holds them after ``make pull``. Running prepare, partition and pretrain under DVC too would add
three more processes that each start Python, torch, Ray and Prefect (minutes on 2 cores) and test nothing
that ``dvc exp`` adds.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.dvc_repo import commit, dvc, make_repo, run

pytestmark = pytest.mark.slow

TINY = dict(
    defaults={"data": "digits", "method": "tent", "aggregator": "fedavg"},
    settings={
        "pretrain": {"rounds": 2, "lr": 0.1, "batch_size": 32},
        "adapt": {"passes": 1},
        "sweep": {"methods": ["tent"], "aggregators": ["fedavg"], "seeds": [0], "privacy": ["plain"]},
        "flow": {"num_cpus": 2, "progress": False, "register_model": None},
    },
)
HEADLINE = ("avg_online_acc", "final_avg_holdout_acc", "final_worst_holdout_acc", "forgetting")


def _build_inputs(repo: Path) -> None:
    """prepare@mnist, partition@mnist and pretrain@mnist's outputs in ``repo``, recorded in its dvc.lock."""
    from dataclasses import asdict

    from fedcore.data import Partition
    from fedcore.engine import run_rounds, source_round_data
    from flows.config import compose as C
    from flows.runs import federation as F
    from flows.runs.steps import partition as _partition
    from flows.runs.steps import prepare as _prepare

    cfg = C.load(
        repo / "params.yaml",
        [
            f"paths.{k}={repo / v}"
            for k, v in (("prepared", "data/prepared"), ("partitions", "data/partitions"), ("models", "models"))
        ],
    )
    _prepare(cfg)
    _partition(cfg)
    spec = C.model_spec(cfg)
    part = Partition.load(F.partition_dir(cfg))
    state = run_rounds(source_round_data(part), spec, C.pretrain_config(cfg)).final_state
    path = F.source_model_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": state, "spec": asdict(spec)}, path)
    dvc(repo, "commit", "-f", "prepare@mnist", "partition@mnist", "pretrain@mnist")
    commit(repo, "inputs of adapt@mnist")


def _experiments(show: list) -> dict:
    """``{name: {"metrics": ..., "params": ...}}`` from ``dvc exp show --json``."""
    found = {}

    def walk(node):
        if isinstance(node, dict):
            if node.get("name") and isinstance(node.get("data"), dict):
                d = node["data"]
                found[node["name"]] = {
                    "metrics": {f: v.get("data", {}) for f, v in (d.get("metrics") or {}).items()},
                    "params": {f: v.get("data", {}) for f, v in (d.get("params") or {}).items()},
                }
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(show)
    return found


def summary_of(exp: dict) -> float:
    return exp["metrics"]["results/summary.json"]["headline"]["final_avg_holdout_acc"]


def test_exp_run_twice_then_show_and_diff_put_the_headline_metrics_side_by_side(tmp_path):
    # Prepare
    repo = make_repo(tmp_path / "repo", **TINY)
    _build_inputs(repo)

    # Execute
    for passes in (1, 2):
        dvc(repo, "exp", "run", "adapt@mnist", "-S", f"adapt.passes={passes}", "-n", f"passes{passes}")
    show = json.loads(dvc(repo, "exp", "show", "--json").stdout)
    diff = json.loads(dvc(repo, "exp", "diff", "passes1", "passes2", "--all", "--json").stdout)
    plots = json.loads(dvc(repo, "plots", "diff", "passes1", "passes2", "--json").stdout)

    # Assert: both experiments, their params and numeric headline metrics
    exps = _experiments(show)
    assert {"passes1", "passes2"} <= set(exps), sorted(exps)
    for passes in (1, 2):
        e = exps[f"passes{passes}"]
        assert e["params"]["params.yaml"]["adapt"]["passes"] == passes
        summary = e["metrics"]["results/summary.json"]
        assert set(summary) == {"headline", "tent+fedavg+s0"}
        for k in HEADLINE:
            v = summary["headline"][k]
            assert isinstance(v, (int, float)) and math.isfinite(v), (passes, k, v)
        assert summary["headline"] == summary["tent+fedavg+s0"]
    # exp diff: the changed param, and the headline metrics old beside new with a difference
    assert diff["params"]["params.yaml"]["adapt.passes"]["old"] == 1
    assert diff["params"]["params.yaml"]["adapt.passes"]["new"] == 2
    head = {
        k[len("headline.") :]: v
        for k, v in diff["metrics"]["results/summary.json"].items()
        if k.startswith("headline.")
    }
    assert set(HEADLINE) <= set(head)
    for v in head.values():
        assert all(isinstance(v[k], (int, float)) for k in ("old", "new")), v
    assert any(v["old"] != v["new"] for v in head.values()), head
    # the readable view: the headline metrics and the changed setting of both experiments, few columns
    view = run(repo, sys.executable, "-m", "flows.reports.exp", "--csv").stdout.splitlines()
    header = view[0].split(",")
    assert len(header) < 30 and {"Experiment", "adapt.passes", "headline.final_avg_holdout_acc"} <= set(header)
    rows = {r.split(",")[0]: dict(zip(header, r.split(","))) for r in view[1:]}
    assert [rows[f"passes{p}"]["adapt.passes"] for p in (1, 2)] == ["1", "2"]
    assert float(rows["passes2"]["headline.final_avg_holdout_acc"]) == summary_of(exps["passes2"])
    # plots diff: the arrival plots of the configured cell, one series per experiment
    data = plots.get("data", plots)
    for pid in ("online accuracy per arrival", "accuracy matrix", "weight drift"):
        assert data.get(pid), pid
        revs = {p["rev"] for item in data[pid] for p in item["content"]["data"]["values"]}
        assert revs == {"passes1", "passes2"}, (pid, revs)

    # Execute: the last experiment committed as `main`, then rebuilt from scratch on this machine
    commit(repo, "passes2 as main")
    dvc(repo, "repro", "--force", "--single-item", "adapt@mnist")  # runs it, not its inputs, and not from the run cache

    # Assert: the rebuild wrote the bytes dvc.lock records (no timing in any output), so the checkout stays clean
    # and `main` shows its metrics in `dvc exp show`
    assert run(repo, "git", "status", "--porcelain", "--untracked-files=no").stdout == ""
    branch = run(repo, "git", "branch", "--show-current").stdout.strip()
    rows = _experiments(json.loads(dvc(repo, "exp", "show", "--json").stdout))
    assert summary_of(rows[branch]) == summary_of(exps["passes2"]), rows.get(branch)
