from pathlib import Path

import numpy as np
import pytest
import torch

from fedcore.engine import ArrivalConfig, CheckpointError, RunInterrupted, run_arrivals
from fedcore.evaluate import forgetting


def timeless(records):
    return [{k: v for k, v in r.items() if k != "adapt_seconds"} for r in records]


def cfg(**kw):
    base = dict(method="bpa", method_params={"lr": 0.01}, aggregator="ugsa", passes=2, batch_size=32, seed=0)
    if kw.get("method") in ("source", "bn"):  # they take no settings
        base["method_params"] = {}
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
    resumed = run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg(), checkpoint_dir=tmp_path, resume=True)
    assert timeless(resumed.records) == timeless(full.records)
    assert resumed.summary == full.summary
    assert np.array_equal(resumed.acc_matrix, full.acc_matrix, equal_nan=True)


def test_resume_with_another_config_is_refused(tiny, tmp_path):
    with pytest.raises(RunInterrupted):
        run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg(), checkpoint_dir=tmp_path, stop_after=1)
    with pytest.raises(CheckpointError, match="another config"):
        run_arrivals(
            tiny["partition"],
            tiny["spec"],
            tiny["source"],
            cfg(aggregator="fedavg"),
            checkpoint_dir=tmp_path,
            resume=True,
        )


def test_corrupt_checkpoint_is_reported_and_never_overwritten(tiny, tmp_path):
    with pytest.raises(RunInterrupted):
        run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg(), checkpoint_dir=tmp_path, stop_after=1)
    ckpt = tmp_path / "server_state.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    damaged = ckpt.read_bytes()
    for resume in (True, False):
        with pytest.raises(CheckpointError, match="corrupt"):
            run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg(), checkpoint_dir=tmp_path, resume=resume)
    assert ckpt.read_bytes() == damaged
    ckpt.with_suffix(".sha256").unlink()  # a checkpoint without its digest is named as such, not as corrupt
    with pytest.raises(CheckpointError, match=r"has no sha256 file \(server_state.sha256\), so it cannot be checked"):
        run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg(), checkpoint_dir=tmp_path, resume=True)
    assert ckpt.read_bytes() == damaged


@pytest.mark.parametrize("killed_after", [0, 1])
def test_a_save_killed_between_its_renames_leaves_a_checkpoint_that_reads_whole(tmp_path, monkeypatch, killed_after):
    """A kill can land after the new file is renamed into place and before its digest is: the next
    read (and the next save) must find the new checkpoint, not refuse it as corrupt. Killed before
    the first rename, the old checkpoint stays."""
    from fedcore.engine.checkpoint import load_state, save_state

    save_state(tmp_path, {"done": 1}, fingerprint="f")
    real, renames = Path.replace, []

    def replace(self, target):
        if len(renames) == killed_after:
            raise KeyboardInterrupt  # the process dies here
        renames.append(target)
        return real(self, target)

    monkeypatch.setattr(Path, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        save_state(tmp_path, {"done": 2}, fingerprint="f")
    monkeypatch.setattr(Path, "replace", real)
    assert load_state(tmp_path, fingerprint="f").payload == {"done": 1 + killed_after}
    save_state(tmp_path, {"done": 3}, fingerprint="f")
    assert load_state(tmp_path, fingerprint="f").payload == {"done": 3}


def test_a_reader_that_finishes_a_saves_rename_does_not_break_the_save(tmp_path, monkeypatch):
    """A resume check or a benchmark may read the folder while a run writes it: if the reader completes the
    digest's rename between the writer's two renames, the writer must still finish cleanly."""
    from fedcore.engine.checkpoint import load_state, save_state

    save_state(tmp_path, {"done": 1}, fingerprint="f")
    real, renames = Path.replace, []

    def replace(self, target):
        renames.append(target)
        out = real(self, target)
        if len(renames) == 1:  # the file is in place: a reader arrives now
            assert load_state(tmp_path, fingerprint="f").payload == {"done": 2}
        return out

    monkeypatch.setattr(Path, "replace", replace)
    save_state(tmp_path, {"done": 2}, fingerprint="f")
    monkeypatch.setattr(Path, "replace", real)
    assert load_state(tmp_path, fingerprint="f").payload == {"done": 2}


def test_forgetting_golden():
    acc = np.array([[0.9, np.nan, np.nan], [0.8, 0.7, np.nan], [0.6, 0.75, 0.5]])
    assert forgetting(acc, [0, 1, 2]) == pytest.approx(((0.9 - 0.6) + (0.7 - 0.75)) / 2)
    assert forgetting(acc[:1, :1], [0]) == 0.0


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(method="cotta"), "valid names are: bn, bpa, come, deyo, eata, sar, source, tent"),
        (dict(aggregator="fedprox"), "valid names are: fedavg, none, sequential, ugsa"),
        (dict(method_params={"lr": -1.0}), "lr must be > 0"),
        # a misspelt or foreign setting, or a wrong kind of value, fails when the config is built,
        # not on a worker when the method is (it used to pass here and fail in the first arrival)
        (
            dict(method_params={"lr": 0.01, "lrr": 0.1}),
            r"method 'bpa' has no setting 'lrr'; its settings are: adapt_params, lr, momentum, optimizer, precision_mode, "
            r"sigma0, steps",
        ),
        (dict(method="tent", method_params={"lr": 0.01, "sigma0": 2.0}), "method 'tent' has no setting 'sigma0'"),
        (dict(method="bn", method_params={"lr": 0.01}), "method 'bn' takes no settings"),
        (dict(method_params={"lr": "0.01"}), r"setting lr='0.01' is a str; it takes float"),
        (dict(method_params={"lr": 0.01, "steps": 1.5}), r"setting steps=1.5 is a float; it takes int"),
        (dict(method_params={"lr": 0.01, "steps": True}), r"setting steps=True is a bool; it takes int"),
        (dict(method_params={"lr": None}), r"setting lr=None is a NoneType; it takes float"),
        (dict(aggregator_params={"gamma": -0.5}), "gamma must be >= 0"),
        (dict(aggregator_params={"beta": -0.5}), "beta must be >= 0"),
        (dict(passes=0), "passes must be >= 1"),
    ],
)
def test_bad_arrival_config(kw, match):
    with pytest.raises(ValueError, match=match):
        cfg(**kw)


