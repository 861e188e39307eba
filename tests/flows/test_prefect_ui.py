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


def test_flow_parameters_are_the_experiments_settings_as_json():
    # Prepare
    cfg = C.compose(["variant=private", "method=tent", "privacy=dp", "sweep.seeds=[0,1]"])

    # Execute
    arrival, sweep, pretrain = ui.arrival_parameters(cfg), ui.sweep_parameters(cfg), ui.pretrain_parameters(cfg)
    rounds = {
        system: ui.round_parameters(cfg, system, str(cfg[system].grid), methods=["fedavg"], seeds=[0])
        for system in C.round_systems()
    }
    single = ui.round_parameters(cfg, "fedpad", "quick", rcfg=C.single_round_config(cfg, "fedpad"))

    # Assert: JSON values (what the API stores), the headline settings, and the resolved config flattened
    for params in (arrival, sweep, pretrain, single, *rounds.values()):
        assert json.loads(json.dumps(params)) == params
        assert all(isinstance(v, str) for v in params["config"].values())
    assert {k: arrival[k] for k in ("variant", "system", "method", "aggregator", "seed")} == {
        "variant": "private",
        "system": "dptta",
        "method": "tent",
        "aggregator": "ugsa",
        "seed": 0,
    }
    assert arrival["privacy"].startswith("dp") and arrival["model"] == "cnn-group"
    assert arrival["config"]["adapt.passes"] == str(cfg.adapt.passes)
    assert sweep["seeds"] == [0, 1] and sweep["privacy"] == [str(f) for f in cfg.sweep.privacy]
    assert not any(k.startswith(("fedpad.", "sweep.")) for k in arrival["config"])  # not this run's settings
    assert single["trainer"] == "sgd" and single["config"]["fedpad.grids.quick.set"] == single["data"]
    assert not any(k.startswith("fedpad.grids.digits.") for k in rounds["fedpad"]["config"])


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
