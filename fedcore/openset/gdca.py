"""Global divide-and-conquer aggregation (GDCA, FedPD++ §4.3) as a pure function of the client models.

Each client model is cut into parts by its masks (:func:`fedcore.openset.masks.split_parts`).
Each part is aligned to the same part of a reference client with its own chain of transports
(Eq. 19–21; ``part_transport="whole"`` puts every part on the whole-model transport), and the aligned parts are averaged (Eq. 22). Eq. 22 divides by K; where the parts
do not cover a parameter fully that would shrink it, so we divide by the aligned mask mass
instead: ``G = Σ_k w_k Σ_p T_kp(S_k ⊙ P_kp) / Σ_k w_k Σ_p T_kp(P_kp)``. When the parts sum to 1
and nothing is aligned, this is exactly FedAvg; the tests hold it to that. BatchNorm running
statistics, which no mask covers, follow the whole-model transport.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch

from fedcore.openset.align import Layer, align_chain, apply_chain, identity_chain, identity_layers
from fedcore.openset.sba import sba_costs
from fedcore.registry import check_choice

State = Dict[str, torch.Tensor]
PART_TRANSPORTS = ("own", "whole")


@dataclass
class Fused:
    state: State
    metrics: Dict[str, float] = field(default_factory=dict)
    per_client: Dict[int, Dict[str, float]] = field(default_factory=dict)


def fuse(
    states: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float],
    *,
    plan: Sequence[Layer],
    parts: Sequence[Mapping[str, Mapping[str, torch.Tensor]]],
    ref: int,
    method: str = "hungarian",
    reg: float = 0.05,
    max_iter: int = 200,
    tol: float = 1e-6,
    part_cost: str = "weighted",
    banks: Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]] = None,
    sba_weight: float = 1.0,
    sba_mode: str = "compose",
    part_transport: str = "whole",
    hard: bool = True,
    cost_dtype: str = "float32",
    quality: bool = False,
    screen: bool = True,
    names: Optional[Sequence[int]] = None,
) -> Fused:
    """Align every client's parts to client ``ref``'s and average them.

    The defaults are FedPD++'s (:class:`fedcore.aggregate.fedpd.FedPD`): one exact transport per client for
    every part, SBA composed with it, float32 costs, so that each fused unit comes whole from one unit of each
    client.

    Parameters
    ----------
    states, weights:
        The client models and their averaging weights (example counts, or 1 each).
    parts:
        Per client, ``{part name: masks keyed like the parameters}``; the part ``rest`` and
        ``whole`` use the whole-model transport.
    method:
        ``sinkhorn``, ``hungarian`` or ``none`` (no alignment: divide-and-conquer averaging only).
    part_cost:
        How a part's units are compared (:func:`fedcore.openset.align.align_chain`).
    banks:
        Per client, ``{"rounds": (t,), layer name: (t, C) BatchNorm running means}`` (SBA,
        :func:`~fedcore.openset.sba.sba_costs`), or ``None`` for a client with none yet; ``None`` turns SBA off.
    sba_mode, hard, cost_dtype, screen:
        As :func:`fedcore.openset.align.align_chain` takes them.
    part_transport:
        ``own``: each part is aligned with its own chain (Eq. 19–21); ``whole``: every part follows the
        whole-model transport, so each unit of the fused model comes whole from one unit of each client.
    names:
        Client ids for ``per_client`` (default: positions).
    """
    if not states:
        raise ValueError("fuse needs at least one client model")
    if not len(states) == len(weights) == len(parts):
        raise ValueError("states, weights and parts need one entry per client")
    check_choice("part_transport", part_transport, PART_TRANSPORTS)
    names = list(range(len(states))) if names is None else list(names)
    settings: Dict[str, Any] = dict(
        method=method, reg=reg, max_iter=max_iter, tol=tol, hard=hard, cost_dtype=cost_dtype
    )
    ref_units: Dict[str, Any] = {}  # the reference's unit rows (and screens), built once for every client's chain
    param_keys = list(next(iter(parts[0].values())).keys())
    others = [k for k in states[0] if k not in param_keys]
    total = float(sum(weights))
    num = {k: torch.zeros_like(states[0][k], dtype=torch.float64) for k in param_keys}
    den = {k: torch.zeros_like(num[k]) for k in param_keys}
    whole_sum = {
        k: torch.zeros_like(states[0][k], dtype=torch.float64)
        for k in param_keys + others
        if states[0][k].is_floating_point()
    }
    costs: Dict[str, List[float]] = {}
    entropies: List[float] = []
    quality_vals: List[float] = []
    per_client: Dict[int, Dict[str, float]] = {}
    kept: List[bool] = []  # per aligned client: every chain the identity, so nothing was applied
    kept_layers: List[bool] = []  # per layer transport that acts: the identity
    certified: List[bool] = []  # per whole-model layer transport: proven optimal without its cost matrix
    for k, (state, w, cut) in enumerate(zip(states, weights, parts)):
        if method == "none" or k == ref:
            whole = identity_chain(plan)
            chains = {p: whole for p in cut}
        else:
            sba: Dict[str, Any] = (
                dict(bank_costs=sba_costs(banks[k], banks[ref], plan), sba_weight=sba_weight, sba_mode=sba_mode)
                if banks
                else {}
            )
            whole = align_chain(
                state,
                states[ref],
                plan,
                quality=quality,
                where=f"client {names[k]}",
                ref_units=ref_units,
                screen=screen,
                **settings,
                **sba,
            )
            chains = {
                p: whole
                if p in ("rest", "whole") or part_transport == "whole"
                else align_chain(
                    state,
                    states[ref],
                    plan,
                    mask=cut[p],
                    ref_mask=parts[ref][p],
                    part_cost=part_cost,
                    where=f"client {names[k]} {p}",
                    **settings,
                    **sba,
                )
                for p in cut
            }
            for p, ch in chains.items():
                costs.setdefault(p, []).extend(ch.costs)
            for ch in {id(c): c for c in chains.values()}.values():  # every transport that acts, once
                entropies.extend(ch.entropies)
            quality_vals.extend(whole.quality)
            certified.extend(whole.certified)
            per_client[names[k]] = {"align_cost": float(np.mean(whole.costs)) if whole.costs else 0.0}
            acting = {id(c): c for c in chains.values()}.values()
            for ch in acting:  # the transports solved (a tied or last layer has none of its own)
                kept_layers.extend(k for k, P in zip(identity_layers(ch), ch.P) if P is not None)
            kept.append(all(all(identity_layers(ch)) for ch in acting))
            if kept[-1]:  # nothing to align: the client's weights go in as they are
                whole = identity_chain(plan)
                chains = {p: whole for p in cut}
        for p, masks in cut.items():
            masked = {key: state[key].double() * masks[key].double() for key in param_keys}
            aligned = apply_chain(masked, plan, chains[p])
            mass = apply_chain({key: masks[key].double() for key in param_keys}, plan, chains[p])
            for key in param_keys:
                num[key] += w * aligned[key]
                den[key] += w * mass[key]
        aligned_whole = apply_chain({key: state[key].double() for key in whole_sum}, plan, whole)
        for key in whole_sum:
            whole_sum[key] += w * aligned_whole[key]
    out: State = {}
    for key in param_keys:
        fallback = whole_sum[key] / total
        covered = den[key] > 1e-6 * total
        out[key] = torch.where(covered, num[key] / den[key].clamp_min(1e-300), fallback).to(states[0][key].dtype)
    for key in others:
        t = states[0][key]
        out[key] = (whole_sum[key] / total).to(t.dtype) if t.is_floating_point() else states[ref][key].clone()
    metrics: Dict[str, float] = {}
    if entropies:
        all_costs = [c for v in costs.values() for c in v]
        metrics.update({"align_cost": float(np.mean(all_costs)), "transport_entropy": float(np.mean(entropies))})
        metrics.update({f"align_cost.{p}": float(np.mean(v)) for p, v in costs.items() if v})
    if quality_vals:
        metrics["align_quality"] = float(np.mean(quality_vals))
    if kept:
        metrics["align_identity"] = float(np.mean(kept))
        metrics["align_identity_layers"] = float(np.mean(kept_layers)) if kept_layers else 1.0
    if screen and method == "hungarian" and certified:
        metrics["align_certified"] = float(np.mean(certified))
    return Fused(state=out, metrics=metrics, per_client=per_client)