@pytest.mark.parametrize(
    "method,params",
    [
        ("come", {"lr": 0.01, "prior_weight": None}),  # float | None: null is a setting
        ("come", {"lr": 0.01, "prior_weight": 3}),  # an int where a float is taken
        ("eata", {"lr": 0.01, "fisher_size": 64, "d_margin": 0.4}),
        ("source", {}),
    ],
)
def test_method_settings_accepted(method, params):
    assert cfg(method=method, method_params=params).method_params == params


def test_every_configured_method_setting_is_accepted():
    """conf/method/*.yaml holds only settings the methods take, of the kinds they take; a setting it names as
    the library's default (``${default:method}``) has one."""
    import yaml

    from fedcore.adapt import check_method_settings, method_settings

    files = sorted((Path(__file__).resolve().parents[2] / "conf" / "method").glob("*.yaml"))
    assert len(files) == 8
    for f in files:
        m = yaml.safe_load(f.read_text())
        own = method_settings(m["name"])
        named = {k for k, v in m["params"].items() if str(v).startswith("${default:")}
        assert all(own[k].default is not own[k].empty for k in named), (f.name, named)
        check_method_settings(m["name"], {k: own[k].default if k in named else v for k, v in m["params"].items()})
        assert set(m["params"]) <= set(own)


def test_order_naming_missing_client(tiny):
    with pytest.raises(ValueError, match="only 0..3 exist"):
        run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg(order=[0, 9]))


def test_source_model_learned_something(tiny):
    from fedcore.evaluate import accuracy

    model = tiny["spec"].build()
    model.load_state_dict(tiny["source"])
    assert accuracy(model, tiny["partition"].source_test_x, tiny["partition"].source_test_y) > 0.5


def test_sequential_chains_clients_and_none_restarts_them(tiny):
    # Arrange
    seen = []

    def keep(record, st, res):
        seen.append(res.state)

    # Act
    seq = run_arrivals(
        tiny["partition"],
        tiny["spec"],
        tiny["source"],
        cfg(method="tent", aggregator="sequential", passes=1),
        on_arrival=keep,
    )

    # Assert: the global model after each arrival is that client's adapted model
    assert all(r["weight"] == 1.0 for r in seq.records)
    assert all(torch.equal(seq.final_state[k], seen[-1][k]) for k in seen[-1])
    assert seq.records[-1]["drift_step"] > 0


