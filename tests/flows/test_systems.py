"""Each system is declared once, and the platform reads the declarations: the command line, the nightly
deployments, the round flow's inputs and reports, the config checks. A plug-in adds a system and a strategy
without an edit to any of the platform's files."""

from __future__ import annotations

import re

import pytest
import yaml

from flows import systems
from flows.config import compose as C
from flows.runs import deploy
from flows.stages import stage_steps

BUILT_IN = {"bpfedctta": "arrivals", "dptta": "arrivals", "fedpad": "rounds", "fedpd": "rounds", "ppfcil": "rounds"}


def dvc_stage_names() -> set:
    """Every stage name dvc.yaml defines, ``foreach`` stages expanded as DVC does (``name@key``)."""
    stages = yaml.safe_load((C.ROOT / "dvc.yaml").read_text())["stages"]
    params = yaml.safe_load(C.PARAMS.read_text())
    out = set()
    for name, stage in stages.items():
        over = stage.get("foreach")
        if over is None:
            out.add(name)
            continue
        if isinstance(over, str):
            keys = _select(params, re.fullmatch(r"\$\{([\w.]+)\}", over).group(1))
        else:
            keys = over
        out.update(f"{name}@{k}" for k in keys)
    return out


def _select(tree, path: str):
    for part in path.split("."):
        tree = tree[part]
    return tree


def test_the_five_systems_are_declared_with_their_engines():
    assert {s.name: s.engine for s in systems.all_systems()} == BUILT_IN


def test_every_stage_a_nightly_run_pushes_is_a_dvc_stage():
    # Prepare
    known = dvc_stage_names()

    # Execute
    pushed = {s.name: s.nightly_stages() for s in systems.all_systems()}

    # Assert: PP-FCIL's included (its partition stage was once missing from the nightly job)
    assert pushed["ppfcil"] == ["partition_ppfcil@quick", "ppfcil@quick"]
    missing = {n: [st for st in stages if st not in known] for n, stages in pushed.items()}
    assert not any(missing.values()), missing


def test_infra_prefect_yaml_is_written_from_the_declarations():
    # Execute
    doc = yaml.safe_load(deploy.PREFECT_FILE.read_text())

    # Assert: one nightly deployment per system, each with its quick default, schedule and push
    assert deploy.main(["--check"]) == 0, "rewrite infra/prefect.yaml with `python -m flows.runs.deploy`"
    by_name = {d["name"]: d for d in doc["deployments"]}
    assert sorted(by_name) == sorted(f"nightly-{n}" for n in BUILT_IN)
    for name, engine in BUILT_IN.items():
        d = by_name[f"nightly-{name}"]
        assert d["parameters"]["system"] == name and d["parameters"]["push"] is True
        assert d["entrypoint"].endswith("nightly" if engine == "arrivals" else "nightly_rounds")
        assert d["schedules"][0]["cron"] == systems.get(name).cron
    assert len({d["schedules"][0]["cron"] for d in doc["deployments"]}) == len(BUILT_IN), "nightly runs overlap"


def test_the_command_line_offers_every_declared_step():
    steps = stage_steps()
    for s in systems.all_systems():
        if s.engine == "rounds":
            assert {s.partition_stage, s.name, f"rounds_{s.name}"} <= set(steps)
        assert set(s.extra_steps) <= set(steps)
    assert {"prepare", "partition", "pretrain", "adapt", "audit", "rounds"} <= set(steps)


def test_an_unknown_system_lists_the_valid_names():
    with pytest.raises(ValueError, match="unknown system 'fedpadd'; valid names are: bpfedctta, dptta, fedpad"):
        systems.get("fedpadd")


def test_a_second_system_under_a_taken_name_is_refused():
    fedpad = systems.get("fedpad")
    clash = systems.System(**{**fedpad.__dict__, "title": "Another"})
    with pytest.raises(ValueError, match="already registered"):
        systems.register(clash)


def test_a_declaration_without_what_its_engine_needs_is_refused():
    with pytest.raises(ValueError, match="names no partition_stage"):
        systems.System(
            name="x",
            title="X",
            paper="",
            page="",
            engine="rounds",
            evaluation="domains",
            headline="final_avg_acc",
            quick="q",
            cron="0 1 * * *",
            description="",
        )
    with pytest.raises(ValueError, match="unknown engine 'round'"):
        systems.System(
            name="x",
            title="X",
            paper="",
            page="",
            engine="round",
            evaluation="domains",  # type: ignore
            headline="final_avg_acc",
            quick="q",
            cron="0 1 * * *",
            description="",
            partition_stage="p",
        )


def test_a_plugin_that_cannot_be_imported_is_named_with_the_fix():
    with pytest.raises(ValueError, match=r"plugins: cannot import 'mypkg.nothere'.*plugins=\[mypackage.mysystem\]"):
        C.compose(["plugins=[mypkg.nothere]"])


def test_a_plugin_adds_a_system_and_a_strategy_without_editing_the_platform(plugin_sandbox):
    # Execute
    cfg = C.compose([f"plugins=[{plugin_sandbox}]"])

    # Assert: its config block is composed and checked, its steps and nightly deployment exist, its
    # strategy builds by name
    from fedcore.aggregate import create_strategy

    assert systems.get("toy").evaluation == "mean-domain" and "toy" in C.round_systems()
    assert C.round_config(cfg, "toy", method="fedmedian", seed=0).strategy == "fedmedian"
    assert type(create_strategy("fedmedian")).__name__ == "FedMedian"
    assert {"partition_toy", "toy", "rounds_toy"} <= set(stage_steps())
    assert "nightly-toy" in deploy.render()
    with pytest.raises(ValueError, match="unknown toy method 'fedmedain'; valid names are: fedavg, fedmedian"):
        C.compose([f"plugins=[{plugin_sandbox}]", "toy.grids.tiny.methods=[fedmedain]"])


def test_after_a_plugin_test_the_registries_hold_the_built_in_systems_only():
    assert systems.names() == sorted(BUILT_IN)
