"""The round engine: source pretraining equals the old FedAvg loop, resume, participation, bad input."""

from __future__ import annotations

import math
import shutil
from typing import Dict, List

import numpy as np
import pytest
import torch
from torch import nn

from fedcore.aggregate import weighted_average
from fedcore.engine import (
    CheckpointError,
    ModelSpec,
    RoundConfig,
    RoundData,
    RunInterrupted,
    init_state,
    run_rounds,
    save_state,
)
from fedcore.tensors import batches, state_to_cpu, to_tensor

SPEC = ModelSpec(name="cnn", in_channels=1, num_classes=10)


def strip(records):
    """Records without wall-clock fields, with NaN made comparable (NaN != NaN)."""
    return [
        {k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items() if k != "agg_seconds"}
        for r in records
    ]


@pytest.fixture(scope="module")
def fed():
    """Four labelled clients from scikit-learn's digits (torch and fedcore only)."""
    from fedcore.data.sources import load_digits16

    d = load_digits16()
    rng = np.random.default_rng(0)
    idx = rng.permutation(len(d.y))
    test, train = idx[:300], idx[300:900]
    parts = np.array_split(train, 4)
    return RoundData(
        client_x=[d.x[p] for p in parts],
        client_y=[d.y[p] for p in parts],
        client_group=["a", "a", "b", "c"],
        eval_sets={"test": (d.x[test], d.y[test])},
    )


def _reference_fedavg(data: RoundData, spec: ModelSpec, *, rounds, epochs, lr, batch_size, seed):
    """The FedAvg loop as it stood before the round engine (engine.run_pretrain + train.sgd.train_client)."""
    state = init_state(spec, seed)
    for r in range(rounds):
        results = []
        for i, (x, y) in enumerate(zip(data.client_x, data.client_y)):
            s = seed * 100_003 + r * 1009 + i
            torch.manual_seed(s)
            model = spec.build()
            model.load_state_dict(state)
            g = torch.Generator().manual_seed(s)
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
            xt, yt = to_tensor(x), torch.as_tensor(np.array(y))
            for _ in range(epochs):
                perm = torch.randperm(len(xt), generator=g)
                for sl in batches(len(xt), batch_size):
                    ix = perm[sl]
                    loss = nn.functional.cross_entropy(model(xt[ix]), yt[ix])
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
            results.append((state_to_cpu(model.state_dict()), len(xt)))
        state = weighted_average(results)
    return state


def sgd_cfg(**kw):
    base = dict(
        rounds=3,
        trainer="sgd",
        trainer_params={"lr": 0.05, "local_epochs": 2, "batch_size": 32},
        strategy="fedavg",
        seed=3,
    )
    base.update(kw)
    return RoundConfig(**base)


def test_pretraining_on_the_round_engine_is_bit_identical_to_the_old_fedavg_loop(fed):
    new = run_rounds(fed, SPEC, sgd_cfg()).final_state
    old = _reference_fedavg(fed, SPEC, rounds=3, epochs=2, lr=0.05, batch_size=32, seed=3)
    assert new.keys() == old.keys()
    for k in old:
        assert torch.equal(new[k], old[k]), k


def test_fedavg_learns_and_records_every_round(fed):
    res = run_rounds(fed, SPEC, sgd_cfg(rounds=4))
    assert [r["round"] for r in res.records] == [0, 1, 2, 3]
    assert res.records[-1]["acc.test"] > 0.5, "FedAvg on digits should be far above chance after 4 rounds"
    assert res.records[-1]["train_loss"] < res.records[0]["train_loss"]
    r0 = res.records[0]
    assert r0["clients"] == [0, 1, 2, 3] and r0["bytes_up"] == r0["bytes_down"] > 0
    assert res.summary["final_avg_acc"] == res.records[-1]["avg_acc"]


def test_same_config_and_seed_give_identical_metrics(fed):
    cfg = sgd_cfg(rounds=2, trainer="prox", trainer_params={"lr": 0.05, "mu": 0.1})
    a, b = run_rounds(fed, SPEC, cfg), run_rounds(fed, SPEC, cfg)
    assert strip(a.records) == strip(b.records)


