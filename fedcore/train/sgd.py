"""FedAvg's client: plain local SGD (cross-entropy)."""

from __future__ import annotations

from fedcore.train.base import TRAINERS, LocalTrainer


@TRAINERS.register("sgd")
class SGDTrainer(LocalTrainer):
    """Cross-entropy, local SGD; the settings are :class:`~fedcore.train.base.LocalTrainer`'s."""
