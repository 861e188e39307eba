"""Prototype clients: FedProto's and FedPAD's local objective, and class prototypes.

Local loss = CE + λ · MSE(g_w(x), p_g^{(y)}): each sample's penultimate features are pulled
towards the global prototype of its class (samples whose class has no global prototype yet
add nothing). After training, the client computes its prototypes p_i^{(k)} (class means of the
features) over its data and sends them with their class counts. A class the client lacks is
omitted: not sent, not aggregated (FedPAD §3).
"""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn

from fedcore.models import embed_and_classify
from fedcore.tensors import batches
from fedcore.train.base import TRAINERS, LocalTrainer, State


@torch.no_grad()
def class_prototypes(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, batch_size: int = 256
) -> Dict[str, torch.Tensor]:
    """Class means of ``model``'s penultimate features over (x, y), in eval mode.

    Returns
    -------
    dict with ``classes`` (K_i,) int64, the classes present; ``protos`` (K_i, D) float32;
    ``counts`` (K_i,) int64. Absent classes have no row.
    """
    was_training = model.training
    model.eval()
    feats = torch.cat([embed_and_classify(model, x[sl])[0] for sl in batches(len(x), batch_size)])
    model.train(was_training)
    classes = torch.unique(y).cpu()
    protos = torch.stack([feats[y == k].mean(0) for k in classes.tolist()]).float().cpu()
    counts = torch.stack([(y == k).sum() for k in classes.tolist()]).cpu()
    return {"classes": classes.long(), "protos": protos, "counts": counts.long()}


@TRAINERS.register("proto")
class ProtoTrainer(LocalTrainer):
    """Parameters: ``lam`` (λ >= 0), the weight of the prototype alignment (FedPAD default 0.1)."""

    needs_features = True

    def __init__(self, *, lam: float = 0.1, **kw) -> None:
        super().__init__(**kw)
        if lam < 0:
            raise ValueError(f"prototype weight lam must be >= 0, got {lam}")
        self.lam = float(lam)

    def begin(
        self, model: nn.Module, *, global_state: State, broadcast: Dict[str, Any], client_state: Dict[str, Any]
    ) -> None:
        self._table = None
        g = broadcast.get("prototypes")
        if g is not None and len(g["classes"]):
            device = next(model.parameters()).device
            dim = g["protos"].shape[1]
            num = int(g["classes"].max()) + 1
            self._table = torch.zeros(num, dim, device=device)
            self._known = torch.zeros(num, dtype=torch.bool, device=device)
            self._table[g["classes"].to(device)] = g["protos"].to(device)
            self._known[g["classes"].to(device)] = True

    def loss(self, model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        feats, logits = embed_and_classify(model, xb)
        ce = nn.functional.cross_entropy(logits, yb)
        if self.lam == 0 or self._table is None:
            return ce
        inside = yb < len(self._known)
        keep = torch.zeros_like(yb, dtype=torch.bool)
        keep[inside] = self._known[yb[inside]]
        if not bool(keep.any()):
            return ce
        target = self._table[yb[keep]]
        return ce + self.lam * nn.functional.mse_loss(feats[keep], target)

    def finish(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, steps: int):
        return {}, {"prototypes": class_prototypes(model, x, y)}