@pytest.mark.parametrize(
    "trainer,strategy,tp,sp",
    [
        ("scaffold", "scaffold", {}, {}),
        ("feddyn", "feddyn", {"alpha": 0.1}, {"alpha": 0.1}),
        ("proto", "fedpad", {"lam": 0.1}, {"gamma": 0.5}),
        ("sgd", "fedadam", {}, {"lr": 0.01}),
    ],
)
def test_resume_after_a_kill_equals_an_uninterrupted_run(fed, tmp_path, trainer, strategy, tp, sp):
    """Server state, per-client state (c_i, gradient memory) and prototypes all survive the checkpoint."""
    cfg = sgd_cfg(
        rounds=3,
        trainer=trainer,
        trainer_params={"lr": 0.05, **tp},
        strategy=strategy,
        strategy_params=sp,
        participation=0.75,
    )
    full = run_rounds(fed, SPEC, cfg)
    with pytest.raises(RunInterrupted):
        run_rounds(fed, SPEC, cfg, checkpoint_dir=tmp_path, stop_after=1)
    resumed = run_rounds(fed, SPEC, cfg, checkpoint_dir=tmp_path, resume=True)
    assert strip(resumed.records) == strip(full.records)
    for k in full.final_state:
        assert torch.equal(resumed.final_state[k], full.final_state[k]), k


def test_resume_with_another_config_is_refused_and_a_corrupt_checkpoint_is_kept(fed, tmp_path):
    with pytest.raises(RunInterrupted):
        run_rounds(fed, SPEC, sgd_cfg(), checkpoint_dir=tmp_path, stop_after=1)
    with pytest.raises(CheckpointError, match="another config"):
        run_rounds(fed, SPEC, sgd_cfg(seed=4), checkpoint_dir=tmp_path, resume=True)
    path = tmp_path / "server_state.pt"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="sha256"):
        run_rounds(fed, SPEC, sgd_cfg(), checkpoint_dir=tmp_path, resume=True)
    assert path.read_bytes() == bytes(raw), "a corrupt checkpoint is never overwritten"


def test_participation_is_seeded_and_reproducible():
    cfg = sgd_cfg(participation=0.2, rounds=5)
    picks = [cfg.select(r, 10) for r in range(5)]
    assert all(len(p) == 2 for p in picks)
    assert picks == [cfg.select(r, 10) for r in range(5)]
    assert len({tuple(p) for p in picks}) > 1, "different rounds select different clients"
    assert sgd_cfg(participation=0.5).select(0, 10) != sgd_cfg(participation=0.5, seed=9).select(0, 10)
    assert sgd_cfg().select(0, 10) == list(range(10))


class _Diverging:
    """A submit that turns client 1's update into NaNs: a diverged client."""

    def __call__(self, fn, **kw):
        from fedcore.engine import Done

        upd = fn(**kw)
        if kw["client_id"] == 1:
            upd.state = {k: v.float() * math.nan if v.is_floating_point() else v for k, v in upd.state.items()}
        return Done(upd)


def test_a_client_that_sends_nan_is_not_merged_and_named(fed):
    with pytest.warns(RuntimeWarning, match="client 1"):
        res = run_rounds(fed, SPEC, sgd_cfg(rounds=1), submit=_Diverging())
    assert res.records[0]["refused"] == [1] and res.records[0]["clients"] == [0, 2, 3]
    assert all(torch.isfinite(v).all() for v in res.final_state.values() if v.is_floating_point())


def test_the_server_is_told_of_each_update_it_will_not_merge_before_it_aggregates(fed, monkeypatch):
    from fedcore.aggregate.strategies import FedAvg

    calls = []
    monkeypatch.setattr(
        FedAvg,
        "discarded",
        lambda self, ups: calls.append(("discarded", [i for i, _ in ups])) or {i: {"spent": 1.0} for i, _ in ups},
    )
    real = FedAvg.fold

    def fold(self, g, **kw):  # the round's aggregation: updates folded in, then finished
        f, added = real(self, g, **kw), []
        add, finish = f.add, f.finish
        f.add = lambda i, u: added.append(i) or add(i, u)
        f.finish = lambda: calls.append(("aggregate", added)) or finish()
        return f

    monkeypatch.setattr(FedAvg, "fold", fold)
    with pytest.warns(RuntimeWarning, match="client 1"):
        res = run_rounds(fed, SPEC, sgd_cfg(rounds=2), submit=_Diverging())
    # what a NaN upload implies (a privacy budget spent) must reach the server, which never sees its weights
    assert calls == [("discarded", [1]), ("aggregate", [0, 2, 3])] * 2
    assert all(r["spent.c1"] == 1.0 and "spent.c0" not in r for r in res.records)  # and what it says is recorded


