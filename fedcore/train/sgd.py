"""Plain local SGD, the client step of FedAvg."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedcore.tensors import batches, state_to_cpu, to_tensor


@dataclass
class LocalResult:
    state: dict
    num_examples: int
    loss: float


def train_client(model: nn.Module, x: np.ndarray, y: np.ndarray, *, epochs: int, lr: float, batch_size: int,
                 momentum: float = 0.9, weight_decay: float = 5e-4, seed: int, device: torch.device | str = "cpu",
                 augment: bool = False) -> LocalResult:
    """Train ``model`` in place for ``epochs`` over (x, y); returns its CPU state dict.

    Augmentation (random crop with 2-pixel padding and, for colour images, horizontal flips)
    is off by default; it is worth having on CIFAR.
    """
    if epochs < 1 or lr <= 0 or batch_size < 1:
        raise ValueError(f"need epochs >= 1, lr > 0, batch_size >= 1; got {epochs}, {lr}, {batch_size}")
    g = torch.Generator().manual_seed(seed)
    model.to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    xt, yt = to_tensor(x, device=device), torch.as_tensor(np.array(y), device=device)
    total, count = 0.0, 0
    for _ in range(epochs):
        perm = torch.randperm(len(xt), generator=g).to(device)
        for sl in batches(len(xt), batch_size):
            idx = perm[sl]
            xb, yb = xt[idx], yt[idx]
            if augment:
                xb = _augment(xb, g)
            loss = nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
            count += len(idx)
    return LocalResult(state=state_to_cpu(model.state_dict()), num_examples=len(xt), loss=total / max(count, 1))


def _augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    n, c, h, w = x.shape
    padded = nn.functional.pad(x, (2, 2, 2, 2), mode="reflect")
    dy, dx = torch.randint(0, 5, (2,), generator=g).tolist()
    x = padded[:, :, dy:dy + h, dx:dx + w]
    if c == 3 and bool(torch.rand(1, generator=g) < 0.5):
        x = x.flip(3)
    return x
