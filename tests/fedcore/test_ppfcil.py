"""PP-FCIL: the dual model, its losses, the class-incremental engine path, the server, privacy ledgers, resume."""

from __future__ import annotations

import json
import math
import re
from functools import partial

import numpy as np
import pytest
import torch

from fedcore.aggregate.ppfcil import PPFCIL
from fedcore.engine import RoundConfig, RunInterrupted, run_rounds
from fedcore.engine.spec import ModelSpec
from fedcore.incremental import losses as L
from fedcore.incremental.evaluate import incremental_evaluate, task_end_metrics
from fedcore.incremental.exemplars import ExemplarMemory
from fedcore.incremental.schedule import TaskSchedule, incremental_view, make_schedule, split_by_task
from fedcore.models.dual import DualNet
from fedcore.tensors import to_tensor
from fedcore.train import create_trainer
from fedcore.train.base import ClientUpdate

PRIVATE = dict(privacy="lbdp", rho=0.0, classifier_loss="plain", exemplars="random", noise_source="seeded")


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def digits():
    """scikit-learn's 8x8 digits as uint8 (N, 16, 16, 1), split 1,400 / 397."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = np.repeat(np.repeat((d.images * 255 / 16).astype(np.uint8), 2, 1), 2, 2)[..., None]
    p = np.random.default_rng(0).permutation(len(d.target))
    return x[p[:1400]], d.target[p[:1400]], x[p[1400:]], d.target[p[1400:]]


def _setup(
    digits,
    *,
    tasks=3,
    rounds_per_task=2,
    clients=3,
    norm="batch",
    trainer=None,
    strategy=None,
    participation=1.0,
    seed=0,
    classes=6,
):
    x, y, tx, ty = digits
    keep, tkeep = y < classes, ty < classes
    schedule = make_schedule(num_classes=classes, tasks=tasks)
    data = incremental_view(
        x[keep],
        y[keep],
        tx[tkeep],
        ty[tkeep],
        schedule,
        num_clients=clients,
        alpha=5.0,
        rounds_per_task=rounds_per_task,
        seed=0,
    )
    spec = ModelSpec(name="dual-lenet", in_channels=1, num_classes=10, norm=norm)
    params = dict(lr=0.05, local_epochs=1, batch_size=32, memory=60, per_class=10, **(trainer or {}))
    cfg = RoundConfig(
        rounds=tasks * rounds_per_task,
        trainer="fcil",
        trainer_params=params,
        strategy="ppfcil",
        strategy_params=dict(strategy or {}),
        participation=participation,
        seed=seed,
    )
    evaluate = partial(incremental_evaluate, spec=spec, test=data.eval_sets["test"], task_classes=data.task_classes)
    return data, spec, cfg, evaluate


def _same(a, b) -> bool:
    """Equal as JSON, NaN included, once wall-clock timings are dropped."""

    def clean(v):
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if k != "agg_seconds"}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(a), sort_keys=True) == json.dumps(clean(b), sort_keys=True)


# ------------------------------------------------------------------------------------ dual model
def test_fusion_is_the_channel_attention_mix_of_old_and_new():
    torch.manual_seed(0)
    net = DualNet(backbone="cnn", in_channels=1, num_classes=4).eval()
    x = torch.randn(5, 1, 16, 16)
    assert torch.equal(net.embed(x), net.new.embed(x))  # first task: no old knowledge, F_mix = F_new
    net.has_old.fill_(1)
    f_old, f_new = net.old.embed(x), net.new.embed(x)
    lam = net.fusion(f_old)
    assert torch.allclose(net.embed(x), f_old * lam + f_new * (1 - lam))
    assert bool(((lam > 0) & (lam < 1)).all())
    net.fuse.fill_(0)  # single-branch form: Φ_old only teaches
    assert torch.equal(net.embed(x), f_new)


def test_old_branch_is_frozen_and_stays_in_eval_mode():
    net = DualNet(backbone="cnn", in_channels=1, num_classes=4).train()
    assert not any(p.requires_grad for p in net.old.parameters())
    assert not any(p.requires_grad for p in net.old_fc.parameters())
    assert not net.old.training and net.new.training


def test_advance_moves_the_finished_model_into_the_old_branch():
    torch.manual_seed(0)
    a = DualNet(backbone="cnn", in_channels=1, num_classes=4)
    b = DualNet(backbone="cnn", in_channels=1, num_classes=4)
    b.load_state_dict(a.state_dict())
    new_before = {k: v.clone() for k, v in a.new.state_dict().items()}
    fc_before = a.fc.weight.clone()
    a.advance(1, compressed=True, seed=3)  # first task: nothing was compressed, Φ_old <- Φ_new
    b.advance(1, compressed=True, seed=3)
    assert all(torch.equal(a.old.state_dict()[k], v) for k, v in new_before.items())
    assert torch.equal(a.old_fc.weight, fc_before) and torch.equal(
        a.single.state_dict()["features.0.weight"], a.old.state_dict()["features.0.weight"]
    )
    assert not torch.equal(a.new.state_dict()["features.0.weight"], new_before["features.0.weight"])
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())  # same on every client
    assert (int(a.task), int(a.has_old)) == (1, 1)
    with torch.no_grad():  # later tasks: the compressed single model becomes Φ_old
        a.single.features[0].weight.add_(1.0)
    single = a.single.features[0].weight.clone()
    a.advance(2, compressed=True, seed=3)
    assert torch.equal(a.old.features[0].weight, single)
    with pytest.raises(ValueError, match="can only advance to task 3"):
        a.advance(4, compressed=True)


# ------------------------------------------------------------------------------------ losses
def test_balanced_softmax_with_equal_counts_is_cross_entropy_over_the_seen_classes():
    torch.manual_seed(0)
    logits, y = torch.randn(8, 5), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    seen = torch.tensor([True, True, True, False, False])
    equal = L.classification(logits, y, seen=seen, prior=L.log_prior(torch.tensor([4, 4, 4, 0, 0])))
    plain = torch.nn.functional.cross_entropy(logits[:, :3], y, reduction="none")
    assert torch.allclose(equal, plain, atol=1e-6)
    skewed = L.classification(logits, y, seen=seen, prior=L.log_prior(torch.tensor([40, 4, 4, 0, 0])))
    assert bool((skewed[y != 0] > plain[y != 0]).all())  # a frequent class takes probability from the others


def test_distillation_is_zero_only_when_student_matches_teacher_on_old_classes():
    torch.manual_seed(0)
    t = torch.randn(6, 5)
    old = torch.tensor([True, True, False, False, False])
    s = t.clone()
    s[:, 2:] += 5.0  # new classes may move freely
    assert torch.allclose(L.distillation(s, t, old=old, temperature=2.0), torch.zeros(6), atol=1e-6)
    s[:, 0] += 1.0
    assert bool((L.distillation(s, t, old=old, temperature=2.0) > 0).all())


def test_supcon_prefers_views_that_cluster_by_label():
    y = torch.tensor([0, 0, 1, 1])
    clustered = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [0.1, 1.0]])
    mixed = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.1], [0.1, 1.0]])
    assert float(L.supcon(clustered, y, temperature=0.1)) < float(L.supcon(mixed, y, temperature=0.1))


# ------------------------------------------------------------------------------------ schedule and data
@pytest.mark.parametrize(
    "tasks, match",
    [
        ([[0, 1], [1, 2]], "class 1 appears in task 0 and again in task 1"),
        ([[0, 1], []], "task 1 of the schedule has no classes"),
    ],
)
def test_bad_task_schedules_are_refused(tasks, match):
    with pytest.raises(ValueError, match=match):
        TaskSchedule.of(tasks)


def test_make_schedule_refuses_more_tasks_than_classes():
    with pytest.raises(ValueError, match="cannot split 10 classes into 11 tasks"):
        make_schedule(num_classes=10, tasks=11)


def test_each_client_gets_data_in_every_task_and_only_that_task_in_its_rounds(digits):
    data, *_ = _setup(digits)
    for i in range(data.num_clients):
        for r in range(6):
            x, y = data.client_data(i, r)
            assert len(y) > 0 and set(np.unique(y)) <= set(data.task_classes[r // 2])
    owned = split_by_task(digits[1], make_schedule(num_classes=10, tasks=5), num_clients=4, alpha=1.0, seed=1)
    assert sorted(np.concatenate(owned).tolist()) == list(range(len(digits[1])))  # a partition of the samples


def test_rounds_must_cover_the_tasks(digits):
    data, spec, cfg, ev = _setup(digits)
    bad = RoundConfig(**{**cfg.__dict__, "rounds": 5})
    with pytest.raises(ValueError, match=r"rounds \(5\) must be tasks x rounds_per_task \(3 x 2 = 6\)"):
        run_rounds(data, spec, bad, evaluate=ev)


# ------------------------------------------------------------------------------------ trainer settings
@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(privacy="lbdp", rho=0.1), "private training needs rho=0"),
        (dict(memory=10, per_class=20), "larger than the memory"),
        (dict(privacy="dp", rho=0.0, epsilon=0.0), "epsilon must be a finite number > 0"),
        (dict(privacy="dp", rho=0.0), "needs classifier_loss=plain"),
        (dict(privacy="lbdp", rho=0.0, classifier_loss="plain"), "needs exemplars=random"),
        (dict(branches=3), "branches must be 2"),
        (dict(compres="none"), "compres"),
        (dict(report_on="test"), "report_on"),
        (dict(holdout_fraction=1.0), "holdout_fraction .* must be in \\(0, 1\\)"),
    ],
)
def test_bad_trainer_settings_are_refused_with_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        create_trainer("fcil", **kw)


def test_private_training_refuses_batchnorm(digits):
    data, spec, cfg, ev = _setup(digits, trainer=PRIVATE)
    with pytest.raises(ValueError, match="GroupNorm"):
        run_rounds(data, spec, cfg, evaluate=ev)


def test_compress_rounds_must_fit_in_a_task_and_leave_a_training_round_when_they_replace_it(digits):
    data, spec, cfg, ev = _setup(digits, trainer=dict(compress_rounds=3))
    with pytest.raises(ValueError, match=r"compress_rounds \(3\) must be at most rounds_per_task \(2\)"):
        run_rounds(data, spec, cfg, evaluate=ev)
    data, spec, cfg, ev = _setup(digits, trainer=dict(compress_rounds=2, compress_schedule="replace"))
    with pytest.raises(ValueError, match="below it with compress_schedule=replace"):
        run_rounds(data, spec, cfg, evaluate=ev)


# ------------------------------------------------------------------------------------ end to end
def test_run_learns_every_task_keeps_old_ones_and_fills_the_memory(digits):
    data, spec, cfg, ev = _setup(digits, tasks=3, rounds_per_task=3)
    cfg = RoundConfig(**{**cfg.__dict__, "rounds": 9, "trainer_params": {**cfg.trainer_params, "local_epochs": 2}})
    folder_states = {}
    res = run_rounds(data, spec, cfg, evaluate=ev, on_round=lambda rec, st: folder_states.update(last=st))
    s = res.summary
    assert s["avg_inc_acc"] > 0.8 and s["forgetting"] < 0.15  # 6 easy digits: near-perfect with replay
    assert [int(r["task"]) for r in res.records] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert int(folder_states["last"]["phase"]) == 1  # the last round of a later task compresses


def test_finetuning_without_replay_or_distillation_forgets(digits):
    data, spec, cfg, ev = _setup(
        digits,
        trainer=dict(branches=1, distill=False, rho=0.0, classifier_loss="plain", exemplars="none", compress="none"),
        strategy=dict(weighting="examples", selection="random"),
    )
    res = run_rounds(data, spec, cfg, evaluate=ev)
    assert res.summary["forgetting"] > 0.5


def test_same_seed_same_metrics_and_resume_after_task_and_round_is_identical(digits, tmp_path):
    data, spec, cfg, ev = _setup(
        digits, norm="group", participation=0.67, trainer=dict(PRIVATE, epsilon=4.0, sample_rate=0.25)
    )
    full = run_rounds(data, spec, cfg, evaluate=ev, checkpoint_dir=tmp_path / "a")
    with pytest.raises(RunInterrupted):
        run_rounds(data, spec, cfg, evaluate=ev, checkpoint_dir=tmp_path / "b", stop_after=3)  # task 1, round 1
    resumed = run_rounds(data, spec, cfg, evaluate=ev, checkpoint_dir=tmp_path / "b", resume=True)
    assert _same(full.records, resumed.records)
    assert all(torch.equal(full.final_state[k], resumed.final_state[k]) for k in full.final_state)
    from fedcore.engine import load_client_states
    from fedcore.engine.checkpoint import load_state

    a, b = load_state(tmp_path / "a").payload, load_state(tmp_path / "b").payload
    ca, cb = load_client_states(tmp_path / "a"), load_client_states(tmp_path / "b")
    assert ca.keys() == cb.keys() and ca
    for cid, st in ca.items():
        other = cb[cid]
        assert _same(st["ledger"], other["ledger"])  # the privacy ledgers: cost, steps, σ, ε, exhausted
        ma, mb = ExemplarMemory.from_state_dict(st["memory"]), ExemplarMemory.from_state_dict(other["memory"])
        assert ma.classes == mb.classes and all(np.array_equal(u, v) for u, v in zip(ma.data(), mb.data()))
    assert _same(a["strategy"], b["strategy"])


@pytest.mark.parametrize("privacy", ["dp", "lbdp"])
def test_privacy_ledger_never_exceeds_the_budget_and_a_spent_client_stops_sending(digits, privacy):
    # m = 2 of 3 clients a round, so a client takes part in 4 of 6 rounds on average, while its σ is
    # calibrated for ⌈6 · 0.34⌉ = 3: the budget runs out before the run ends
    data, spec, cfg, ev = _setup(
        digits,
        norm="group",
        tasks=2,
        rounds_per_task=3,
        participation=0.34,
        trainer=dict(PRIVATE, privacy=privacy, epsilon=0.5, sample_rate=0.5, compress="none"),
    )
    cfg = RoundConfig(**{**cfg.__dict__, "rounds": 6})
    res = run_rounds(data, spec, cfg, evaluate=ev)
    eps = {int(k[len("epsilon.c") :]): [] for r in res.records for k in r if re.match(r"^epsilon\.c\d+$", k)}
    for r in res.records:
        for cid in eps:
            if f"epsilon.c{cid}" in r:
                eps[cid].append(r[f"epsilon.c{cid}"])
    assert eps and all(0 < v <= 0.5 + 1e-9 for vals in eps.values() for v in vals)
    assert all(np.all(np.diff(vals) >= -1e-12) for vals in eps.values())  # spending only grows
    assert any(r.get("stopped_clients", 0) > 0 for r in res.records)  # a budget this small runs out
    # ... and a client picked past its plan sends nothing, rather than an update drowned in noise: LBDP plans
    # its σ to spend ε_total over exactly its planned steps, so nothing usable is left after them
    if privacy == "lbdp":  # (classic DP's σ is fixed for the run)
        sent = [
            r[f"sigma.c{k}"]
            for r in res.records
            for k in eps
            if f"sigma.c{k}" in r and not r.get(f"budget_spent.c{k}", 0.0)
        ]
        assert max(sent) < 2 * min(sent)
    # the round that takes a client's last planned step says so, and the server retires it at once: a client is
    # picked to send nothing only once every client is spent
    made = {k: 0 for k in eps}
    for r in res.records:
        if any(r.get(f"budget_spent.c{k}", 0.0) for k in eps):
            assert all(v == 3 for v in made.values()), (r["round"], made)
        for k in eps:
            made[k] += int(f"epsilon.c{k}" in r and not r.get(f"budget_spent.c{k}", 0.0))
    assert all(v <= 3 for v in made.values())


# ------------------------------------------------------------------------------------ one client round
def _round(digits, *, task, round_index, state=None, client_state=None, n=None, norm="batch", data=None, **trainer):
    """One fcil client round on 3 tasks of 2 classes, 2 rounds each (the last of each task compresses)."""
    x, y, _, _ = digits
    keep = np.isin(y, [2 * task, 2 * task + 1])
    x, y = data if data is not None else (x[keep][:n], y[keep][:n])
    spec = ModelSpec(name="dual-lenet", in_channels=1, num_classes=10, norm=norm)
    torch.manual_seed(0)
    model = spec.build()
    if state is not None:
        model.load_state_dict(state)
    b = {
        "task": task,
        "task_classes": [[0, 1], [2, 3], [4, 5]],
        "rounds_per_task": 2,
        "round": round_index,
        "rounds": 6,
        "seed": 0,
        "participation": 1.0,
    }
    t = create_trainer(
        "fcil", **{"lr": 0.05, "local_epochs": 1, "batch_size": 16, "memory": 60, "per_class": 10, **trainer}
    )
    return model, t.train(
        model,
        x,
        y,
        global_state={k: v.clone() for k, v in model.state_dict().items()},
        seed=1,
        broadcast=b,
        client_state=client_state or {},
    )


def test_a_round_weights_distillation_by_old_over_seen_classes_and_herds_its_classes(digits):
    model, upd = _round(digits, task=0, round_index=0)
    mem = ExemplarMemory.from_state_dict(upd.client_state["memory"])
    assert mem.classes == [0, 1] and len(mem) == 20 and upd.metrics["lambda"] == 0.0
    _, upd2 = _round(digits, task=2, round_index=4, state=upd.state, client_state=upd.client_state)
    assert upd2.metrics["lambda"] == pytest.approx(4 / 6)  # old = the schedule's tasks 0 and 1, seen = 0..5
    assert int(upd2.state["task"]) == 2  # the model passed through task 1, which no round trained
    assert upd2.payload["total_examples"] == upd.payload["new_examples"] + upd2.payload["new_examples"]


def test_a_client_reports_on_a_share_of_the_task_it_never_trains_on_the_same_share_all_task(digits):
    x, y, _, _ = digits
    keep = np.isin(y, [0, 1])
    x, y = x[keep], y[keep]
    model, upd = _round(digits, task=0, round_index=0, data=(x, y))
    held = upd.client_state["holdout"]["index"]
    assert len(held) == int(0.1 * len(x)) > 0 and upd.payload["new_examples"] == len(x) - len(held)
    # what it reports is the trained model's accuracy on exactly those samples
    model.eval()
    with torch.no_grad():
        z = L.masked(model(to_tensor(x[held])), _mask_of([0, 1]))
    assert upd.payload["accuracy"] == pytest.approx(float((z.argmax(1).numpy() == y[held]).mean()))
    # they never reach the weights: with those samples scrambled the trained model is bit-identical, the report not
    x2, y2 = x.copy(), y.copy()
    x2[held], y2[held] = 255 - x2[held], 1 - y2[held]
    _, scrambled = _round(digits, task=0, round_index=0, data=(x2, y2))
    assert all(torch.equal(v, scrambled.state[k]) for k, v in upd.state.items())
    assert scrambled.payload["accuracy"] != upd.payload["accuracy"]
    # the next round of the task holds out the same samples; the next task draws its own
    _, again = _round(digits, task=0, round_index=1, state=upd.state, client_state=upd.client_state, data=(x, y))
    assert np.array_equal(again.client_state["holdout"]["index"], held)
    kept = {**upd.client_state, "holdout": {**upd.client_state["holdout"], "index": list(range(len(held)))}}
    _, told = _round(digits, task=0, round_index=1, state=upd.state, client_state=kept, data=(x, y))
    assert told.client_state["holdout"]["index"] == list(range(len(held)))  # the kept share, not a fresh draw
    _, nxt = _round(digits, task=1, round_index=2, state=again.state, client_state=again.client_state)
    assert nxt.client_state["holdout"]["task"] == 1


def test_a_client_reports_on_its_training_data_when_asked_or_when_it_has_too_little_to_hold_out(digits):
    _, on_train = _round(digits, task=0, round_index=0, n=100, report_on="train")
    assert "holdout" not in on_train.client_state and on_train.payload["new_examples"] == 100
    _, tiny = _round(digits, task=0, round_index=0, n=9)  # 10% of 9 is no sample
    assert len(tiny.client_state["holdout"]["index"]) == 0 and tiny.payload["new_examples"] == 9


def _mask_of(classes):
    m = torch.zeros(10, dtype=torch.bool)
    m[classes] = True
    return m


def _objective(*, compressing, rho=0.5, lam=0.5, **trainer):
    from fedcore.train.fcil import _Objective

    torch.manual_seed(0)
    model = ModelSpec(name="dual-lenet", in_channels=1, num_classes=10).build()
    model.advance(1, compressed=False)  # task 1: Φ_old holds task 0 (classes 0, 1), the teacher its classifier
    model.train()
    t = create_trainer("fcil", rho=rho, kd_temperature=2.0, lambda0=0.7, **trainer)
    seen, old = torch.zeros(10, dtype=torch.bool), torch.zeros(10, dtype=torch.bool)
    seen[:4], old[:2] = True, True
    counts = torch.tensor([20, 20, 60, 80, 0, 0, 0, 0, 0, 0])
    return model, _Objective(t, model, seen=seen, old=old, lam=lam, counts=counts, compressing=compressing), seen, old


def test_the_training_loss_is_the_issues_weighted_sum_with_supcon_on_phi_new_through_the_head():
    from fedcore.train.base import augment_batch

    model, obj, seen, old = _objective(compressing=False, rho=0.5, lam=0.25)
    x, y = torch.rand(8, 1, 28, 28), torch.tensor([0, 1, 2, 3, 2, 3, 0, 2])
    got = obj.batch_loss(x, y, torch.Generator().manual_seed(3))
    f_mix, f_new, _ = model.mix(x)
    logits = model.fc(f_mix)
    with torch.no_grad():
        teacher = model.teacher_logits(x)
    lc = L.classification(logits, y, seen=seen, prior=L.log_prior(torch.tensor([20, 20, 60, 80, 0, 0, 0, 0, 0, 0])))
    ld = L.distillation(logits, teacher, old=old, temperature=2.0)
    view = augment_batch(x, torch.Generator().manual_seed(3))
    z = model.proj(torch.cat([f_new, model.new.embed(view)]))
    ls = L.supcon(z, torch.cat([y, y]), temperature=obj.t.supcon_temperature)
    assert float(got) == pytest.approx(float((0.75 * lc + 0.25 * ld).mean() + 0.5 * ls), rel=1e-5)
    # L_S reaches Φ_new and the head only: the fusion, the classifier and the frozen Φ_old take none of it
    model.zero_grad(set_to_none=True)
    (0.5 * ls).backward()
    touched = {n.split(".")[0] for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert touched == {"new", "proj"}


def test_the_compression_loss_weights_l_c_by_one_minus_lambda_and_matches_f_mix_with_lambda0():
    model, obj, seen, _ = _objective(compressing=True, lam=0.25)
    x, y = torch.rand(8, 1, 28, 28), torch.tensor([0, 1, 2, 3, 2, 3, 0, 2])
    got = obj.batch_loss(x, y, torch.Generator().manual_seed(3))
    with torch.no_grad():
        f_mix = model.mix(x)[0]
    f_single = model.single.embed(x)
    lc = L.classification(
        model.fc(f_single), y, seen=seen, prior=L.log_prior(torch.tensor([20, 20, 60, 80, 0, 0, 0, 0, 0, 0]))
    )
    expect = (0.75 * lc + 0.7 * L.feature_match(f_mix, f_single)).mean()
    assert float(got) == pytest.approx(float(expect), rel=1e-5)


def test_a_compression_round_that_replaces_training_trains_only_the_single_branch(digits):
    kw = dict(compress_schedule="replace")
    _, first = _round(digits, task=0, round_index=0, **kw)
    _, train = _round(digits, task=1, round_index=2, state=first.state, client_state=first.client_state, **kw)
    assert train.metrics["compressing"] == 0.0
    _, comp = _round(digits, task=1, round_index=3, state=train.state, client_state=train.client_state, **kw)
    assert comp.metrics["compressing"] == 1.0 and int(comp.state["phase"]) == 1
    changed = {
        k.split(".")[0]
        for k in comp.state
        if comp.state[k].is_floating_point() and not torch.equal(comp.state[k], train.state[k])
    }
    assert changed == {"single"}  # Φ_new, its BatchNorm statistics, the fusion and the classifier stay put


def test_by_default_the_last_round_of_a_task_trains_as_every_other_round_then_compresses(digits):
    _, first = _round(digits, task=0, round_index=0)
    _, train = _round(digits, task=1, round_index=2, state=first.state, client_state=first.client_state)
    carried = dict(state=train.state, client_state=train.client_state)
    _, plain = _round(digits, task=1, round_index=3, compress="none", **carried)  # the no-compression ablation
    _, comp = _round(digits, task=1, round_index=3, **carried)
    # the same training as the ablation's round, step for step, then as many steps again on ``single`` alone
    assert comp.metrics["compressing"] == 1.0 and int(comp.state["phase"]) == 1 and plain.metrics["compressing"] == 0
    assert comp.metrics["steps"] == 2 * plain.metrics["steps"] > 0
    assert comp.metrics["train_loss"] == plain.metrics["train_loss"] and "compress_loss" in comp.metrics
    for k, v in comp.state.items():
        if k.split(".")[0] in ("new", "fusion", "fc", "proj"):
            assert torch.equal(v, plain.state[k]), k
    single = [k for k in comp.state if k.startswith("single.") and comp.state[k].is_floating_point()]
    assert any(not torch.equal(comp.state[k], train.state[k]) for k in single)  # and ``single`` was distilled


def test_a_private_client_plans_its_budget_for_the_compression_steps_too(digits):
    # 3 tasks, 6 rounds, every client every round: 6 training rounds, and 2 of them also compress
    sigma = {
        schedule: _round(
            digits, task=0, round_index=0, norm="group", compress_schedule=schedule, **{**PRIVATE, "privacy": "dp"}
        )[1].metrics["sigma"]
        for schedule in ("after", "replace")
    }
    from fedcore.privacy.bayesian import calibrate_sigma_classic

    steps = 10  # 1 epoch at q = 0.1
    assert sigma["replace"] == pytest.approx(calibrate_sigma_classic(q=0.1, steps=6 * steps, epsilon=8.0, delta=1e-5))
    assert sigma["after"] == pytest.approx(calibrate_sigma_classic(q=0.1, steps=8 * steps, epsilon=8.0, delta=1e-5))


def _two_rounds(digits, n=None, **trainer):
    """Rounds 0 and 1 of the first task on one client, its model and ledger carried from the first to the second."""
    _, first = _round(digits, task=0, round_index=0, n=n, norm="group", **trainer)
    _, second = _round(
        digits,
        task=0,
        round_index=1,
        n=n,
        norm="group",
        state=first.state,
        client_state=first.client_state,
        **trainer,
    )
    return first, second


def test_lbdp_scales_its_noise_to_the_clients_gradients_and_classic_dp_does_not(digits):
    # with C = 30 most per-sample gradients stay inside the clip (mean d² about 0.1 in the first round here):
    # LBDP's account charges them for what they are, so once it has seen them the same ε buys less noise;
    # classic DP charges every record as if clipped (d = 1). Before its first accounted step LBDP has read
    # nothing, so it starts at d = 1, classic DP's σ.
    sig = {
        (p, c): [u.metrics["sigma"] for u in _two_rounds(digits, **dict(PRIVATE, privacy=p, clip_norm=c))]
        for p in ("lbdp", "dp")
        for c in (1.0, 30.0)
    }
    assert sig[("lbdp", 30.0)][0] == pytest.approx(sig[("dp", 30.0)][0], rel=2e-3)
    assert sig[("lbdp", 30.0)][1] < 0.9 * sig[("dp", 30.0)][1] and sig[("lbdp", 30.0)][1] < sig[("lbdp", 1.0)][1]
    assert sig[("dp", 30.0)] == pytest.approx(sig[("dp", 1.0)])  # classic σ is a noise multiplier: data-blind


def test_lbdp_plans_sigma_on_batches_its_account_was_charged_for_and_reads_no_records_for_it(digits):
    from fedcore.privacy.bayesian import calibrate_sigma_bdp

    kw = dict(PRIVATE, clip_norm=30.0, sample_rate=0.25)
    first, second = _two_rounds(digits, **kw)
    ledger, kept = first.client_state["ledger"], first.client_state["lbdp_norms"]
    batches = [np.asarray(b) for b in kept["batches"]]
    assert kept["task"] == 0 and 1 <= len(batches) <= 2
    assert all(b.size >= 2 and np.all((b >= 0) & (b <= 1)) for b in batches)
    assert "batches" not in ledger and "lbdp_norms" not in ledger  # the ledger is released; the norms stay put
    # the second round's σ is the calibration on those batches, each step's planned cost their mean cost
    spent = np.asarray(ledger["accountant"]["total_cost"])
    plan = dict(q=0.25, epsilon=8.0, delta=1e-5, spent=spent, estimator="ucb")
    planned = (6 + 2) * 4  # 6 rounds at full participation, 2 of which also compress; 1 epoch / q = 4 steps each
    steps = planned - ledger["accountant"]["steps"]
    assert second.metrics["sigma"] == pytest.approx(calibrate_sigma_bdp(sq_norms=batches, steps=steps, **plan))
    assert second.metrics["sigma"] < 0.9 * first.metrics["sigma"]
    # a new task brings new classes: its first round plans at d = 1 again, as if it had read nothing
    _, switched = _round(
        digits, task=1, round_index=2, norm="group", state=first.state, client_state=first.client_state, **kw
    )
    assert switched.metrics["sigma"] == pytest.approx(calibrate_sigma_bdp(sq_norms=np.ones(2), steps=steps, **plan))
    # the probe form reads 64 records first, so its very first round is already data-aware
    _, probed = _round(digits, task=0, round_index=0, norm="group", bdp_sigma_from="probe", **kw)
    assert probed.metrics["sigma"] < 0.5 * first.metrics["sigma"]


def test_lbdp_on_a_client_whose_batches_are_too_small_for_a_spread_plans_at_d1_instead_of_failing(digits):
    # 3 records at q = 0.1: most batches are empty or hold one record, which the ucb estimator cannot use
    first, second = _two_rounds(digits, n=3, **dict(PRIVATE, sample_rate=0.1))
    for upd in (first, second):
        assert upd.metrics["steps"] == 10 and 0 < upd.metrics["epsilon"] <= 8.0


@pytest.mark.parametrize("conversion", ["balle", "chernoff"])
def test_lbdp_and_classic_dp_report_the_same_epsilon_for_the_same_noise_when_every_gradient_is_clipped(
    digits, conversion
):
    # C far below every per-sample gradient norm: every d = 1, so the Bayesian cost is the classic one, and under
    # one conversion both forms must calibrate the same σ and report the same ε
    kw = dict(PRIVATE, clip_norm=1e-4, epsilon=2.0, epsilon_conversion=conversion)
    _, lbdp = _round(digits, task=0, round_index=0, norm="group", **kw)
    _, dp = _round(digits, task=0, round_index=0, norm="group", **{**kw, "privacy": "dp"})
    assert lbdp.metrics["clipped_fraction"] == dp.metrics["clipped_fraction"] == 1.0
    assert lbdp.metrics["clipped_norm"] == pytest.approx(1e-4) and lbdp.metrics["grad_norm_median"] > 1e-2
    assert lbdp.metrics["steps"] == dp.metrics["steps"] == 10
    assert lbdp.metrics["sigma"] == pytest.approx(dp.metrics["sigma"], rel=2e-3)
    assert lbdp.metrics["epsilon"] == pytest.approx(dp.metrics["epsilon"], rel=2e-3)


def test_the_chernoff_conversion_needs_more_noise_than_balles_for_the_same_budget(digits):
    kw = dict(PRIVATE, privacy="dp", clip_norm=1.0, epsilon=1.0)
    sigma = {
        c: _round(digits, task=0, round_index=0, norm="group", epsilon_conversion=c, **kw)[1].metrics["sigma"]
        for c in ("balle", "chernoff")
    }
    assert sigma["chernoff"] > 1.05 * sigma["balle"]


def test_a_dp_sgd_client_reports_where_its_gradients_sit_against_c_and_the_server_keeps_it(digits):
    _, tight = _round(digits, task=0, round_index=0, norm="group", **dict(PRIVATE, privacy="clip", clip_norm=1e-4))
    _, loose = _round(digits, task=0, round_index=0, norm="group", **dict(PRIVATE, privacy="clip", clip_norm=1e6))
    assert tight.metrics["clipped_fraction"] == 1.0 and loose.metrics["clipped_fraction"] == 0.0
    assert loose.metrics["clipped_norm"] < 1e6 and loose.metrics["clipped_norm"] > 0
    s = PPFCIL()
    g = {"w": torch.zeros(2), "task": torch.tensor(0)}
    s.setup(g, num_clients=1, param_keys=["w"])
    s.select(0, [0], num_clients=1)
    upd = _update(0.9)
    upd.metrics.update({k: tight.metrics[k] for k in ("clipped_fraction", "clipped_norm", "grad_norm_median")})
    kept = s.aggregate(g, [(0, upd)], num_clients=1).per_client[0]
    assert kept["clipped_fraction"] == 1.0 and kept["grad_norm_median"] == tight.metrics["grad_norm_median"]


def test_lbdp_takes_noise_only_steps_on_empty_poisson_batches_and_counts_them(digits):
    _, upd = _round(digits, task=0, round_index=0, n=3, norm="group", sample_rate=0.1, **PRIVATE)
    acct = upd.client_state["ledger"]["accountant"]
    assert upd.metrics["steps"] == 10 == acct["steps"]  # 1 epoch / q: every step is spent, batch or not
    assert 0 < upd.client_state["ledger"]["epsilon"] <= 8.0


# ------------------------------------------------------------------------------------ server
def _update(acc, *, new=100, total=200, stopped=False, value=1.0):
    state = {"w": torch.full((2,), value), "task": torch.tensor(0)}
    return ClientUpdate(
        state=state,
        num_examples=0 if stopped else new,
        payload={
            "new_examples": new,
            "total_examples": total,
            "accuracy": acc,
            "loss": 1 - acc,
            "kappa": acc,
            "stopped": stopped,
        },
    )


def test_server_ignores_clients_out_of_budget_and_keeps_the_model_when_all_are():
    s = PPFCIL()
    g = {"w": torch.zeros(2), "task": torch.tensor(0)}
    s.setup(g, num_clients=3, param_keys=["w"])
    s.select(0, [0, 1, 2], num_clients=3)
    agg = s.aggregate(
        g,
        [(0, _update(0.9, value=1.0)), (1, _update(0.5, stopped=True, value=9.0)), (2, _update(0.7, value=3.0))],
        num_clients=3,
    )
    merged = float(agg.state["w"][0])
    # only clients 0 (w = 1) and 2 (w = 3) are averaged, by their logged weights; client 1's 9 is left out
    expected = agg.per_client[0]["agg_weight"] * 1.0 + agg.per_client[2]["agg_weight"] * 3.0
    assert merged == pytest.approx(expected, abs=1e-5)
    assert agg.metrics["stopped_clients"] == 1.0
    assert agg.per_client[0]["agg_weight"] > agg.per_client[2]["agg_weight"]  # more accurate, else equal
    s.select(1, [0, 1, 2], num_clients=3)
    none = s.aggregate(g, [(1, _update(0.5, stopped=True))], num_clients=3)
    assert torch.equal(none.state["w"], g["w"])
    picked = [s.select(r, [0, 1], num_clients=3) for r in range(2, 8)]
    assert all(len(p) == 2 for p in picked)
    assert [1 in p for p in picked] == [False] * 6  # a client out of budget is never picked again


def test_a_nan_upload_that_spends_the_budget_retires_its_client_and_its_ledger_line_is_recorded():
    s = PPFCIL()
    g = {"w": torch.zeros(2), "task": torch.tensor(0)}
    s.setup(g, num_clients=3, param_keys=["w"])
    s.select(0, [0, 1], num_clients=3)
    last = _update(0.5, value=math.nan)  # client 1's last budgeted upload came back NaN: the engine drops it
    last.metrics.update(epsilon=8.0, sigma=1.3, budget_exhausted=1.0)
    assert s.discarded([(1, last)]) == {1: {"epsilon": 8.0, "sigma": 1.3, "budget_spent": 0.0}}  # its ledger line
    kept = _update(0.9)
    kept.metrics.update(epsilon=2.0, sigma=1.1)
    agg = s.aggregate(g, [(0, kept)], num_clients=3)
    assert agg.per_client[0]["epsilon"] == 2.0 and agg.per_client[0]["budget_spent"] == 0.0
    assert np.isnan(s.vectors[1]).all()  # the broken model's report is not kept
    picked = [s.select(r, [0, 1], num_clients=3) for r in range(1, 7)]
    assert [1 in p for p in picked] == [False] * 6  # spent is spent, merged or not


def test_round_ledger_lines_carry_private_tta_names_and_what_each_round_cost():
    from fedcore.privacy import Ledger, PrivacyConfig
    from fedcore.privacy.ledger import round_ledger_lines

    records = [
        {
            "round": 0,
            "epsilon.c2": 1.5,
            "sigma.c2": 0.9,
            "budget_spent.c2": 0.0,
            "epsilon.c10": 2.0,
            "sigma.c10": 0.8,
            "budget_spent.c10": 0.0,
        },
        {"round": 1, "acc.seen": 0.5},  # neither client picked
        {"round": 2, "epsilon.c2": 4.0, "sigma.c2": 0.9, "budget_spent.c2": 0.0},
        {"round": 3, "epsilon.c2": 4.0, "sigma.c2": 0.9, "budget_spent.c2": 1.0},
        {"round": 4, "epsilon.c10": 2.0, "sigma.c10": math.nan, "budget_spent.c10": 1.0},
    ]
    lines = round_ledger_lines(records, budget=4.0)
    assert [(r, k) for r, k, _ in lines] == [(0, 2), (0, 10), (2, 2), (3, 2), (4, 10)]
    assert [line["eps_round"] for _, _, line in lines] == [1.5, 2.0, 2.5, 0.0, 0.0]
    assert [line["eps_budget_remaining"] for _, _, line in lines] == [2.5, 2.0, 0.0, 0.0, 2.0]
    assert [line["privacy_refused"] for _, _, line in lines] == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert lines[-1][2]["privacy_sigma"] == 0.8  # a refused line carries the client's σ, finite, as private TTA's
    arrival = Ledger(PrivacyConfig(mode="dp", epsilon=1.0, budget=4.0), uses=1).record(0, refused=False)
    assert set(lines[0][2]) == set(arrival) - {"eps_arrival"} | {"eps_round"}  # one ledger format, two systems


def test_server_state_round_trips_and_selection_picks_unseen_clients_first():
    s = PPFCIL(max_wait=3)
    g = {"w": torch.zeros(2), "task": torch.tensor(0)}
    s.setup(g, num_clients=6, param_keys=["w"])
    picked = s.select(0, [0, 1], num_clients=6)
    s.aggregate(g, [(i, _update(0.5 + 0.1 * i)) for i in picked], num_clients=6)
    again = s.select(1, [0, 1], num_clients=6)
    assert not set(again) & set(picked)  # clients with no report come before any that reported
    t = PPFCIL(max_wait=3)
    t.setup(g, num_clients=6, param_keys=["w"])
    t.load_state_dict(s.state_dict())
    assert _same(t.state_dict(), s.state_dict())


def test_evaluation_masks_unseen_classes_and_summarises_tasks():
    recs = [
        {"round": 0, "task": 0, "acc.seen": 1.0, "acc.task0": 1.0},
        {"round": 1, "task": 1, "acc.seen": 0.7, "acc.task0": 0.6, "acc.task1": 0.8},
    ]
    m = task_end_metrics(recs)
    assert m["avg_inc_acc"] == pytest.approx(0.85) and m["forgetting"] == pytest.approx(0.4)
    assert m["final_acc"] == pytest.approx(0.7)
    spec = ModelSpec(name="dual-cnn", in_channels=1, num_classes=4)
    torch.manual_seed(0)
    state = spec.build().state_dict()
    state["fc.bias"] = torch.tensor([0.0, 0.0, 100.0, 100.0])  # classes 2, 3 would win, but are not seen yet
    x = np.zeros((4, 16, 16, 1), np.uint8)
    out = incremental_evaluate(state, spec=spec, test=(x, np.array([0, 1, 0, 1])), task_classes=[[0, 1], [2, 3]])
    assert out["model_task"] == 0 and out["acc.seen"] == pytest.approx(0.5) and "acc.task1" not in out
    assert math.isfinite(out["worst_acc"])


def test_a_staged_run_scored_by_the_default_evaluation_still_returns_its_records(digits):
    data, spec, cfg, _ = _setup(digits, tasks=2, rounds_per_task=1, trainer=dict(compress="none"))
    cfg = RoundConfig(**{**cfg.__dict__, "rounds": 2})
    res = run_rounds(data, spec, cfg)  # accuracy on the whole test set, no acc.seen: no incremental summary
    assert len(res.records) == 2 and "avg_inc_acc" not in res.summary and "final_acc.test" in res.summary


def test_clip_only_is_classic_dp_sgd_without_its_noise_and_without_a_budget(digits, monkeypatch):
    kw = dict(PRIVATE, privacy="clip", sample_rate=0.25, epsilon=1e-3)
    _, clip = _round(digits, task=0, round_index=0, n=40, norm="group", **kw)
    # a budget classic DP cannot even calibrate for: clip-only promises nothing, so it takes every step
    with pytest.raises(ValueError, match="budget is too low"):
        _round(digits, task=0, round_index=0, n=40, norm="group", **{**kw, "privacy": "dp"})
    assert clip.metrics["steps"] == 4  # 1 epoch / q = 0.25
    assert (
        clip.metrics["sigma"] == 0.0 and "epsilon" not in clip.metrics and "epsilon" not in clip.client_state["ledger"]
    )
    # with DP's noise drawn as zeros, DP-SGD takes exactly clip-only's steps
    zeros = lambda *shape, generator=None, **_: torch.zeros(*shape)  # noqa: E731
    monkeypatch.setattr(torch, "randn", zeros)
    _, clip0 = _round(digits, task=0, round_index=0, n=40, norm="group", **kw)
    _, dp0 = _round(digits, task=0, round_index=0, n=40, norm="group", **{**kw, "privacy": "dp", "epsilon": 50.0})
    assert dp0.metrics["sigma"] > 0 and dp0.metrics["steps"] == clip0.metrics["steps"] == 4
    assert all(torch.equal(dp0.state[k], clip0.state[k]) for k in clip0.state)
    assert not all(torch.equal(clip.state[k], clip0.state[k]) for k in clip.state)  # noise draws move the sampling


def test_lbdp_with_the_ucb_estimator_spends_no_more_than_its_budget_and_adds_more_noise(digits):
    kw = dict(PRIVATE, sample_rate=0.25, epsilon=4.0, clip_norm=50.0)  # a C most gradients stay below: a spread
    assert create_trainer("fcil").bdp_estimator == "ucb"  # the BDP paper's form is the default
    _, mean = _round(digits, task=0, round_index=0, n=40, norm="group", bdp_estimator="mean", **kw)
    _, ucb = _round(digits, task=0, round_index=0, n=40, norm="group", **kw)
    for upd in (mean, ucb):  # each stops before a step its own estimate cannot afford
        assert 0 < upd.metrics["epsilon"] <= 4.0 + 1e-9 and upd.metrics["steps"] >= 1
    # an upper bound on the expected cost is above the mean: the same ε costs more of the budget
    assert ucb.metrics["epsilon"] > mean.metrics["epsilon"]
    with pytest.raises(ValueError, match="bdp_estimator=ucb needs at least 2 samples .* this client has 1"):
        _round(digits, task=0, round_index=0, n=1, norm="group", bdp_sigma_from="probe", **kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(bdp_estimator="max"), "bdp_estimator"),
        (dict(bdp_confidence=1.0), r"bdp_confidence .* must be in \(0, 1\)"),
        (dict(epsilon_conversion="rdp"), "epsilon_conversion"),
        (dict(bdp_sigma_from="batch"), "bdp_sigma_from"),
    ],
)
def test_bad_bdp_estimator_settings_name_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        create_trainer("fcil", **kw)


# ------------------------------------------------------------------------------------ NbAFL
def test_nbafl_noise_std_is_the_gaussian_mechanism_at_epsilon_over_uploads():
    from fedcore.privacy.nbafl import nbafl_std

    # by hand: L = 9 uploads, δ_e = 1e-5 / 9, c = sqrt(2 ln(1.25 · 9 / 1e-5)) = 5.2789, ΔS = 2 · 1 / 100,
    # ε_e = 8 / 9: σ_u = 5.2789 · 0.02 / 0.8889 = 0.11878
    assert nbafl_std(clip_norm=1.0, num_samples=100, exposures=9, epsilon=8.0, delta=1e-5) == pytest.approx(
        0.11878, abs=1e-5
    )
    # linear in C and 1/m; a larger budget buys less noise
    base = nbafl_std(clip_norm=1.0, num_samples=100, exposures=9, epsilon=4.0, delta=1e-5)
    assert nbafl_std(clip_norm=3.0, num_samples=300, exposures=9, epsilon=4.0, delta=1e-5) == pytest.approx(base)
    assert nbafl_std(clip_norm=1.0, num_samples=100, exposures=9, epsilon=8.0, delta=1e-5) < base
    with pytest.raises(ValueError, match=r"ε < 1 per upload.* Lower epsilon below 9"):
        nbafl_std(clip_norm=1.0, num_samples=100, exposures=9, epsilon=9.0, delta=1e-5)


def test_nbafl_clips_the_update_jointly_and_adds_noise_of_its_std():
    from fedcore.privacy.nbafl import clip_and_noise

    u = {"a": torch.full((3,), 2.0), "b": torch.full((1,), 2.0)}  # norm 4
    out, norm = clip_and_noise(u, clip_norm=1.0, std=0.0, generator=torch.Generator().manual_seed(0))
    assert norm == pytest.approx(4.0) and float(torch.cat([out["a"], out["b"]]).norm()) == pytest.approx(1.0)
    assert torch.allclose(out["a"], torch.full((3,), 0.5))  # scaled, direction kept
    small, _ = clip_and_noise({"a": torch.full((4,), 0.1)}, clip_norm=1.0, std=0.0, generator=torch.Generator())
    assert torch.equal(small["a"], torch.full((4,), 0.1))  # below C: untouched
    noisy, _ = clip_and_noise(
        {"a": torch.zeros(200_000)}, clip_norm=1.0, std=0.3, generator=torch.Generator().manual_seed(0)
    )
    assert float(noisy["a"].std()) == pytest.approx(0.3, rel=0.01) and abs(float(noisy["a"].mean())) < 0.003


def test_nbafl_sends_plain_training_clipped_to_c_spends_one_upload_a_round_and_stops_after_the_plan(
    digits, monkeypatch
):
    kw = dict(rho=0.0, classifier_loss="plain", exemplars="random", noise_source="seeded")
    _, plain = _round(digits, task=0, round_index=0, n=60, norm="group", **kw)
    spec = ModelSpec(name="dual-lenet", in_channels=1, num_classes=10, norm="group")
    torch.manual_seed(0)
    init = spec.build().state_dict()  # the weights _round starts from
    zeros = lambda *shape, generator=None, **_: torch.zeros(*shape)  # noqa: E731
    monkeypatch.setattr(torch, "randn", zeros)
    _, nb = _round(digits, task=0, round_index=0, n=60, norm="group", privacy="nbafl", epsilon=4.0, clip_norm=0.5, **kw)
    keys = [k for k in init if init[k].is_floating_point() and not torch.equal(plain.state[k], init[k])]
    d_plain = torch.cat([(plain.state[k] - init[k]).flatten() for k in keys])
    d_nb = torch.cat([(nb.state[k] - init[k]).flatten() for k in keys])
    assert float(d_plain.norm()) > 0.5  # the clip binds
    assert torch.allclose(d_nb, d_plain * (0.5 / d_plain.norm()), atol=1e-6)  # noise as zeros: the clipped update
    ledger = nb.client_state["ledger"]
    assert ledger["uploads"] == 1 and ledger["planned"] == 6  # ⌈6 rounds · F = 1⌉
    assert nb.metrics["epsilon"] == pytest.approx(4.0 / 6) and nb.metrics["update_norm"] == pytest.approx(
        float(d_plain.norm()), rel=1e-5
    )
    # the sixth upload spends the budget; the seventh round sends nothing
    done = {**nb.client_state, "ledger": {**ledger, "uploads": 5}}
    nbafl = dict(kw, privacy="nbafl", epsilon=4.0)
    _, last = _round(digits, task=0, round_index=1, n=60, norm="group", client_state=done, **nbafl)
    assert last.metrics["epsilon"] == pytest.approx(4.0) and not last.payload["stopped"]
    _, after = _round(digits, task=0, round_index=1, n=60, norm="group", client_state=last.client_state, **nbafl)
    assert after.payload["stopped"] and after.metrics["steps"] == 0 and after.num_examples == 0
    # with the noise drawn: what is sent is the clipped update plus N(0, σ_u²) in every coordinate
    monkeypatch.undo()
    _, noisy = _round(
        digits, task=0, round_index=0, n=60, norm="group", privacy="nbafl", epsilon=4.0, clip_norm=0.5, **kw
    )
    d_noisy = torch.cat([(noisy.state[k] - init[k]).flatten() for k in keys])
    sigma_u = noisy.metrics["sigma"] * 0.5
    assert float((d_noisy - d_nb).std()) == pytest.approx(sigma_u, rel=0.02) and sigma_u > 0.01
    assert noisy.payload["accuracy"] != nb.payload["accuracy"]  # the report describes the noised model it sends
    # without NbAFL's averaging assumption one record can move the clipped update by 2C, not 2C/m: m times the noise
    _, worst = _round(digits, task=0, round_index=0, n=60, norm="group", nbafl_sensitivity="worst", **nbafl)
    m = nb.payload["new_examples"]  # the 54 of the 60 samples it trains on (6 held out to report on)
    assert m == 54 and worst.metrics["sigma"] == pytest.approx(m * nb.metrics["sigma"])  # σ = std / C: C cancels


@pytest.mark.parametrize("privacy", ["dp", "nbafl"])
def test_private_noise_is_secure_by_default_and_seeded_only_when_asked(digits, privacy):
    kw = dict(rho=0.0, classifier_loss="plain", exemplars="random", privacy=privacy, epsilon=4.0, sample_rate=0.5)
    assert create_trainer("fcil", **kw).noise_source == "secure"
    runs = {
        src: [_round(digits, task=0, round_index=0, n=40, norm="group", noise_source=src, **kw)[1] for _ in range(2)]
        for src in ("secure", "seeded")
    }
    weights = lambda u: torch.cat([v.flatten().float() for v in u.state.values()])  # noqa: E731
    # the same seed: seeded noise (and sampling) is the same bit for bit; OS entropy never is
    assert torch.equal(weights(runs["seeded"][0]), weights(runs["seeded"][1]))
    assert not torch.equal(weights(runs["secure"][0]), weights(runs["secure"][1]))
    for upd in runs["secure"]:  # the account does not depend on where the noise came from
        assert 0 < upd.metrics["epsilon"] <= 4.0 + 1e-9
    with pytest.raises(ValueError, match="noise_source"):
        create_trainer("fcil", noise_source="urandom")