class _AllDiverge:
    def __call__(self, fn, **kw):
        from fedcore.engine import Done

        upd = fn(**kw)
        upd.state = {k: v.float() * math.nan if v.is_floating_point() else v for k, v in upd.state.items()}
        return Done(upd)


def test_a_round_whose_every_update_is_dropped_keeps_the_model_and_records_what_the_server_says(fed, monkeypatch):
    from fedcore.aggregate.strategies import FedAvg

    monkeypatch.setattr(FedAvg, "discarded", lambda self, ups: {i: {"spent": 1.0} for i, _ in ups})
    init = init_state(SPEC, seed=0)
    with pytest.warns(RuntimeWarning):
        res = run_rounds(fed, SPEC, sgd_cfg(rounds=1), init=init, submit=_AllDiverge())
    rec = res.records[0]
    assert rec["refused"] == [0, 1, 2, 3] and all(rec[f"spent.c{i}"] == 1.0 for i in range(4))
    assert all(torch.equal(res.final_state[k], init[k]) for k in init)


class _SpendsAndDiverges:
    """Client 1 spends one unit of its privacy account every round and sends NaNs; records what it is given."""

    def __init__(self):
        self.given: List[Dict] = []

    def __call__(self, fn, **kw):
        from fedcore.engine import Done

        upd = fn(**kw)
        if kw["client_id"] == 1:
            self.given.append(dict(kw["client_state"] or {}))
            spent = (kw["client_state"] or {}).get("ledger", {}).get("spent", 0)
            upd.client_state = {"ledger": {"spent": spent + 1}, "memory": kw["round_index"]}
            upd.state = {k: v.float() * math.nan if v.is_floating_point() else v for k, v in upd.state.items()}
        return Done(upd)


def test_a_client_whose_update_is_not_merged_keeps_its_privacy_account_and_nothing_else(fed):
    submit = _SpendsAndDiverges()
    with pytest.warns(RuntimeWarning, match="client 1"):
        run_rounds(fed, SPEC, sgd_cfg(rounds=3), submit=submit)
    # what it released was spent whether or not the server merged it; the rest of its state is not taken
    assert submit.given == [{}, {"ledger": {"spent": 1}}, {"ledger": {"spent": 2}}]


@pytest.mark.parametrize(
    "kw,match",
    [
        (
            dict(trainer="sdg"),
            "unknown trainer 'sdg'; valid names are: fcil, feddyn, proser, proto, prox, scaffold, sgd",
        ),
        (dict(strategy="fedprox2"), "unknown strategy 'fedprox2'; valid names are:.*fedavg"),
        (dict(trainer="prox", trainer_params={"mu": 0.1, "lrr": 0.1}), "no setting 'lrr'; valid settings are:.*lr"),
        (dict(strategy="fedpad", trainer="proto", strategy_params={"gama": 1.0}), "no setting 'gama'.*gamma"),
        (dict(participation=0.0), r"participation must be in \(0, 1\]"),
        (dict(participation=1.5), r"participation must be in \(0, 1\]"),
        (dict(strategy="scaffold"), "written for the trainer"),
        (dict(trainer="feddyn", strategy="feddyn", trainer_params={"alpha": 0.1}), "disagree on alpha"),
    ],
)
def test_bad_settings_are_refused_with_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        sgd_cfg(**kw)


def test_a_misspelt_ugsa_setting_is_an_error_not_the_defaults():
    from fedcore.aggregate import create_aggregator

    with pytest.raises(ValueError, match="no setting 'betta'.*beta, gamma, normalizer"):
        create_aggregator("ugsa", betta=5.0)
    assert create_aggregator("ugsa", beta=5.0).beta == 5.0


def test_prototype_methods_refuse_a_model_without_a_feature_layer(fed, monkeypatch):
    from fedcore.models import MODELS

    class Plain(nn.Module):
        def __init__(self, **_):
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(256, 10))

        def forward(self, x):
            return self.body(x)

    monkeypatch.setitem(MODELS._items, "plain", Plain)
    cfg = sgd_cfg(trainer="proto", strategy="fedpad")
    with pytest.raises(ValueError, match="exposes no feature layer.*use one of the models"):
        run_rounds(fed, ModelSpec(name="plain", in_channels=1, num_classes=10), cfg)


