"""PP-FCIL's server: multi-factor aggregation weights and Mahalanobis client selection.

The maths are the pure functions of :mod:`fedcore.aggregate.multifactor`; this strategy holds
what they need between rounds (checkpointed with the run): each client's last reported
[accuracy, loss, kappa] vector, its participation count, the round it last took part in, and how
long it has waited since it was last selected.

What θ and α are here: γ_k = tanh(θ_k + α) with θ_k = |D_k^t| / Σ_{s≤t} |D_k^s|, the share of the
client's data so far that is new in this task (it falls as data accumulates), and α a constant
offset (0 by default: a client whose data is all new gets tanh(1) = 0.76).

Selection reads the vectors clients reported when they last took part (the server has no other
view of a client's data); a client that has never reported is picked before any other, and a
client out of privacy budget is never picked again (with ``random`` selection it still is: the
ablation keeps the run's seeded sample).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence

import numpy as np

from fedcore.aggregate import multifactor as MF
from fedcore.aggregate.base import STRATEGIES, Aggregated, Strategy, Updates
from fedcore.aggregate.functions import State, weighted_average
from fedcore.registry import check_choice

WEIGHTINGS = ("multifactor", "examples")
SELECTIONS = ("mahalanobis", "random")
CLIP_STATS = ("clipped_fraction", "clipped_norm", "grad_norm_median")
"""What a DP-SGD client reports of its per-sample gradient norms (fedcore.train.fcil), kept per client and round."""


@STRATEGIES.register("ppfcil")
class PPFCIL(Strategy):
    """Parameters
    ----------
    weighting:
        ``multifactor`` (the paper's ω) or ``examples`` (FedAvg's |D_k|, the ablation).
    coeffs, alpha:
        (a, b, c, d) of the weights, and α of γ.
    selection:
        ``mahalanobis`` (the most outlying m clients, m = ⌈participation · K⌉) or ``random``
        (the run's seeded sample, the ablation).
    max_wait:
        The fairness floor: a client left out this many rounds is forced in (None: no floor).
    """

    trainer = ("fcil",)

    def __init__(
        self,
        *,
        weighting: str = "multifactor",
        coeffs: Sequence[float] = MF.DEFAULT_COEFFS,
        alpha: float = 0.0,
        selection: str = "mahalanobis",
        max_wait: int | None = 4,
    ) -> None:
        check_choice("weighting", weighting, WEIGHTINGS)
        check_choice("selection", selection, SELECTIONS)
        coeffs = tuple(float(c) for c in coeffs)
        if len(coeffs) != 4 or any(c < 0 for c in coeffs) or sum(coeffs) <= 0:
            raise ValueError(f"coeffs are the four weights (a, b, c, d) >= 0 with a positive sum, got {coeffs}")
        if not math.isfinite(alpha):
            raise ValueError(f"alpha must be finite, got {alpha}")
        if max_wait is not None and max_wait < 1:
            raise ValueError(f"max_wait must be >= 1 round (or null for no fairness floor), got {max_wait}")
        self.weighting, self.coeffs, self.alpha = weighting, coeffs, float(alpha)
        self.selection, self.max_wait = selection, None if max_wait is None else int(max_wait)

    def setup(self, global_state: State, *, num_clients: int, param_keys: Sequence[str]) -> None:
        super().setup(global_state, num_clients=num_clients, param_keys=param_keys)
        self.vectors = np.full((num_clients, 3), np.nan)
        self.counts = np.zeros(num_clients, dtype=np.int64)
        self.last_round = np.full(num_clients, -1, dtype=np.int64)
        self.waited = np.zeros(num_clients, dtype=np.int64)
        self.spent = np.zeros(num_clients, dtype=bool)  # out of privacy budget: never picked again
        self.round = 0
        self.reasons: Dict[int, str] = {}
        self.scores = np.zeros(num_clients)

    def select(self, round_index: int, default: List[int], *, num_clients: int) -> List[int]:
        self.round = int(round_index)
        if self.selection == "random":
            picked, self.reasons = list(default), {i: "random" for i in default}
            self.scores = np.zeros(num_clients)
        elif self.spent.all():  # nobody can train: the round runs with the usual sample, and every update is empty
            picked, self.reasons = list(default), {i: "spent" for i in default}
        else:
            self.scores = MF.mahalanobis_scores(vectors=self.vectors)
            live = np.flatnonzero(~self.spent)
            sub, why = MF.select_clients(
                scores=self.scores[live],
                m=min(len(default), len(live)),
                waited=self.waited[live],
                max_wait=self.max_wait,
            )
            picked, self.reasons = sorted(int(live[i]) for i in sub), {int(live[i]): r for i, r in why.items()}
        self.waited += 1
        self.waited[picked] = 0
        return picked

    @staticmethod
    def _spends_out(u) -> bool:
        """The client has nothing left to send: it sent nothing this round, or its budget ran out in it."""
        return bool(u.payload.get("stopped")) or u.metrics.get("budget_exhausted", 0.0) > 0

    def discarded(self, updates: Updates) -> Dict[int, Dict[str, float]]:
        # a NaN update that used up its client's budget (NbAFL's last upload, LBDP's last step) spent it all the
        # same: that client is not picked again, and its ledger line goes into this round's record. Its report
        # describes a broken model and is not kept.
        for i, u in updates:
            if self._spends_out(u):
                self.spent[i] = True
        return {i: self._ledger_line(u) for i, u in updates if "epsilon" in u.metrics}

    @staticmethod
    def _ledger_line(u) -> Dict[str, float]:
        """What ``fedcore.privacy.ledger.round_ledger_lines`` reads from a round's record for this client."""
        return {
            "epsilon": float(u.metrics["epsilon"]),
            "sigma": float(u.metrics["sigma"]),
            "budget_spent": float(bool(u.payload.get("stopped"))),
        }  # picked, and sent nothing

    def aggregate(self, global_state: State, updates: Updates, *, num_clients: int) -> Aggregated:
        live = [(i, u) for i, u in updates if not u.payload.get("stopped", False)]
        per_client: Dict[int, Dict[str, float]] = {}
        for i, u in updates:
            p = u.payload
            self.vectors[i] = [p["accuracy"], p["loss"], p["kappa"]]
            if self._spends_out(u):
                self.spent[i] = True
            per_client[i] = {
                "sel_score": float(self.scores[i]) if math.isfinite(self.scores[i]) else -1.0,
                "sel_forced": float(self.reasons.get(i) == "forced"),
                "client_acc": float(p["accuracy"]),
                "client_kappa": float(p["kappa"]),
            }
            if "epsilon" in u.metrics:
                per_client[i].update(self._ledger_line(u))
            if "update_norm" in u.metrics:  # NbAFL: the norm of what the client sent, before its clip
                per_client[i]["update_norm"] = float(u.metrics["update_norm"])
            for key in CLIP_STATS:  # DP-SGD: where the round's per-sample gradient norms sat against C
                if key in u.metrics:
                    per_client[i][key] = float(u.metrics[key])
        if not live:  # every selected client is out of privacy budget: the model stays
            return Aggregated(global_state, {"stopped_clients": float(len(updates))}, per_client)
        ids = [i for i, _ in live]
        self.counts[ids] += 1
        if self.weighting == "examples":
            w = np.array([u.num_examples for _, u in live], dtype=np.float64)
            w = w / w.sum()
        else:
            new = np.array([u.payload["new_examples"] for _, u in live], dtype=np.float64)
            tot = np.array([u.payload["total_examples"] for _, u in live], dtype=np.float64)
            gamma = MF.data_balance(new_examples=new, total_examples=tot, alpha=self.alpha)
            share = new / new.sum() if new.sum() > 0 else np.full(len(live), 1 / len(live))
            fresh = MF.freshness(round_index=self.round, last_round=[int(self.last_round[i]) for i in ids])
            acc = MF.relative_accuracy(accuracy=[u.payload["accuracy"] for _, u in live])
            part = MF.participation_factor(counts=self.counts, selected=ids)
            w = MF.multifactor_weights(
                gamma=gamma, data_share=share, fresh=fresh, accuracy=acc, participation=part, coeffs=self.coeffs
            )
        self.last_round[ids] = self.round
        for (i, _), wi in zip(live, w):
            per_client[i]["agg_weight"] = float(wi)
        state = weighted_average([(u.state, float(wi)) for (_, u), wi in zip(live, w)])
        return Aggregated(
            state,
            {
                "stopped_clients": float(len(updates) - len(live)),
                "weight_entropy": float(-(w * np.log(np.maximum(w, 1e-300))).sum()),
            },
            per_client,
        )

    def state_dict(self) -> Dict[str, Any]:
        return {
            "vectors": self.vectors.tolist(),
            "counts": self.counts.tolist(),
            "last_round": self.last_round.tolist(),
            "waited": self.waited.tolist(),
            "spent": self.spent.tolist(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.vectors = np.array(state["vectors"], dtype=np.float64)
        self.counts = np.array(state["counts"], dtype=np.int64)
        self.last_round = np.array(state["last_round"], dtype=np.int64)
        self.waited = np.array(state["waited"], dtype=np.int64)
        self.spent = np.array(state["spent"], dtype=bool)
