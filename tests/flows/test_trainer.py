"""The sgd trainer's loop options that the CIFAR-10-C source model uses: per-image augmentation,
the cosine lr over the whole run, and the channels-last layout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from omegaconf import open_dict
from torch import nn

from fedcore.engine import ModelSpec
from fedcore.train import augment_batch, create_trainer
from flows.config import compose as C


def colour_images(n: int = 48, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.random((n, 32, 32, 3)).astype(np.float32), rng.integers(0, 10, n)


def train(spec: ModelSpec, x, y, broadcast=None, **settings):
    torch.manual_seed(0)
    model = spec.build()
    return create_trainer("sgd", **{"lr": 0.05, "batch_size": 16, **settings}).train(
        model, x, y, global_state=model.state_dict(), seed=3, broadcast=broadcast
    )


RESNET = ModelSpec(name="resnet20", in_channels=3, num_classes=10)


def test_augment_true_is_the_batch_mode():
    x, y = colour_images()
    a, b = train(RESNET, x, y, augment=True), train(RESNET, x, y, augment="batch")
    assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)


def test_per_sample_augmentation_crops_and_flips_each_image_on_its_own():
    x = torch.arange(64 * 3 * 8 * 8, dtype=torch.float32).reshape(64, 3, 8, 8)
    out = augment_batch(x, torch.Generator().manual_seed(0), per_sample=True)
    padded = nn.functional.pad(x, (2, 2, 2, 2), mode="reflect")
    found = set()
    for i in range(len(x)):
        hits = [
            (dy, dx, flip)
            for dy in range(5)
            for dx in range(5)
            for flip in (False, True)
            if torch.equal(out[i], (lambda w: w.flip(2) if flip else w)(padded[i, :, dy : dy + 8, dx : dx + 8]))
        ]
        assert hits, f"image {i} is not a 2-pixel crop (or its mirror) of its own padded image"
        found.add(hits[0])
    assert len({(dy, dx) for dy, dx, _ in found}) > 5 and {f for *_, f in found} == {False, True}


def test_grey_images_are_not_flipped():
    x = torch.rand(32, 1, 8, 8)
    out = augment_batch(x, torch.Generator().manual_seed(1), per_sample=True)
    padded = nn.functional.pad(x, (2, 2, 2, 2), mode="reflect")
    for i in range(len(x)):
        assert any(torch.equal(out[i], padded[i, :, dy : dy + 8, dx : dx + 8]) for dy in range(5) for dx in range(5))


def test_cosine_lr_starts_at_lr_falls_monotonically_and_ends_near_zero():
    t = create_trainer("sgd", lr=0.1, lr_schedule="cosine")
    lrs = [t.scheduled_lr({"round": r, "rounds": 4}, p) for r in range(4) for p in np.linspace(0, 1, 5)[:-1]]
    assert lrs[0] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(lrs, lrs[1:]))
    assert t.scheduled_lr({"round": 3, "rounds": 4}, 1.0) == pytest.approx(0.0, abs=1e-12)
    assert t.scheduled_lr({"round": 2, "rounds": 4}, 0.0) == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi / 2)))


def test_without_a_broadcast_round_the_cosine_schedule_is_refused():
    x, y = colour_images(8)
    with pytest.raises(ValueError, match="reads the round from the server's broadcast"):
        train(ModelSpec(name="cnn", in_channels=3, num_classes=10), x, y, lr_schedule="cosine")


def test_the_loop_steps_the_schedule_through_every_local_step_of_every_epoch(monkeypatch):
    x, y = colour_images(40)  # batches of 16: 3 steps an epoch, the last one short
    trainer = create_trainer("sgd", lr=0.1, batch_size=16, local_epochs=2, lr_schedule="cosine")
    seen = []
    real = trainer.scheduled_lr
    monkeypatch.setattr(trainer, "scheduled_lr", lambda b, progress: seen.append(progress) or real(b, progress))
    model = ModelSpec(name="cnn", in_channels=3, num_classes=10).build()
    trainer.train(model, x, y, global_state=model.state_dict(), seed=0, broadcast={"round": 1, "rounds": 4})
    assert seen == pytest.approx([0, 1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6])


def test_a_constant_schedule_ignores_the_round():
    x, y = colour_images()
    spec = ModelSpec(name="cnn", in_channels=3, num_classes=10)
    first = train(spec, x, y, broadcast={"round": 0, "rounds": 2})
    late = train(spec, x, y, broadcast={"round": 1, "rounds": 2})
    cosine_late = train(spec, x, y, lr_schedule="cosine", broadcast={"round": 1, "rounds": 2})
    assert all(torch.equal(first.state[k], late.state[k]) for k in first.state)
    assert any(not torch.equal(first.state[k], cosine_late.state[k]) for k in first.state)


def test_channels_last_trains_the_same_model_in_the_other_layout_and_returns_the_usual_one():
    x, y = colour_images(32)
    torch.manual_seed(0)
    model = RESNET.build()
    layouts = []
    model.conv1.register_forward_pre_hook(
        lambda m, a: layouts.append(
            (
                a[0].is_contiguous(memory_format=torch.channels_last),
                m.weight.is_contiguous(memory_format=torch.channels_last),
            )
        )
    )
    b = create_trainer("sgd", lr=0.05, batch_size=16, channels_last=True).train(
        model, x, y, global_state=model.state_dict(), seed=3
    )
    assert layouts and all(inp and w for inp, w in layouts), "the option must train in the channels-last layout"
    assert all(p.is_contiguous() for p in model.parameters()), "the caller's model is left in the usual layout"
    a = train(RESNET, x, y)
    for k, v in b.state.items():
        assert v.is_contiguous(), k
        torch.testing.assert_close(v, a.state[k], rtol=1e-3, atol=1e-4)
    assert b.metrics["train_loss"] == pytest.approx(a.metrics["train_loss"], rel=1e-4)


def test_what_a_trainer_keeps_for_the_server_stays_in_the_usual_layout():
    x, y = colour_images(32)
    torch.manual_seed(0)
    model = RESNET.build()
    upd = create_trainer("scaffold", lr=0.05, batch_size=16, channels_last=True).train(
        model, x, y, global_state=model.state_dict(), seed=3
    )
    kept = [*upd.client_state["c_i"].values(), *upd.payload["delta_c"].values()]
    assert kept and all(t.is_contiguous() for t in kept)


@pytest.mark.parametrize(
    "name, why", [("scaffold", "control variates divide by the lr"), ("proser", "path integral takes the lr")]
)
def test_trainers_whose_arithmetic_assumes_a_constant_lr_refuse_the_schedule(name, why):
    with pytest.raises(ValueError, match=f"needs lr_schedule=constant: .*{why}"):
        create_trainer(name, lr_schedule="cosine")


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(augment="crop"), "augment must be true, false or one of none, batch, sample"),
        (dict(lr_schedule="step"), "lr_schedule must be one of constant, cosine"),
    ],
)
def test_bad_loop_settings_name_the_valid_ones(kw, match):
    with pytest.raises(ValueError, match=match):
        create_trainer("sgd", **kw)


@pytest.mark.parametrize("kw", [dict(lr_schedule="cosine"), dict(channels_last=True), dict(augment="sample")])
def test_the_fcil_trainer_refuses_loop_options_its_own_loop_does_not_honour(kw):
    with pytest.raises(ValueError, match="runs its own loop"):
        create_trainer("fcil", **kw)


def test_pretrain_passes_its_settings_to_the_trainer_and_refuses_a_misspelt_one():
    cfg = C.compose(["variant=cifar10"])
    trainer = C.pretrain_config(cfg).make_trainer()
    assert (trainer.augment_mode, trainer.lr_schedule, trainer.channels_last) == ("sample", "cosine", True)
    assert cfg.data.num_source_clients == 1  # the variant's own data setting wins over conf/data/cifar10.yaml
    with open_dict(cfg):  # a params.yaml edited by hand; a Hydra override of an unknown key fails before this
        cfg.pretrain["lr_shedule"] = "cosine"
    with pytest.raises((TypeError, ValueError), match="lr_shedule"):
        C.pretrain_config(cfg)


def test_a_round_client_step_runs_with_the_cpus_it_was_given_and_gives_them_back(monkeypatch):
    from flows.runs import worker

    seen = []
    monkeypatch.setattr(worker, "train_step", lambda **kw: seen.append(torch.get_num_threads()) or "update")
    before = torch.get_num_threads()
    assert worker.train_step_or_fail(threads=3) == "update"
    assert seen == [3] and torch.get_num_threads() == before