def _many(k: int) -> RoundData:
    """``k`` clients of 20 digits each (scikit-learn's 1,797, drawn with replacement past that)."""
    from fedcore.data.sources import load_digits16

    d = load_digits16()
    idx = np.random.default_rng(1).integers(0, len(d.y), size=(k, 20))
    return RoundData(
        client_x=[d.x[i] for i in idx],
        client_y=[d.y[i] for i in idx],
        client_group=["a"] * k,
        eval_sets={"test": (d.x[:100], d.y[:100])},
    )


def scaffold_cfg(*, rounds: int, participation: float) -> RoundConfig:
    """SCAFFOLD: a control variate per client, the state a rounds checkpoint keeps for each."""
    return sgd_cfg(
        rounds=rounds, trainer="scaffold", trainer_params={"lr": 0.05}, strategy="scaffold", participation=participation
    )


@pytest.mark.parametrize("order", [[1, 0, 2, 3], [0, 1, 1, 2, 3], [0, 1, 2]])
def test_a_submit_round_that_hands_updates_over_out_of_order_twice_or_not_at_all_is_refused(fed, order):
    """The round's aggregate is folded in call order; a driver that breaks that must fail, not average wrongly."""

    def submit_round(fn, calls, take):
        done = {j: fn(**calls[j]) for j in range(len(calls))}
        for j in order:
            take(j, done[j])

    with pytest.raises(RuntimeError, match="handed over"):
        run_rounds(fed, SPEC, sgd_cfg(rounds=1), submit_round=submit_round)


def test_with_a_checkpoint_no_clients_state_stays_in_memory_between_its_rounds(tmp_path, monkeypatch):
    """SCAFFOLD keeps a model-sized variate per client: at K = 10,000 the driver must not hold one for every
    client it has seen. With a checkpoint folder each is read back from its file when the client is next
    selected, and the run is the in-memory run exactly."""
    import fedcore.engine.rounds as engine

    stores = []
    real_init = engine._ClientStates.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        stores.append(self)

    monkeypatch.setattr(engine._ClientStates, "__init__", init)
    data, cfg = _many(12), scaffold_cfg(rounds=5, participation=0.25)
    held = []
    on_disk = run_rounds(
        data, SPEC, cfg, checkpoint_dir=tmp_path, on_round=lambda r, s: held.append(len(stores[-1].memory))
    )
    in_memory = run_rounds(data, SPEC, cfg, on_round=lambda r, s: held.append(len(stores[-1].memory)))
    assert held[:5] == [0] * 5 and held[5:] == sorted(held[5:]) and held[-1] > 3  # seen clients accumulate
    assert all(torch.equal(on_disk.final_state[k], in_memory.final_state[k]) for k in in_memory.final_state)
    assert strip(on_disk.records) == strip(in_memory.records)


def test_a_round_checkpoints_the_state_of_the_clients_it_trained_not_of_every_client_known(tmp_path):
    # Prepare: SCAFFOLD (a control variate per client) with 2 of 40 clients a round
    data = _many(40)
    cfg = scaffold_cfg(rounds=6, participation=0.05)
    written, seen = [], set()
    clients = tmp_path / "clients"

    def on_round(rec, state):
        files = sorted(clients.glob("*.pt"))
        written.append({f.name for f in files if f.stat().st_mtime_ns >= on_round.since})
        on_round.since = max(f.stat().st_mtime_ns for f in files) + 1
        seen.update(int(c) for c in rec["clients"])
        # one file per client seen, and the server's own file does not hold them
        assert len(files) == len(seen)
        assert (tmp_path / "server_state.pt").stat().st_size < files[0].stat().st_size * 3

    on_round.since = 0

    # Execute
    full = run_rounds(data, SPEC, cfg, checkpoint_dir=tmp_path, on_round=on_round)

    # Assert: each round wrote the files of its own two clients, and nothing else
    assert [len(w) for w in written] == [2] * 6
    assert all(f"-r{r:05d}-" in name for r, w in enumerate(written) for name in w)
    from fedcore.engine import load_client_states

    assert sorted(load_client_states(tmp_path)) == sorted(seen)
    # a resume from round 3 gives the uninterrupted run, and clears the files of the rounds it redoes
    with pytest.raises(RunInterrupted):
        run_rounds(data, SPEC, cfg, checkpoint_dir=tmp_path / "b", stop_after=3)
    resumed = run_rounds(data, SPEC, cfg, checkpoint_dir=tmp_path / "b", resume=True)
    assert strip(resumed.records) == strip(full.records)
    assert all(torch.equal(resumed.final_state[k], full.final_state[k]) for k in full.final_state)

    def kept(folder):  # (client, round) of each file: the run's own token differs
        return sorted(f.name.rsplit("-", 1)[0] for f in folder.glob("*.pt"))

    assert kept(tmp_path / "b" / "clients") == kept(clients)


