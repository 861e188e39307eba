"""PP-FCIL's dual model: a frozen old extractor Φ_old, a trainable new one Φ_new, and their fusion.

    λ = σ(W₂ ReLU(W₁ F_old))            (channel attention over F_old, per feature channel)
    F_mix = F_old ⊗ λ + F_new ⊗ (1 − λ)
    logits = fc(F_mix)                   (one classifier over every class of the schedule; the
                                          classes not seen yet are masked by the caller)

Besides the two branches the network carries what the rest of the method needs, so that one
``state_dict`` is the whole global model the server averages:

* ``old_fc``: the classifier frozen with Φ_old at the last task switch. ``old_fc(Φ_old(x))`` is
  the teacher of the distillation loss L_D (the previous task's model).
* ``single``: the one-branch network the dual model is compressed into (L_M) at the end of a task;
  it becomes the next Φ_old.
* ``proj``: the projection head of the supervised contrastive loss L_S, on Φ_new's features.
* Buffers ``task`` (the task the weights belong to), ``has_old`` (0 during the first task, when
  there is no old knowledge and F_mix = F_new), ``fuse`` (0: the single-branch ablation, where
  F_mix = F_new and Φ_old only teaches) and ``phase`` (1 after a compression round, when the model
  to use is ``single``).

Integer buffers are counters, not estimates: the server copies them instead of averaging.
"""

from __future__ import annotations

from typing import Tuple, cast

import torch
from torch import nn

from fedcore.models.base import MODELS, FeatureNet, check_feature_layer

NEW_INITS = ("random", "old")


def _backbone(name: str, *, in_channels: int, norm: str) -> Tuple[nn.Module, int]:
    """A registered network without its classifier (``embed`` only) and its feature width."""
    net = MODELS.create(name, in_channels=in_channels, num_classes=2, norm=norm)
    check_feature_layer(net)
    width = int(cast(nn.Linear, net.fc).in_features)  # every registered model's head is a Linear
    net.fc = nn.Identity()  # the dual model's own classifier replaces it; no dead weights in the state
    return net, width


class DualNet(nn.Module):
    """Φ_old, Φ_new, the fusion, the classifier(s), the compression target and the projection head.

    Parameters
    ----------
    backbone:
        A registered model with a feature layer (``cnn``, ``lenet``, ``resnet20``, ``resnet18``).
    reduction:
        Width ratio of the fusion MLP (FC d → d/r, ReLU, FC d/r → d, Sigmoid), as in squeeze-and-excitation.
    proj_dim:
        Output width of the contrastive projection head.
    """

    # buffers (registered in __init__)
    task: torch.Tensor
    has_old: torch.Tensor
    phase: torch.Tensor
    fuse: torch.Tensor

    def __init__(
        self,
        *,
        backbone: str = "lenet",
        in_channels: int = 1,
        num_classes: int = 10,
        norm: str = "batch",
        reduction: int = 4,
        proj_dim: int = 64,
    ) -> None:
        super().__init__()
        if reduction < 1 or proj_dim < 1:
            raise ValueError(f"reduction and proj_dim must be >= 1, got {reduction}, {proj_dim}")
        self.backbone_name, self.in_channels, self.norm = backbone, int(in_channels), norm
        self.old, d = _backbone(backbone, in_channels=in_channels, norm=norm)
        self.new, _ = _backbone(backbone, in_channels=in_channels, norm=norm)
        self.single, _ = _backbone(backbone, in_channels=in_channels, norm=norm)
        self.feature_dim = d
        hidden = max(1, d // reduction)
        self.fusion = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, d), nn.Sigmoid())
        self.fc = nn.Linear(d, num_classes)
        self.old_fc = nn.Linear(d, num_classes)
        self.proj = nn.Sequential(nn.Linear(d, d), nn.ReLU(inplace=True), nn.Linear(d, proj_dim))
        for p in list(self.old.parameters()) + list(self.old_fc.parameters()):
            p.requires_grad_(False)
        for name in ("task", "has_old", "phase"):
            self.register_buffer(name, torch.zeros((), dtype=torch.long))
        self.register_buffer("fuse", torch.ones((), dtype=torch.long))

    def train(self, mode: bool = True) -> "DualNet":
        super().train(mode)
        self.old.eval()  # frozen: its BatchNorm statistics must not follow the new data
        return self

    # ------------------------------------------------------------------ features
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """F_mix (N, d): the features the classifier sees."""
        return self.mix(x)[0]

    def mix(self, x: torch.Tensor):
        """``(F_mix, F_new, λ)``; λ is None when there is no fusion (first task, or the single-branch form)."""
        f_new = cast(FeatureNet, self.new).embed(x)
        if not int(self.has_old) or not int(self.fuse):
            return f_new, f_new, None
        with torch.no_grad():
            f_old = cast(FeatureNet, self.old).embed(x)
        lam = self.fusion(f_old)
        return f_old * lam + f_new * (1 - lam), f_new, lam

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the model in use: the dual model, or ``single`` after a compression round."""
        if int(self.phase):
            return self.single_logits(x)
        return self.fc(self.embed(x))

    def single_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(cast(FeatureNet, self.single).embed(x))

    @torch.no_grad()
    def teacher_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The previous task's model, old_fc(Φ_old(x)): the distillation teacher."""
        return self.old_fc(cast(FeatureNet, self.old).embed(x))

    # ------------------------------------------------------------------ task switch
    @torch.no_grad()
    def advance(self, task: int, *, compressed: bool, new_init: str = "random", seed: int = 0) -> None:
        """Start ``task``: the finished task's model becomes Φ_old (and its classifier the teacher's).

        ``compressed``: Φ_old ← ``single`` (distilled from the dual model in the last rounds of the
        task); otherwise Φ_old ← Φ_new (the no-compression ablation, and always after the first task,
        whose model has one branch). Φ_new is re-initialised (``random``, seeded by ``seed`` and the
        task, so every client of the round draws the same weights) or copied from the new Φ_old
        (``old``). ``single`` starts the next compression from Φ_old.
        """
        if new_init not in NEW_INITS:
            raise ValueError(f"unknown new_init {new_init!r}; use one of {', '.join(NEW_INITS)}")
        if task != int(self.task) + 1:
            raise ValueError(
                f"the model holds task {int(self.task)}; it can only advance to task {int(self.task) + 1}, not {task}"
            )
        source = self.single if compressed and int(self.has_old) else self.new
        self.old.load_state_dict(source.state_dict())
        self.old_fc.load_state_dict(self.fc.state_dict())
        if new_init == "old":
            self.new.load_state_dict(self.old.state_dict())
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed * 7919 + task)
                fresh, _ = _backbone(self.backbone_name, in_channels=self.in_channels, norm=self.norm)
            self.new.load_state_dict(fresh.state_dict())
        self.single.load_state_dict(self.old.state_dict())
        self.task.fill_(task)
        self.has_old.fill_(1)
        self.phase.fill_(0)
