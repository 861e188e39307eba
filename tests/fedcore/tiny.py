"""A tiny digits federation built from fedcore alone: scikit-learn's digits, four corrupted target clients,
three source clients and a FedAvg source model. The same settings as the stage code's ``data=digits`` run with
``tests.helpers.tiny_overrides`` (``tests/flows/test_fixtures.py`` checks that both give the same arrays and
weights)."""

from __future__ import annotations

import os
from typing import Any, Dict

import torch

from fedcore.data import build_partition, load_dataset
from fedcore.engine import RoundConfig, run_rounds, source_round_data
from fedcore.types import ModelSpec

DIGITS = dict(
    dataset="digits",
    num_source_clients=3,
    dirichlet_alpha=1.0,
    corruptions=["gaussian_noise", "defocus_blur", "contrast", "fog"],
    severity=3,
    stream_size=192,
    holdout_size=96,
    stream_order="shuffled",
    source_fraction=0.5,
    source_test_fraction=0.2,
    holdout_fraction=0.3,
    official_train_size=None,
)
PRETRAIN = RoundConfig(
    rounds=8,
    trainer="sgd",
    strategy="fedavg",
    seed=0,
    device="cpu",
    trainer_params={
        "local_epochs": 2,
        "lr": 0.1,
        "batch_size": 32,
        "momentum": 0.9,
        "weight_decay": 0.0005,
        "augment": False,
        "lr_schedule": "constant",
        "channels_last": False,
    },
)


def threads_per_test() -> int:
    """Torch threads a test process uses: 2, one per core here, or 1 under pytest-xdist, where the two
    workers already fill both cores and two threads each would wait on one another."""
    return 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


def build_tiny(*, seed: int = 0, norm: str = "batch", local_epochs: int | None = None) -> Dict[str, Any]:
    """``{"partition", "spec", "source"}``: the partition, the CNN's spec and its FedAvg-pretrained weights."""
    part = build_partition(load_dataset("digits"), seed=seed, **DIGITS)  # type: ignore[arg-type]
    spec = ModelSpec(name="cnn", in_channels=1, num_classes=10, norm=norm)
    pcfg = PRETRAIN
    if local_epochs is not None:
        from dataclasses import replace

        pcfg = replace(pcfg, trainer_params={**pcfg.trainer_params, "local_epochs": local_epochs})
    torch.set_num_threads(threads_per_test())
    state = run_rounds(source_round_data(part), spec, pcfg).final_state
    return {"partition": part, "spec": spec, "source": state}