def test_a_crash_between_the_client_files_and_the_server_state_resumes_from_the_last_round(tmp_path):
    from fedcore.engine import load_client_states

    data = _many(12)
    cfg = scaffold_cfg(rounds=4, participation=0.25)
    full = run_rounds(data, SPEC, cfg)
    with pytest.raises(RunInterrupted):
        run_rounds(data, SPEC, cfg, checkpoint_dir=tmp_path, stop_after=2)
    # round 2's client files landed, its server state did not: files no checkpoint names, one of them with a
    # sha256 that no longer matches (a crash between the file's rename and its sha256)
    clients = tmp_path / "clients"
    for i in range(12):
        save_state(clients, {"state": {"garbage": torch.ones(1)}}, fingerprint="x", name=f"c{i}-r00002-0000")
    (clients / "c0-r00002-0000.sha256").write_text("0" * 64 + "\n")

    resumed = run_rounds(data, SPEC, cfg, checkpoint_dir=tmp_path, resume=True)

    assert strip(resumed.records) == strip(full.records)
    assert all(torch.equal(resumed.final_state[k], full.final_state[k]) for k in full.final_state)
    states = load_client_states(tmp_path)
    assert all("garbage" not in s for s in states.values())
    assert len(list(clients.glob("*.pt"))) == len(states)  # the strays are gone, rewritten or removed


def test_a_checkpoint_missing_a_client_file_is_refused_with_the_fix(tmp_path):
    data = _many(8)
    cfg = scaffold_cfg(rounds=3, participation=0.25)
    with pytest.raises(RunInterrupted):
        run_rounds(data, SPEC, cfg, checkpoint_dir=tmp_path, stop_after=1)
    next((tmp_path / "clients").glob("*.pt")).unlink()
    with pytest.raises(
        CheckpointError, match=r"names clients/c\d+-r00000-\w+\.pt, client \d+'s state, which is missing"
    ):
        run_rounds(data, SPEC, cfg, checkpoint_dir=tmp_path, resume=True)


def test_a_checkpoint_with_the_client_states_inside_still_resumes(tmp_path):
    """The layout before client files: every client's state in the server's own file."""
    from fedcore.engine import load_client_states
    from fedcore.engine.checkpoint import load_state

    data = _many(8)
    cfg = scaffold_cfg(rounds=3, participation=0.5)
    full = run_rounds(data, SPEC, cfg)
    with pytest.raises(RunInterrupted):
        run_rounds(data, SPEC, cfg, checkpoint_dir=tmp_path, stop_after=1)
    saved = load_state(tmp_path)
    payload = {k: v for k, v in saved.payload.items() if k != "client_files"}
    payload["client_states"] = load_client_states(tmp_path)
    shutil.rmtree(tmp_path / "clients")
    save_state(tmp_path, payload, fingerprint=saved.fingerprint)

    # resumed, stopped again, resumed again: the states read from inside are written out at the first round
    with pytest.raises(RunInterrupted):
        run_rounds(data, SPEC, cfg, checkpoint_dir=tmp_path, resume=True, stop_after=2)
    assert set(payload["client_states"]) <= set(load_client_states(tmp_path))  # none of them lost
    resumed = run_rounds(data, SPEC, cfg, checkpoint_dir=tmp_path, resume=True)

    assert strip(resumed.records) == strip(full.records)
    assert all(torch.equal(resumed.final_state[k], full.final_state[k]) for k in full.final_state)
