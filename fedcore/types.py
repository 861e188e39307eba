"""The types every layer of fedcore shares: a model's weights, how to rebuild a network, who holds
what in a round-based run, and what a client sends back.

They live below the loops and methods that use them (``train``, ``aggregate``, ``openset``,
``incremental``, ``data``, ``engine``), so that none of those imports from a layer above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple, cast

import numpy as np
import torch
from torch import nn

State = Dict[str, torch.Tensor]
"""A model's weights: a ``state_dict`` (parameter and buffer name -> tensor)."""


@dataclass(frozen=True)
class ModelSpec:
    """Enough to rebuild the network on any worker."""

    name: str
    in_channels: int
    num_classes: int
    norm: str = "batch"

    def build(self) -> nn.Module:
        from fedcore.models import create_model

        return create_model(self.name, in_channels=self.in_channels, num_classes=self.num_classes, norm=self.norm)


@dataclass
class RoundData:
    """Who holds what: each client's labelled data, its group (domain), and the evaluation sets.

    Data that arrives in tasks (class-incremental learning) also gives ``client_task`` (the task
    of every sample), ``task_classes`` (the classes of each task) and ``rounds_per_task``: in
    task t a client trains only on its samples of task t, and every client is told the task.
    """

    client_x: List[np.ndarray]
    client_y: List[np.ndarray]
    client_group: List[str]
    eval_sets: Dict[str, Tuple[np.ndarray, np.ndarray]]
    client_task: List[np.ndarray] | None = None
    task_classes: List[List[int]] | None = None
    rounds_per_task: int | None = None

    def __post_init__(self) -> None:
        if not self.client_x:
            raise ValueError("a round-based run needs at least one client")
        if not len(self.client_x) == len(self.client_y) == len(self.client_group):
            raise ValueError("client_x, client_y and client_group must have one entry per client")
        staged = (self.client_task is not None, self.task_classes is not None, self.rounds_per_task is not None)
        if any(staged) and not all(staged):
            raise ValueError("data in tasks needs all of client_task, task_classes and rounds_per_task")
        if self.staged:  # then (checked above) client_task, task_classes and rounds_per_task are all set
            client_task = cast(List[np.ndarray], self.client_task)
            if len(client_task) != self.num_clients or any(
                len(t) != len(y) for t, y in zip(client_task, self.client_y)
            ):
                raise ValueError("client_task must give the task of every sample of every client")
            if int(cast(int, self.rounds_per_task)) < 1:
                raise ValueError(f"rounds_per_task must be >= 1, got {self.rounds_per_task}")

    @property
    def num_clients(self) -> int:
        return len(self.client_x)

    @property
    def staged(self) -> bool:
        return self.client_task is not None

    def task_of(self, round_index: int) -> int:
        # staged: __post_init__ checked that rounds_per_task and task_classes are set
        return (
            min(round_index // int(cast(int, self.rounds_per_task)), len(cast(List[List[int]], self.task_classes)) - 1)
            if self.staged
            else 0
        )

    def client_data(self, client: int, round_index: int) -> Tuple[np.ndarray, np.ndarray]:
        """What client ``client`` trains on in round ``round_index``: all its data, or its data of that task."""
        if not self.staged:
            return self.client_x[client], self.client_y[client]
        keep = cast(List[np.ndarray], self.client_task)[client] == self.task_of(round_index)
        return self.client_x[client][keep], self.client_y[client][keep]

    def client_size(self, client: int, round_index: int) -> int:
        """How many examples :meth:`client_data` gives, without slicing them out."""
        if not self.staged:
            return len(self.client_y[client])
        return int((cast(List[np.ndarray], self.client_task)[client] == self.task_of(round_index)).sum())


@dataclass
class ClientUpdate:
    """What a client sends back after a round.

    Attributes
    ----------
    state:
        The client's weights (a CPU ``state_dict``).
    num_examples:
        How many labelled samples it trained on.
    metrics:
        Scalars for the record (``train_loss``, ...).
    client_state:
        What the server keeps for this client until its next round (SCAFFOLD's c_i, FedDyn's
        gradient memory): checkpointed with the server, never kept on a worker.
    payload:
        Typed extras for the strategy: prototypes with class counts now; masks, BN statistics
        or accuracy vectors later.
    """

    state: State
    num_examples: int
    metrics: Dict[str, float] = field(default_factory=dict)
    client_state: Dict[str, Any] = field(default_factory=dict)
    payload: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MergeHistory:
    """What the server remembers between arrivals (checkpointed with the flow)."""

    sigmas: Tuple[float, ...] = ()
    weights: Tuple[float, ...] = ()
    merged: int = 0  # client models merged so far
