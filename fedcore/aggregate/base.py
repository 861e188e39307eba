"""What every round strategy is: the server side of synchronous federated training, chosen by name.

A strategy is a thin holder of settings and server state around the pure functions in
:mod:`fedcore.aggregate.functions` and :mod:`fedcore.aggregate.prototypes`:

* ``setup(global_state, num_clients)``: fresh server state for a new run;
* ``broadcast()``: what every selected client receives besides the weights;
* ``aggregate(global_state, updates, num_clients)`` -> :class:`Aggregated`;
* ``fold(global_state, sizes, num_clients)`` -> :class:`Fold`: the same aggregation fed one update
  at a time, so a server whose rule is a weighted sum never holds a round's updates (the engine
  always aggregates through it; the default keeps every update and calls ``aggregate``);
* ``state_dict()`` / ``load_state_dict()``: everything it must remember, checkpointed each round.

``trainer`` names the local objective it is written for; the engine refuses other pairings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

from fedcore.aggregate.functions import weighted_average
from fedcore.registry import Registry
from fedcore.types import ClientUpdate, State

Updates = Sequence[Tuple[int, ClientUpdate]]


@dataclass
class Aggregated:
    """A round's server result: the new global weights, round metrics, and per-client diagnostics."""

    state: State
    metrics: Dict[str, float] = field(default_factory=dict)
    per_client: Dict[int, Dict[str, float]] = field(default_factory=dict)


class Strategy:
    """FedAvg: the example-weighted average of the client models (McMahan et al. 2017)."""

    trainer: Tuple[str, ...] = ("sgd", "prox", "proser")  # local objectives this server rule is written for
    needs_model = False  # True: the engine calls bind_model(network) before setup (alignment needs the layers)
    # How the average weighs each client's model, for reports: "examples" (by example count), "clients" (each
    # alike), or the per-client metric of the round's record that holds the weight (FedPAD: "alpha"); None
    # where no one weight per client says it (alignment, client selection).
    client_weighting: str | None = None

    @property
    def weighting_label(self) -> str:
        """How :attr:`client_weighting` reads beside a method's row: ``n`` (examples), ``1/m`` (clients alike)."""
        return {"examples": "n", "clients": "1/m"}.get(self.client_weighting or "", "–")

    def setup(self, global_state: State, *, num_clients: int, param_keys: Sequence[str]) -> None:
        """Fresh server state; ``param_keys`` are the trainable entries (the rest are buffers)."""
        self.param_keys = list(param_keys)

    def broadcast(self) -> Dict[str, Any]:
        return {}

    def select(self, round_index: int, default: List[int], *, num_clients: int) -> List[int]:
        """The clients of round ``round_index``; ``default`` is the run's seeded sample (or everyone)."""
        return default

    def aggregate(self, global_state: State, updates: Updates, *, num_clients: int) -> Aggregated:
        return Aggregated(weighted_average([(u.state, u.num_examples) for _, u in updates]))

    def fold(self, global_state: State, *, sizes: Sequence[int], num_clients: int) -> "Fold":
        """The round's aggregation fed one update at a time, in the round's client order.

        ``sizes``: the examples each selected client is given, in that order (what a weighted sum
        needs before the first update arrives). This default keeps every update and calls
        :meth:`aggregate` at the end: right for a server that needs the whole round at once
        (alignment, client selection, prototypes). A server whose rule is a weighted sum is a
        :class:`FoldingStrategy` and holds a constant number of model-sized sums instead.
        """
        return Fold(self, global_state, num_clients=num_clients)

    def discarded(self, updates: Updates) -> Dict[int, Dict[str, float]]:
        """Updates of this round that the engine will not merge (weights with NaN or inf), before
        :meth:`aggregate`: their weights are unusable, but what their sending implies (a privacy budget
        spent) still holds. Returns per-client diagnostics for the round's record (merged into
        ``Aggregated.per_client``, also in a round where every update is discarded). Most servers ignore them."""
        return {}

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass


class Fold:
    """One round's aggregation in progress: :meth:`add` each merged update, then :meth:`finish` once.

    This one keeps the updates and hands them to ``strategy.aggregate``; streaming folds subclass it.
    """

    def __init__(self, strategy: Strategy, global_state: State, *, num_clients: int) -> None:
        self.strategy, self.global_state, self.num_clients = strategy, global_state, num_clients
        self.updates: List[Tuple[int, ClientUpdate]] = []

    def add(self, client: int, update: ClientUpdate) -> None:
        self.updates.append((client, update))

    def finish(self) -> Aggregated:
        return self.strategy.aggregate(self.global_state, self.updates, num_clients=self.num_clients)


class FoldingStrategy(Strategy):
    """A strategy whose rule is a weighted sum, taken one update at a time: it defines :meth:`new_fold`.

    Its :meth:`aggregate` folds in every update of the list, so the two can never disagree. A
    subclass that replaces ``aggregate`` with a rule of its own is handed the whole round instead
    (folding the parent's sum would silently train the parent).
    """

    def new_fold(self, global_state: State, *, sizes: Sequence[int], num_clients: int) -> Fold:
        raise NotImplementedError

    def fold(self, global_state: State, *, sizes: Sequence[int], num_clients: int) -> Fold:
        if type(self).aggregate is not FoldingStrategy.aggregate:
            return Fold(self, global_state, num_clients=num_clients)
        return self.new_fold(global_state, sizes=sizes, num_clients=num_clients)

    def aggregate(self, global_state: State, updates: Updates, *, num_clients: int) -> Aggregated:
        fold = self.new_fold(global_state, sizes=[u.num_examples for _, u in updates], num_clients=num_clients)
        for i, u in updates:
            fold.add(i, u)
        return fold.finish()


STRATEGIES: Registry[Strategy] = Registry("strategy")


def create_strategy(name: str, **settings) -> Strategy:
    """A strategy by name, e.g. ``create_strategy("fedpad", gamma=0.1)``; bad names and settings list the valid ones."""
    return STRATEGIES.create(name, **settings)
