"""Local training on a labelled client: the loop, written once, and the trainer registry.

A trainer is a small object holding its settings (keyword-only, defaults written once). Its
:meth:`LocalTrainer.train` runs local SGD from the global model and returns a
:class:`ClientUpdate`. Subclasses change the loop through three hooks, never by copying it:

* :meth:`~LocalTrainer.begin`: read what the server broadcast and this client's saved state;
* :meth:`~LocalTrainer.loss`: the batch loss (default: cross-entropy);
* :meth:`~LocalTrainer.after_backward`: correct the gradients before the optimizer step;
* :meth:`~LocalTrainer.finish`: what goes back to the server besides the weights.
"""

from __future__ import annotations

import math
from typing import Any, Dict

import numpy as np
import torch
from torch import nn

from fedcore.registry import Registry
from fedcore.tensors import batches, state_to_cpu, to_tensor
from fedcore.types import ClientUpdate, State


class LocalTrainer:
    """Plain local SGD with momentum and weight decay over ``local_epochs`` of the client's data.

    Parameters
    ----------
    lr, momentum, weight_decay:
        SGD settings (the FedPAD paper: momentum 0.9, weight decay 5e-4).
    local_epochs:
        Passes over the client's data per round (E).
    batch_size:
        Mini-batch size.
    augment:
        Random 2-pixel crops (and horizontal flips on colour images): ``True`` or ``"batch"`` draws
        one crop and one flip for the whole batch; ``"sample"`` draws them per image (the usual
        CIFAR recipe); ``False`` or ``"none"`` turns augmentation off.
    lr_schedule:
        ``"constant"``, or ``"cosine"``: the lr decays from ``lr`` towards 0 along a half cosine
        over the whole run, step by step, read from the round the server broadcasts
        (``round`` of ``rounds``; training without them is refused). The optimiser, and so its
        momentum, starts afresh every round, as in FedAvg.
    channels_last:
        Train in the channels-last memory layout. Same arithmetic, other kernels: on CPU a
        ResNet-20 step is about 2x faster; the floats differ in the last bits, so it is off by
        default and the weights go back in the standard layout.
    """

    AUGMENT_MODES = ("none", "batch", "sample")
    LR_SCHEDULES = ("constant", "cosine")
    constant_lr_because: str | None = None  # a subclass whose arithmetic assumes the lr it was given says why

    def __init__(
        self,
        *,
        lr: float = 0.05,
        local_epochs: int = 1,
        batch_size: int = 64,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        augment: bool | str = False,
        lr_schedule: str = "constant",
        channels_last: bool = False,
    ) -> None:
        if lr <= 0:
            raise ValueError(f"trainer lr must be > 0, got {lr}")
        if local_epochs < 1 or batch_size < 1:
            raise ValueError(f"trainer local_epochs and batch_size must be >= 1, got {local_epochs}, {batch_size}")
        if not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"need 0 <= momentum < 1 and weight_decay >= 0, got {momentum}, {weight_decay}")
        self.lr, self.local_epochs, self.batch_size = float(lr), int(local_epochs), int(batch_size)
        mode = {True: "batch", False: "none"}.get(augment, augment) if isinstance(augment, bool) else str(augment)
        if mode not in self.AUGMENT_MODES:
            raise ValueError(f"augment must be true, false or one of {', '.join(self.AUGMENT_MODES)}; got {augment!r}")
        if lr_schedule not in self.LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {', '.join(self.LR_SCHEDULES)}; got {lr_schedule!r}")
        if lr_schedule != "constant" and self.constant_lr_because:
            raise ValueError(f"this trainer needs lr_schedule=constant: {self.constant_lr_because}")
        self.momentum, self.weight_decay = float(momentum), float(weight_decay)
        self.augment_mode, self.augment = mode, mode != "none"
        self.lr_schedule, self.channels_last = str(lr_schedule), bool(channels_last)

    needs_features = False  # True when the trainer reads the penultimate features (embed_and_classify)

    # ------------------------------------------------------------------ hooks
    def begin(
        self, model: nn.Module, *, global_state: State, broadcast: Dict[str, Any], client_state: Dict[str, Any]
    ) -> None:
        """Called once before training, with the model already holding the global weights."""

    def round_lr(self, broadcast: Dict[str, Any]) -> float:
        """The learning rate this round starts at (``lr``; a trainer with phases may change it per round)."""
        return self.lr

    def loss(self, model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(xb), yb)

    def after_backward(self, model: nn.Module) -> None:
        """Called after each backward pass, before the optimizer step."""

    def finish(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, steps: int
    ) -> tuple[Dict[str, Any], Dict[str, Any]]:
        """``(client_state, payload)`` to send back; ``steps`` is the number of SGD steps taken."""
        return {}, {}

    # ------------------------------------------------------------------ the loop
    def train(
        self,
        model: nn.Module,
        x: np.ndarray,
        y: np.ndarray,
        *,
        global_state: State,
        seed: int,
        broadcast: Dict[str, Any] | None = None,
        client_state: Dict[str, Any] | None = None,
        device: torch.device | str = "cpu",
    ) -> ClientUpdate:
        """Train ``model`` (already holding ``global_state``) in place; return the client's update."""
        g = torch.Generator().manual_seed(seed)
        broadcast = broadcast or {}
        if self.lr_schedule != "constant" and not {"round", "rounds"} <= set(broadcast):
            raise ValueError(
                f"lr_schedule={self.lr_schedule} reads the round from the server's broadcast "
                "(round, rounds); train through the round engine, or set lr_schedule=constant"
            )
        model.to(device).train()
        self.begin(model, global_state=global_state, broadcast=broadcast, client_state=client_state or {})
        if self.channels_last:  # after begin: what it keeps (SCAFFOLD's c_i, FedDyn's memory) stays in the usual layout
            model.to(memory_format=torch.channels_last)
        try:
            return self._loop(model, x, y, broadcast=broadcast, g=g, device=device)
        finally:
            if self.channels_last:
                model.to(memory_format=torch.contiguous_format)

    def _loop(
        self,
        model: nn.Module,
        x: np.ndarray,
        y: np.ndarray,
        *,
        broadcast: Dict[str, Any],
        g: torch.Generator,
        device: torch.device | str,
    ) -> ClientUpdate:
        opt = torch.optim.SGD(
            model.parameters(), lr=self.round_lr(broadcast), momentum=self.momentum, weight_decay=self.weight_decay
        )
        xt, yt = to_tensor(x, device=device), torch.as_tensor(np.array(y), device=device)
        total, count, steps = 0.0, 0, 0
        per_round = self.local_epochs * len(range(0, len(xt), self.batch_size))
        for _ in range(self.local_epochs):
            perm = torch.randperm(len(xt), generator=g).to(device)
            for sl in batches(len(xt), self.batch_size):
                idx = perm[sl]
                xb, yb = xt[idx], yt[idx]
                if self.augment:
                    xb = augment_batch(xb, g, per_sample=self.augment_mode == "sample")
                if self.channels_last:
                    xb = xb.contiguous(memory_format=torch.channels_last)
                if self.lr_schedule != "constant":
                    for group in opt.param_groups:
                        group["lr"] = self.scheduled_lr(broadcast, steps / per_round)
                loss = self.loss(model, xb, yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                self.after_backward(model)
                opt.step()
                total += float(loss.detach()) * len(idx)
                count += len(idx)
                steps += 1
        if self.channels_last:
            model.to(memory_format=torch.contiguous_format)  # finish and the weights see the usual layout
        client_state, payload = self.finish(model, xt, yt, steps=steps)
        return ClientUpdate(
            state=state_to_cpu(model.state_dict()),
            num_examples=len(xt),
            metrics={"train_loss": total / max(count, 1)},
            client_state=client_state,
            payload=payload,
        )

    def scheduled_lr(self, broadcast: Dict[str, Any], progress: float) -> float:
        """The lr at ``progress`` (0 to 1) through this round's local steps, under ``lr_schedule``."""
        if self.lr_schedule == "constant":
            return self.lr
        t = (int(broadcast["round"]) + progress) / max(int(broadcast["rounds"]), 1)
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * min(max(t, 0.0), 1.0)))


