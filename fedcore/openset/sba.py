"""SBA (statistics-based alignment, FedPD++ §4.4): matching channels by their BatchNorm history.

A client keeps, round by round, the running means of its BatchNorm layers (its *bank*). Two
clients' channels are compared by those histories over the rounds both kept.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence

import torch

from fedcore.openset.align import Layer


def bank_cost(bank: torch.Tensor, ref_bank: torch.Tensor) -> torch.Tensor:
    """SBA: the distance between channels' BatchNorm histories over the rounds both clients kept.

    ``bank`` and ``ref_bank`` are ``(rounds, C)`` running means; a channel is described by its
    history (a column). The paper applies this matching first and then aligns the refined layer
    (``sba_mode: compose``); with an exact assignment that composition gives back the weights' own
    match, and the history decides only between units whose weights tie. ``sba_mode: added`` adds
    this cost to the weights' cost instead (:func:`fedcore.openset.align.align_chain`).
    """
    return torch.cdist(bank.double().t(), ref_bank.double().t())


def sba_costs(
    bank: Optional[Mapping[str, torch.Tensor]], ref_bank: Optional[Mapping[str, torch.Tensor]], plan: Sequence[Layer]
) -> Dict[str, torch.Tensor]:
    """SBA's per-layer costs between channels, over the rounds both clients have BatchNorm statistics for.

    A bank is ``{"rounds": (t,) round indices, <layer name>: (t, C) running means}``.
    """
    costs: Dict[str, torch.Tensor] = {}
    if not bank or not ref_bank:
        return costs
    mine, theirs = bank["rounds"].tolist(), ref_bank["rounds"].tolist()
    common = sorted(set(mine) & set(theirs))
    if not common:
        return costs
    ia = torch.tensor([mine.index(r) for r in common])
    ib = torch.tensor([theirs.index(r) for r in common])
    for layer in plan:
        if not layer.last and layer.name in bank and layer.name in ref_bank:
            costs[layer.name] = bank_cost(bank[layer.name][ia], ref_bank[layer.name][ib])
    return costs
