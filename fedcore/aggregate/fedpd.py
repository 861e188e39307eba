"""FedPD++'s server (GDCA + SBA, §4.3) and FedPD's (whole-model OT fusion), as a round strategy.

Settings, each switchable for the paper's ablations. The defaults are alignment as the paper describes it
(§4.3: alignment "only changes the order of channels"): one exact transport per client for every part, SBA's
reordering composed with the weight matching, float32 costs, the screen. The earlier soft, per-part reading
(``align=sinkhorn, sba_mode=added, part_transport=own, hard=false, cost_dtype=float64``) stays selectable:
``fedpd++-soft`` in conf/experiment/fedpd.yaml.

* ``parts``: ``three`` (close / open / shared, FedPD++), ``two`` (the two overlapping
  subnetworks), ``none`` (the whole model: FedPD's OT fusion, no masks);
* ``align``: ``sinkhorn`` (entropic OT), ``hungarian`` (exact assignment), ``none``;
* ``part_cost``: how a part's units are compared: ``weighted`` (on the coordinates both parts
  hold) or ``masked`` (the masked weights, the literal Eq. 19–21; see :func:`~fedcore.openset.align.align_chain`);
* ``sba``: use the clients' BatchNorm-statistics histories in each BatchNorm layer's matching;
  ``sba_mode``: ``added`` (their distance is added to the weights' cost, with ``sba_weight``) or
  ``compose`` (§4.3's order: reorder by history, then match the reordered weights);
* ``part_transport``: ``own`` (each part its own chain of transports, Eq. 19–21) or ``whole`` (every
  part follows the whole-model transport, so a fused unit never mixes parts of different source units);
* ``hard``: round Sinkhorn's plan to a permutation, so alignment only reorders units (Hungarian's
  always does); ``cost_dtype``: the cost matrices' precision (``float64``, or ``float32``: half the time);
* ``screen``: Hungarian skips a layer's cost matrix where a triangle-inequality certificate proves the
  match optimal (:func:`~fedcore.openset.align.certify`: the exact optimum, found faster);
* ``reg``, ``max_iter``, ``tol``: Sinkhorn's relative entropy, iteration cap and stopping tolerance
  on the marginals (1e-6; 1e-3 halves the three parts' alignment time on a ResNet-18, ``benchmarks/fedpd_align.py``);
* ``quality``: also solve every layer exactly, to log Sinkhorn's cost over Hungarian's (slower);
* ``reference``: the client every other is aligned to: ``largest`` (most examples, then the
  lowest id) or ``first`` (the lowest selected id). The paper allows any;
* ``client_weights``: ``examples`` (as FedAvg here) or ``uniform`` (the paper's 1/K, Eq. 22).

The SBA bank keeps, per client, the last ``sba_window`` rounds of every BatchNorm layer's running
means: memory is bounded by ``clients x window x channels``, whatever the number of rounds.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch

from fedcore.aggregate.base import STRATEGIES, Aggregated, Strategy, Updates
from fedcore.aggregate.functions import State
from fedcore.openset.align import ALIGN_METHODS, COST_DTYPES, PART_COSTS, SBA_MODES, layer_plan
from fedcore.openset.gdca import PART_TRANSPORTS, fuse
from fedcore.openset.masks import PART_MODES, split_parts
from fedcore.registry import check_choice

REFERENCES = ("largest", "first")
CLIENT_WEIGHTS = ("examples", "uniform")


@STRATEGIES.register("fedpd")
class FedPD(Strategy):
    trainer = ("proser",)
    needs_model = True

    def __init__(
        self,
        *,
        parts: str = "three",
        align: str = "hungarian",
        part_cost: str = "weighted",
        sba: bool = True,
        sba_weight: float = 1.0,
        sba_mode: str = "compose",
        part_transport: str = "whole",
        hard: bool = True,
        cost_dtype: str = "float32",
        reg: float = 0.05,
        max_iter: int = 200,
        tol: float = 1e-6,
        sba_window: int = 10,
        reference: str = "largest",
        client_weights: str = "examples",
        quality: bool = False,
        screen: bool = True,
    ) -> None:
        for what, value, choices in (
            ("parts", parts, PART_MODES),
            ("align", align, ALIGN_METHODS),
            ("reference", reference, REFERENCES),
            ("client_weights", client_weights, CLIENT_WEIGHTS),
            ("part_cost", part_cost, PART_COSTS),
            ("sba_mode", sba_mode, SBA_MODES),
            ("part_transport", part_transport, PART_TRANSPORTS),
            ("cost_dtype", cost_dtype, tuple(COST_DTYPES)),
        ):
            check_choice(what, value, choices)
        if part_cost != "weighted" and part_transport != "own":
            raise ValueError(
                f"part_cost={part_cost!r} compares a part's units for the part's own transport; with "
                f"part_transport={part_transport!r} every part follows the whole-model transport and part_cost "
                "would do nothing: set part_transport=own, or leave part_cost at weighted"
            )
        if reg <= 0 or max_iter < 1 or sba_window < 1 or sba_weight < 0 or not 0 < tol < 5e-2:
            raise ValueError(
                f"need reg > 0, max_iter >= 1, 0 < tol < 0.05, sba_window >= 1 and sba_weight >= 0; got "
                f"{reg}, {max_iter}, {tol}, {sba_window}, {sba_weight}"
            )
        self.parts, self.align, self.sba, self.reg, self.max_iter = parts, align, bool(sba), float(reg), int(max_iter)
        self.sba_window, self.reference, self.client_weights = int(sba_window), reference, client_weights
        self.quality, self.part_cost, self.sba_weight, self.tol = (
            bool(quality),
            part_cost,
            float(sba_weight),
            float(tol),
        )
        self.screen = bool(screen)
        self.sba_mode, self.part_transport, self.hard, self.cost_dtype = (
            sba_mode,
            part_transport,
            bool(hard),
            cost_dtype,
        )

    def bind_model(self, model: torch.nn.Module) -> None:
        """The network's layer plan; a model alignment cannot follow is refused here, before any round."""
        self.plan = layer_plan(model) if self.align != "none" or self.sba else layer_plan_or_empty(model)
        self.bn_layers = {layer.name: layer.bn[2] for layer in self.plan if len(layer.bn) > 2}

    def setup(self, global_state: State, *, num_clients: int, param_keys: Sequence[str]) -> None:
        super().setup(global_state, num_clients=num_clients, param_keys=param_keys)
        self.round = 0
        self.bank: Dict[int, Dict[str, torch.Tensor]] = {}

    def aggregate(self, global_state: State, updates: Updates, *, num_clients: int) -> Aggregated:
        ids = [i for i, _ in updates]
        ups = [u for _, u in updates]
        parts = [self._parts_of(i, u) for i, u in updates]
        if self.sba:
            self._remember_bn(updates)
        ref = self._reference(updates)
        weights = [float(u.num_examples) if self.client_weights == "examples" else 1.0 for u in ups]
        fused = fuse(
            [u.state for u in ups],
            weights,
            plan=self.plan,
            parts=parts,
            ref=ref,
            method=self.align,
            reg=self.reg,
            max_iter=self.max_iter,
            tol=self.tol,
            part_cost=self.part_cost,
            sba_weight=self.sba_weight,
            sba_mode=self.sba_mode,
            part_transport=self.part_transport,
            hard=self.hard,
            cost_dtype=self.cost_dtype,
            banks=[self.bank.get(i) for i in ids] if self.sba and self.align != "none" else None,
            quality=self.quality and self.align == "sinkhorn",
            screen=self.screen,
            names=ids,
        )
        metrics = {
            **fused.metrics,
            **self._mask_sizes(parts),
            **self._bn_drift(ups, ref),
            "reference_client": float(ids[ref]),
            "sba_bank_bytes": float(self.bank_bytes()),
        }
        self.round += 1
        return Aggregated(fused.state, metrics=metrics, per_client=fused.per_client)

    # ------------------------------------------------------------------ pieces
    def _parts_of(self, client: int, update) -> Dict[str, Dict[str, torch.Tensor]]:
        p = update.payload
        if self.parts == "none" or p.get("closed_phase"):  # a closed-set round has no open-set part to mask
            return split_parts({k: update.state[k] for k in self.param_keys}, {}, mode="none")
        if "mask_close" not in p or "mask_open" not in p:
            raise ValueError(
                f"client {client} sent no masks, but parts={self.parts} needs them: train with the proser "
                "trainer and importance dpi or gradient (or set parts=none)"
            )
        close = {k: p["mask_close"][k].float() for k in self.param_keys}
        open_ = {k: p["mask_open"][k].float() for k in self.param_keys}
        return split_parts(close, open_, mode=self.parts)

    def _reference(self, updates: Updates) -> int:
        if self.reference == "first":
            return min(range(len(updates)), key=lambda j: updates[j][0])
        return max(range(len(updates)), key=lambda j: (updates[j][1].num_examples, -updates[j][0]))

    def _remember_bn(self, updates: Updates) -> None:
        for i, u in updates:
            entry = self.bank.get(i, {"rounds": torch.zeros(0, dtype=torch.long)})
            rounds = torch.cat([entry["rounds"], torch.tensor([self.round])])[-self.sba_window :]
            new = {"rounds": rounds}
            for name, key in self.bn_layers.items():
                row = u.state[key].detach().float()[None]
                old = entry.get(name, torch.zeros(0, row.shape[1]))
                new[name] = torch.cat([old, row])[-self.sba_window :]
            self.bank[i] = new

    def bank_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self.bank.values() for t in b.values())

    @staticmethod
    def _mask_sizes(parts: List[Dict[str, Dict[str, torch.Tensor]]]) -> Dict[str, float]:
        """Mean mask mass of each part: the share of the parameters it holds, averaged over clients."""
        out: Dict[str, List[float]] = {}
        for cut in parts:
            for name, masks in cut.items():
                mass = sum(float(m.sum()) for m in masks.values())
                size = sum(m.numel() for m in masks.values())
                out.setdefault(name, []).append(mass / max(size, 1))
        return {f"mask.{name}": sum(v) / len(v) for name, v in out.items()}

    def _bn_drift(self, ups, ref: int) -> Dict[str, float]:
        """RMS distance of each client's BatchNorm running means from the reference's, averaged over layers."""
        if not self.bn_layers or len(ups) < 2:
            return {}
        vals = []
        for key in self.bn_layers.values():
            r = ups[ref].state[key].float()
            vals += [float((u.state[key].float() - r).pow(2).mean().sqrt()) for j, u in enumerate(ups) if j != ref]
        return {"bn_drift": sum(vals) / len(vals)}

    def state_dict(self) -> Dict[str, Any]:
        return {"round": self.round, "bank": {str(i): dict(b) for i, b in self.bank.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.round = int(state["round"])
        self.bank = {int(i): dict(b) for i, b in state["bank"].items()}


def layer_plan_or_empty(model: torch.nn.Module):
    """Without alignment or SBA no plan is needed; any model may be averaged part by part."""
    try:
        return layer_plan(model)
    except ValueError:
        return []
