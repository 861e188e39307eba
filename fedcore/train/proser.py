"""PROSER open-set training (Zhou et al. 2021), with FedPD++'s importance scores and masks (§4.1–4.2).

The model has one more output than there are known classes: the last logit is the dummy
("unknown") class. Each batch is split in halves, as in the PROSER authors' code:

* the second half trains the known classes, ``L_close = CE(f(x), y)``, and the classifier
  placeholder, ``β · CE(f(x) \\ y, K+1)``: with the true class masked out, the dummy must be
  the runner-up;
* the first half trains the data placeholder: features at the model's middle layer are mixed,
  ``λ φ_pre(x_i) + (1 − λ) φ_pre(x_j)`` with λ ~ Beta(α, α), over pairs of *different* classes
  (the FedPD++ paper's condition; same-class pairs are dropped), and the mixture is labelled
  as the dummy class, weighted ``γ``.

``L_open`` = β · placeholder + γ · mixture. Defaults are the PROSER authors' (β = 1, γ = 0.01,
α = 1).

Schedule: with ``closed_rounds = R`` the first R rounds train the closed-set classifier alone
(cross-entropy over the known classes' logits; the dummy logit is left out, and no masks are sent, so
the server fuses the whole model), and the rounds after them train with PROSER at ``lr × open_lr_scale``,
the masks' threshold δ rising over those rounds alone.
That is the PROSER and FedPD authors' code: a closed-set network first, then PROSER fine-tuning at a
much smaller rate (the FedPD++ paper's "10⁻² closed, 10⁻⁴ open"). ``closed_rounds = 0`` (the default)
trains PROSER from the first round at ``lr``.

``own_init_rounds = R`` (default 0) makes the first R rounds start each client from a network initialised
afresh under the client's own seed instead of the global model: clients that start from different
models, whose units a server must match before it averages them (alignment's own setting).

When ``importance`` is not ``none`` the trainer scores every parameter for each loss
(:mod:`fedcore.openset.dpi`, :mod:`fedcore.openset.masks`): DPI sums ``|∇L · ω| · Δt`` over every local step of
the round (Δt = the round's learning rate; the path is the round's local optimisation, since the masks go to the
server every round), ``gradient`` keeps the last step only. The closed- and open-set gradients come
from two backward passes, summed before the optimizer step, so the update is the same as one
backward pass of the total loss. The masks go back to the server in the update's payload.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, cast

import torch
from torch import nn

from fedcore.models import mix_split
from fedcore.openset.dpi import IMPORTANCE, empty_scores, importance_step
from fedcore.openset.masks import MASK_MODES, SCORE_NORMS, delta_soft, masks_from_scores
from fedcore.registry import check_choice
from fedcore.train.base import TRAINERS, LocalTrainer, State


@TRAINERS.register("proser")
class ProserTrainer(LocalTrainer):
    """Parameters: ``beta``, ``gamma``, ``mix_alpha`` (PROSER); ``closed_rounds``, ``open_lr_scale`` (the
    two-phase schedule, above); ``own_init_rounds`` (above); ``importance``, ``mask``, ``score_norm``, ``delta0``, ``delta_end``, ``mask_rounds`` (FedPD++'s masks; ``mask_rounds`` is T of δ's schedule,
    by default the run's number of rounds, which the engine broadcasts)."""

    constant_lr_because = "DPI's path integral takes the lr as its time step"

    def __init__(
        self,
        *,
        beta: float = 1.0,
        gamma: float = 0.01,
        mix_alpha: float = 1.0,
        importance: str = "none",
        mask: str = "soft",
        score_norm: str = "rank",
        delta0: float = 0.5,
        delta_end: float = 0.8,
        mask_rounds: int | None = None,
        closed_rounds: int = 0,
        open_lr_scale: float = 1.0,
        own_init_rounds: int = 0,
        **kw,
    ) -> None:
        super().__init__(**kw)
        if beta < 0 or gamma < 0:
            raise ValueError(f"PROSER loss weights must be >= 0, got beta={beta}, gamma={gamma}")
        if mix_alpha <= 0:
            raise ValueError(f"mix_alpha (the Beta distribution's parameter) must be > 0, got {mix_alpha}")
        check_choice("importance", importance, IMPORTANCE)
        check_choice("mask", mask, MASK_MODES)
        check_choice("score_norm", score_norm, SCORE_NORMS)
        if not 0 <= delta0 <= 1 or not 0 <= delta_end <= 1:
            raise ValueError(
                f"the soft-mask thresholds are quantiles in [0, 1], got delta0={delta0}, delta_end={delta_end}"
            )
        if mask_rounds is not None and mask_rounds < 1:
            raise ValueError(
                f"mask_rounds (T of the threshold schedule) must be >= 1, got {mask_rounds}; "
                "leave it unset to use the run's number of rounds"
            )
        if closed_rounds < 0:
            raise ValueError(
                f"closed_rounds (rounds of closed-set training before PROSER) must be >= 0, got {closed_rounds}"
            )
        if not 0 < open_lr_scale <= 1:
            raise ValueError(
                f"open_lr_scale (PROSER's lr as a share of the closed-set lr) must be in (0, 1], got "
                f"{open_lr_scale}; e.g. 0.01 for the paper's 1e-2 closed / 1e-4 open"
            )
        if own_init_rounds < 0:
            raise ValueError(
                f"own_init_rounds (rounds whose clients start from a model of their own) must be >= 0, got "
                f"{own_init_rounds}"
            )
        self.closed_rounds, self.open_lr_scale = int(closed_rounds), float(open_lr_scale)
        self.own_init_rounds = int(own_init_rounds)
        self.beta, self.gamma, self.mix_alpha = float(beta), float(gamma), float(mix_alpha)
        self.importance, self.mask, self.score_norm = importance, mask, score_norm
        self.delta0, self.delta_end = float(delta0), float(delta_end)
        self.mask_rounds = None if mask_rounds is None else int(mask_rounds)

    # ------------------------------------------------------------------ hooks
    def begin(
        self, model: nn.Module, *, global_state: State, broadcast: Dict[str, Any], client_state: Dict[str, Any]
    ) -> None:
        self._pre, self._post = mix_split(model)  # a model without a mixing layer fails here, before training
        self._round = int(broadcast.get("round", 0))
        if self.own_init_rounds and "round" not in broadcast:
            raise ValueError(
                "own_init_rounds reads the round from the server's broadcast; train through the round engine"
            )
        if self._round < self.own_init_rounds:  # a model of its own (the global RNG holds the client's seed)
            for mod in model.modules():
                reset = getattr(mod, "reset_parameters", None)
                if callable(reset):
                    reset()
        self._closed = self._round < self.closed_rounds
        self._rounds = self.mask_rounds or int(broadcast.get("rounds", 1))
        self._params = dict(model.named_parameters())
        self._scores = empty_scores(self._params)
        self._g_close: Optional[Dict[str, torch.Tensor]] = None
        self._gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))

    def round_lr(self, broadcast: Dict[str, Any]) -> float:
        return self.lr if self._closed else self.lr * self.open_lr_scale

    def losses(self, model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(L_close, L_open)`` of one batch (see the module docstring)."""
        half = len(xb) // 2
        xm, ym, xr, yr = xb[:half], yb[:half], xb[half:], yb[half:]
        logits = model(xr)
        dummy = logits.shape[1] - 1
        l_close = nn.functional.cross_entropy(logits, yr)
        masked = logits.scatter(1, yr[:, None], -1e9)  # the true class removed: the dummy must come second
        l_open = self.beta * nn.functional.cross_entropy(masked, torch.full_like(yr, dummy))
        if half >= 2 and self.gamma > 0:
            perm = torch.randperm(half, generator=self._gen).to(xb.device)
            keep = ym != ym[perm]
            if bool(keep.any()):
                lam = float(torch.distributions.Beta(self.mix_alpha, self.mix_alpha).sample())
                h = self._pre(xm[keep])
                mixed = lam * h + (1 - lam) * self._pre(xm[perm][keep])
                out = self._post(mixed)
                l_open = l_open + self.gamma * nn.functional.cross_entropy(out, torch.full_like(ym[keep], dummy))
        return l_close, l_open

    def loss(self, model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        if self._closed:  # the closed-set phase: the known classes' logits only
            return nn.functional.cross_entropy(model(xb)[:, :-1], yb)
        l_close, l_open = self.losses(model, xb, yb)
        if self.importance == "none":
            return l_close + l_open
        names = list(self._params)
        grads = torch.autograd.grad(l_close, [self._params[k] for k in names], retain_graph=True, allow_unused=True)
        self._g_close = {k: (torch.zeros_like(self._params[k]) if g is None else g) for k, g in zip(names, grads)}
        return l_open + l_close.detach()  # backward of this gives the open-set gradient only; its value is the total

    def after_backward(self, model: nn.Module) -> None:
        if self.importance == "none" or self._closed:
            return
        g_open = {k: torch.zeros_like(p) if p.grad is None else p.grad.detach() for k, p in self._params.items()}
        g_close = cast(Dict[str, torch.Tensor], self._g_close)  # set by loss() for this step
        dt = self.round_lr({})
        importance_step(self._scores, self._params, g_close=g_close, g_open=g_open, dt=dt, mode=self.importance)
        for k, p in self._params.items():
            p.grad = g_open[k] + g_close[k]

    def finish(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, steps: int):
        if self._closed:
            return {}, {"closed_phase": True}
        if self.importance == "none":
            return {}, {}
        # δ rises over the rounds that train the masks: those after the closed-set phase
        delta = delta_soft(
            self._round - self.closed_rounds,
            max(self._rounds - self.closed_rounds, 1),
            delta0=self.delta0,
            delta_end=self.delta_end,
        )
        masks = {
            part: {
                k: m.cpu().half()
                for k, m in masks_from_scores(
                    self._scores[part], mode=self.mask, delta=delta, norm=self.score_norm
                ).items()
            }
            for part in ("close", "open")
        }
        return {}, {"mask_close": masks["close"], "mask_open": masks["open"], "delta": delta}
