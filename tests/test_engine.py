import numpy as np
import pytest

from fedcore.engine import ArrivalConfig, CheckpointError, RunInterrupted, run_arrivals
from fedcore.evaluate import forgetting


def timeless(records):
    return [{k: v for k, v in r.items() if k != "adapt_seconds"} for r in records]


def cfg(**kw):
    base = dict(method="bpa", method_params={"lr": 0.01}, aggregator="ugsa", passes=2, batch_size=32, seed=0)
    base.update(kw)
    return ArrivalConfig(**base)


def test_same_config_and_seed_give_identical_metrics(tiny):
    a = run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg())
    b = run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg())
    assert timeless(a.records) == timeless(b.records)
    assert np.array_equal(a.acc_matrix, b.acc_matrix, equal_nan=True)


def test_accuracy_matrix_and_records(tiny):
    K = len(tiny["partition"].targets)
    res = run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg(passes=1))
    assert res.acc_matrix.shape == (K, K)
    assert np.isnan(res.acc_matrix[0, 1:]).all() and not np.isnan(res.acc_matrix[-1]).any()
    assert [r["client_id"] for r in res.records] == list(range(K))
    assert res.records[0]["weight"] == pytest.approx(0.5 * 0 + 1.0), "first UGSA weight is 1 (history normaliser)"
    for r in res.records:
        assert 0 <= r["online_acc"] <= 1 and r["sigma"] >= 0 and r["drift_total"] >= 0


def test_none_keeps_the_source_model(tiny):
    res = run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg(aggregator="none", passes=1))
    assert all(r["drift_total"] == 0 for r in res.records)


def test_resume_after_interruption_equals_uninterrupted(tiny, tmp_path):
    full = run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg())
    with pytest.raises(RunInterrupted):
        run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg(), checkpoint_dir=tmp_path, stop_after=3)
    resumed = run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg(), checkpoint_dir=tmp_path,
                           resume=True)
    assert timeless(resumed.records) == timeless(full.records)
    assert resumed.summary == full.summary
    assert np.array_equal(resumed.acc_matrix, full.acc_matrix, equal_nan=True)


def test_resume_with_another_config_is_refused(tiny, tmp_path):
    with pytest.raises(RunInterrupted):
        run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg(), checkpoint_dir=tmp_path, stop_after=1)
    with pytest.raises(CheckpointError, match="another config"):
        run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg(aggregator="fedavg"),
                     checkpoint_dir=tmp_path, resume=True)


def test_corrupt_checkpoint_is_reported_and_never_overwritten(tiny, tmp_path):
    with pytest.raises(RunInterrupted):
        run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg(), checkpoint_dir=tmp_path, stop_after=1)
    ckpt = tmp_path / "server_state.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    damaged = ckpt.read_bytes()
    for resume in (True, False):
        with pytest.raises(CheckpointError, match="corrupt"):
            run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg(), checkpoint_dir=tmp_path,
                         resume=resume)
    assert ckpt.read_bytes() == damaged


def test_forgetting_golden():
    acc = np.array([[0.9, np.nan, np.nan], [0.8, 0.7, np.nan], [0.6, 0.75, 0.5]])
    assert forgetting(acc, [0, 1, 2]) == pytest.approx(((0.9 - 0.6) + (0.7 - 0.75)) / 2)
    assert forgetting(acc[:1, :1], [0]) == 0.0


@pytest.mark.parametrize("kw,match", [
    (dict(method="cotta"), "valid names are: bn, bpa, come, deyo, eata, sar, source, tent"),
    (dict(aggregator="fedprox"), "valid names are: fedavg, none, ugsa"),
    (dict(method_params={"lr": -1.0}), "lr must be > 0"),
    (dict(aggregator_params={"gamma": -0.5}), "gamma must be >= 0"),
    (dict(aggregator_params={"beta": -0.5}), "beta must be >= 0"),
    (dict(passes=0), "passes must be >= 1"),
])
def test_bad_arrival_config(kw, match):
    with pytest.raises(ValueError, match=match):
        cfg(**kw)


def test_order_naming_missing_client(tiny):
    with pytest.raises(ValueError, match="only 0..3 exist"):
        run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg(order=[0, 9]))


def test_source_model_learned_something(tiny):
    from fedcore.evaluate import accuracy

    model = tiny["spec"].build()
    model.load_state_dict(tiny["source"])
    assert accuracy(model, tiny["partition"].source_test_x, tiny["partition"].source_test_y) > 0.5
