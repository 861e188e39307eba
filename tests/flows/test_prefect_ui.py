"""What the Prefect UI shows of a run, and the checks a run makes before any service starts (fast: no services).

The flow runs themselves are read back from the Prefect API in tests/test_flows.py and
tests/test_rounds_flow.py (parameters, task run names, logs, the Ray rerun warning, the MLflow link).
"""

from __future__ import annotations

import json
import logging
import re
import time

import pytest
from omegaconf import OmegaConf

from fedcore.engine.checkpoint import CheckpointError
from flows.config import compose as C
from flows.runs.tasks import arrival_checkpoints, check_checkpoints, sweep_cells
from flows.services import runtime, ui
from tests.helpers import tiny_overrides, write_checkpoint


def test_check_checkpoints_refuses_corrupt_or_foreign_ones_and_names_the_fix(tmp_path):
    # Prepare: a missing, a good, and a corrupt checkpoint
    missing, good = tmp_path / "none", write_checkpoint(tmp_path / "good")
    bad = write_checkpoint(tmp_path / "bad", corrupt=True)

    # Execute / Assert: nothing to read and a matching one pass; a foreign one passes unless resuming
    check_checkpoints({missing: "fp-a", good: "fp-a"}, resume=True)
    check_checkpoints({good: "fp-b"}, resume=False)
    with pytest.raises(CheckpointError, match="written by another config.*Rerun without flow.resume=true"):
        check_checkpoints({good: "fp-b"}, resume=True)
    for resume in (False, True):  # the engine refuses a corrupt one either way, so this does too
        with pytest.raises(CheckpointError, match=f"sha256.*Delete {re.escape(str(bad))} .*does not skip it"):
            check_checkpoints({bad: "fp-a"}, resume=resume)


@pytest.mark.parametrize("flow", ["arrival", "sweep"])
def test_a_corrupt_checkpoint_fails_before_ray_or_prefect_start(tiny, tmp_path, monkeypatch, flow):
    # Prepare: the run's checkpoint corrupted, and Ray or Prefect starting fails the test
    from flows.runs import federation as F

    cfg = C.compose(
        tiny_overrides(tiny["tmp"])
        + [f"paths.checkpoints={tmp_path}", "flow.resume=true", "sweep.methods=[bn]", "sweep.aggregators=[ugsa]"]
    )
    folders = arrival_checkpoints(cfg, sweep_cells(cfg) if flow == "sweep" else None)
    bad = write_checkpoint(next(iter(folders)), corrupt=True)
    started = []
    monkeypatch.setattr(runtime, "start_ray", lambda **kw: started.append("ray") or pytest.fail("Ray started"))
    monkeypatch.setattr(runtime, "_prefect_api", lambda: started.append("prefect") or pytest.fail("Prefect started"))

    # Execute
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=re.escape(f"Found before starting Ray and Prefect. Delete {bad} ")):
        getattr(F, flow)(cfg)
    seconds = time.perf_counter() - t0

    # Assert: refused by the pre-flight check, before any service, in seconds rather than a minute and a half
    assert started == [] and seconds < 30, (started, seconds)