def test_client_uncertainty_and_holdouts_use_the_stream_batch_statistics(tiny):
    """σ_k and the hold-out accuracy score the model as the client predicts with it: BatchNorm with
    the statistics of batches of the stream's size (not eval mode, not one batch of 512)."""
    from fedcore.adapt import softmax_entropy
    from fedcore.engine import adapt_client, evaluate_global
    from fedcore.evaluate import accuracy, batch_statistics
    from fedcore.tensors import to_tensor

    part, spec = tiny["partition"], tiny["spec"]
    client = part.targets[1]
    c = cfg(method="bn", aggregator="none", passes=1, batch_size=16, stream="as_partitioned")

    # Act
    res = adapt_client(global_state=tiny["source"], spec=spec, client=client, cfg=c, seed=0)
    ev = evaluate_global(state=tiny["source"], spec=spec, partition=part, clients=[1], batch_stats=True, batch_size=16)

    # Assert
    model = spec.build()
    model.load_state_dict(res.state)
    x = to_tensor(client.stream_x)
    with torch.no_grad(), batch_statistics(model):
        expected = float(torch.cat([softmax_entropy(model(x[i : i + 16])) for i in range(0, len(x), 16)]).mean())
    with torch.no_grad():
        eval_mode = float(softmax_entropy(model.eval()(x)).mean())
    assert res.sigma == pytest.approx(expected, abs=1e-5)
    assert abs(expected - eval_mode) > 1e-3, "the fixture must separate the two normalisations"
    source = spec.build()
    source.load_state_dict(tiny["source"])
    at_16 = accuracy(source, client.holdout_x, client.holdout_y, batch_stats=True, batch_size=16)
    at_512 = accuracy(source, client.holdout_x, client.holdout_y, batch_stats=True, batch_size=512)
    assert ev["holdout"][1] == at_16
    assert at_16 != at_512, "the fixture must separate the two batch sizes"


def test_the_arrival_loop_scores_holdouts_at_the_stream_batch_size(tiny):
    """The loop passes the stream's batch size on to the hold-out scoring (the step alone is tested above)."""
    from fedcore.evaluate import accuracy

    part, spec = tiny["partition"], tiny["spec"]
    source = spec.build()
    source.load_state_dict(tiny["source"])

    # Act: BN under `none` keeps θ_G⁽⁰⁾, so every hold-out is the source model's, scored with batch statistics
    res = run_arrivals(
        part,
        spec,
        tiny["source"],
        cfg(method="bn", aggregator="none", passes=1, batch_size=16, stream="as_partitioned"),
    )

    # Assert
    for rec in res.records:
        holdout = part.targets[rec["client_id"]]
        assert rec["holdout_acc_client"] == accuracy(
            source, holdout.holdout_x, holdout.holdout_y, batch_stats=True, batch_size=16
        )
    assert any(
        accuracy(source, t.holdout_x, t.holdout_y, batch_stats=True, batch_size=16)
        != accuracy(source, t.holdout_x, t.holdout_y, batch_stats=True, batch_size=64)
        for t in part.targets
    ), "the fixture must separate the stream's batch size from the default"


def test_stream_order_is_drawn_per_seed_and_arrival(tiny):
    from fedcore.engine.arrivals import stream_order

    y = tiny["partition"].targets[0].stream_y
    shuffled = [stream_order(y, cfg(seed=s), a) for s in (0, 1) for a in (0, 1)]
    assert all(sorted(o) == list(range(len(y))) for o in shuffled)
    assert len({tuple(o) for o in shuffled}) == 4, "each seed and each visit streams in its own order"
    assert np.array_equal(stream_order(y, cfg(seed=1), 0), shuffled[2]), "the same seed and arrival, the same order"
    runs = np.flatnonzero(np.diff(y[stream_order(y, cfg(stream="class_sorted"), 0)]) != 0)
    assert len(runs) == len(np.unique(y)) - 1, "a class-sorted stream holds each class in one run"
    assert np.array_equal(stream_order(y, cfg(stream="as_partitioned"), 3), np.arange(len(y)))
    with pytest.raises(ValueError, match="valid names are: shuffled, class_sorted, as_partitioned"):
        cfg(stream="sorted")


def test_seeds_change_a_deterministic_method_through_its_stream(tiny):
    a = run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg(method="tent", passes=1, seed=0))
    b = run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg(method="tent", passes=1, seed=1))
    assert a.summary["avg_online_acc"] != b.summary["avg_online_acc"]


def test_batch_statistics_scoring_mixes_a_class_sorted_set_and_keeps_its_order():
    """A hold-out stored sorted by class is scored in mixed batches, and predictions come back in order."""
    from torch import nn

    from fedcore.evaluate import predict

    class Spy(nn.Module):  # predicts the parity of the image's first pixel; records each batch
        def __init__(self):
            super().__init__()
            self.bn, self.seen = nn.BatchNorm2d(1), []

        def forward(self, x):
            self.bn(x)
            self.seen.append(x[:, 0, 0, 0].clone())
            odd = ((x[:, 0, 0, 0] + 1) * 127.5).round().long() % 2
            return nn.functional.one_hot(odd, 2).float()

    x = np.arange(40, dtype=np.uint8).reshape(40, 1, 1, 1)  # NHWC, "sorted": the first batch is 0..15
    spy = Spy()

    # Act
    pred = predict(spy, x, batch_size=16, batch_stats=True)

    # Assert
    np.testing.assert_array_equal(pred, np.arange(40) % 2)
    first = ((spy.seen[0] + 1) * 127.5).round().long().tolist()
    assert sorted(first) != list(range(16)), "batches are drawn in a mixed order"
    assert sorted(((torch.cat(spy.seen) + 1) * 127.5).round().long().tolist()) == list(range(40))