def augment_batch(x: torch.Tensor, g: torch.Generator, *, per_sample: bool = False) -> torch.Tensor:
    """Random 2-pixel crops (reflect-padded) and, for colour, coin-flip horizontal flips.

    One crop and one flip for the whole batch, or with ``per_sample`` one of each per image.
    """
    n, c, h, w = x.shape
    padded = nn.functional.pad(x, (2, 2, 2, 2), mode="reflect")
    if not per_sample:
        dy, dx = torch.randint(0, 5, (2,), generator=g).tolist()
        x = padded[:, :, dy : dy + h, dx : dx + w]
        if c == 3 and bool(torch.rand(1, generator=g) < 0.5):
            x = x.flip(3)
        return x
    dev = x.device
    shift = torch.randint(0, 5, (n, 2), generator=g).to(dev)
    rows = (shift[:, :1] + torch.arange(h, device=dev))[:, None, :, None]
    cols = (shift[:, 1:] + torch.arange(w, device=dev))[:, None, None, :]
    x = padded[
        torch.arange(n, device=dev)[:, None, None, None], torch.arange(c, device=dev)[None, :, None, None], rows, cols
    ]
    if c == 3:
        flip = (torch.rand(n, generator=g) < 0.5).to(x.device)[:, None, None, None]
        x = torch.where(flip, x.flip(3), x)
    return x


def params_of(model: nn.Module) -> Dict[str, nn.Parameter]:
    return dict(model.named_parameters())


TRAINERS: Registry[LocalTrainer] = Registry("trainer")


def create_trainer(name: str, **settings) -> LocalTrainer:
    """A trainer by name, e.g. ``create_trainer("prox", mu=0.01, lr=0.01)``; bad names and settings list the valid
    ones."""
    return TRAINERS.create(name, **settings)