def test_a_flows_config_parameter_is_json_that_rebuilds_the_same_run():
    # Prepare
    cfg = C.compose(["variant=private", "method=tent", "privacy=dp", "sweep.seeds=[0,1]"])

    # Execute: what each flow receives, as the Prefect API stores it, and the config the flow builds from it
    def received(d):
        assert json.loads(json.dumps(d)) == d  # JSON values: what the API stores and the UI shows
        return OmegaConf.create(d)

    arrival = received(C.arrival_run(cfg))
    grids = {s: received(C.round_run(cfg, s, str(cfg[s].grid))) for s in C.round_systems()}
    single = received(C.round_run(cfg, "fedpad", "quick", single=True))

    # Assert: the same run, setting for setting (the typed configs' fingerprints cover every setting)
    assert C.arrival_config(arrival).fingerprint() == C.arrival_config(cfg).fingerprint()
    assert [c for c in sweep_cells(arrival)] == [c for c in sweep_cells(cfg)]
    for system, g in grids.items():
        name = str(cfg[system].grid)
        for method in cfg[system].grids[name].methods:
            ours = C.round_config(g, system, method=str(method), seed=1, grid_name=name)
            assert ours.fingerprint() == C.round_config(cfg, system, method=str(method), seed=1).fingerprint()
    assert C.single_round_config(single, "fedpad") == C.single_round_config(cfg, "fedpad")
    # ...and nothing a run does not read: no round-based system for an arrival run, no other grid for a grid
    assert not {*C.round_systems(), "trainer", "strategy"} & set(arrival)
    assert set(grids["fedpad"]["fedpad"]["grids"]) == {str(cfg.fedpad.grid)}
    assert not {"fedpd", "ppfcil", "trainer", "strategy", "data", "sweep"} & set(grids["fedpad"])
    assert {"trainer", "strategy"} <= set(single)


def test_logs_reach_the_api_at_info_unless_the_user_chose_a_level(monkeypatch):
    # Prepare: Prefect's logger left at WARNING, as PREFECT_LOGGING_LEVEL=WARNING at import used to leave it
    prefect_logger = logging.getLogger("prefect")
    before = prefect_logger.level
    monkeypatch.setenv("PREFECT_LOGGING_LEVEL", "")  # monkeypatch records the original first, so undo restores it
    monkeypatch.delenv("PREFECT_LOGGING_LEVEL")
    try:
        prefect_logger.setLevel(logging.WARNING)

        # Execute / Assert: unset, INFO (here and, through the environment, on Ray workers)
        runtime.log_runs_at_info()
        env = runtime.ray_init_kwargs(num_cpus=1, prefect_api_url="u", root=C.ROOT)["runtime_env"]["env_vars"]
        assert prefect_logger.level == logging.INFO and env["PREFECT_LOGGING_LEVEL"] == "INFO"

        # Execute / Assert: a level the user exported stands
        monkeypatch.setenv("PREFECT_LOGGING_LEVEL", "ERROR")
        prefect_logger.setLevel(logging.ERROR)
        runtime.log_runs_at_info()
        assert prefect_logger.level == logging.ERROR and runtime.os.environ["PREFECT_LOGGING_LEVEL"] == "ERROR"
    finally:
        prefect_logger.setLevel(before)


def test_the_terminal_shows_prefects_warnings_only():
    from flows.stages import _prefect_warnings_only

    def record(name, level):
        return logging.LogRecord(name, level, __file__, 1, "m", None, None)

    assert not _prefect_warnings_only(record("prefect.task_runs", logging.INFO))
    assert _prefect_warnings_only(record("prefect.task_runs", logging.WARNING))
    assert _prefect_warnings_only(record("flows.services.runtime", logging.INFO))


def test_run_links_point_at_each_ui(monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    monkeypatch.delenv("PREFECT_UI_URL", raising=False)
    assert ui.prefect_flow_run_url("abc") == "http://127.0.0.1:4200/runs/flow-run/abc"
    monkeypatch.setattr(runtime, "_SERVER", type("Temporary", (), {"api_url": "http://127.0.0.1:4200/api"})())
    assert ui.prefect_flow_run_url("abc") is None  # the temporary server serves no UI
    assert (
        ui.mlflow_run_url("http://127.0.0.1:5000/", "3", "r1")
        == "http://127.0.0.1:5000/#/experiments/3/runs/r1?workflowType=machine_learning"
    )
    assert ui.mlflow_run_url("sqlite:///mlruns.db", "3", "r1") is None
    assert ui._artifact_key("mlflow-fedcore-fedpd++-s0 dp-eps5") == "mlflow-fedcore-fedpd-s0-dp-eps5"
