"""Class-incremental schedules: which classes arrive in which task, and who holds what in each task.

A schedule is a list of tasks, each a list of classes; no class may appear twice and no task may
be empty. :func:`incremental_view` deals each task's samples out to the clients with Dirichlet
label skew (the non-IID shares inside each task), so every client sees the same task order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np


@dataclass(frozen=True)
class TaskSchedule:
    """The classes of each task, in arrival order."""

    tasks: Tuple[Tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("a task schedule needs at least one task")
        seen: Dict[int, int] = {}
        for t, classes in enumerate(self.tasks):
            if not classes:
                raise ValueError(f"task {t} of the schedule has no classes; every task must bring at least one")
            for c in classes:
                if int(c) != c or c < 0:
                    raise ValueError(f"task {t}: class {c!r} is not a class index >= 0")
                if c in seen:
                    raise ValueError(
                        f"class {c} appears in task {seen[c]} and again in task {t}; "
                        "class-incremental tasks must have disjoint classes"
                    )
                seen[int(c)] = t

    @classmethod
    def of(cls, tasks: Sequence[Sequence[int]]) -> "TaskSchedule":
        return cls(tuple(tuple(int(c) for c in t) for t in tasks))

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    def seen(self, task: int) -> List[int]:
        """Every class of tasks 0..``task``."""
        return [c for t in self.tasks[: task + 1] for c in t]

    def task_of_class(self) -> Dict[int, int]:
        return {c: t for t, classes in enumerate(self.tasks) for c in classes}

    def as_lists(self) -> List[List[int]]:
        return [list(t) for t in self.tasks]


def make_schedule(*, num_classes: int, tasks: int, seed: int | None = None) -> TaskSchedule:
    """``num_classes`` classes split into ``tasks`` tasks of (nearly) equal size.

    ``seed=None`` keeps the classes in order (0, 1 | 2, 3 | ...); a seed shuffles the class order
    first, as class-incremental benchmarks do.
    """
    if tasks < 1 or tasks > num_classes:
        raise ValueError(f"cannot split {num_classes} classes into {tasks} tasks; use 1 <= tasks <= {num_classes}")
    order = np.arange(num_classes) if seed is None else np.random.default_rng(seed).permutation(num_classes)
    return TaskSchedule.of([list(map(int, part)) for part in np.array_split(order, tasks)])


def split_by_task(
    y: np.ndarray, schedule: TaskSchedule, *, num_clients: int, alpha: float, seed: int, min_per_task: int = 1
) -> List[np.ndarray]:
    """Indices of each client's samples: every class's samples dealt out by Dirichlet(α) proportions.

    Samples of classes outside the schedule are dropped. A small α gives each client few classes
    of a task; α → ∞ gives IID shares. Redrawn (seeded) until every client has at least
    ``min_per_task`` samples in every task.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if not alpha > 0:
        raise ValueError(f"the Dirichlet concentration alpha must be > 0, got {alpha}")
    rng = np.random.default_rng(seed)
    classes = schedule.task_of_class()
    missing = [c for c in classes if not np.any(y == c)]
    if missing:
        raise ValueError(f"the schedule names classes {missing} that the data does not have")
    for _attempt in range(100):
        owned: List[List[int]] = [[] for _ in range(num_clients)]
        for c in sorted(classes):
            idx = rng.permutation(np.flatnonzero(y == c))
            share = rng.dirichlet(np.full(num_clients, float(alpha)))
            cuts = (np.cumsum(share)[:-1] * len(idx)).astype(int)
            for k, part in enumerate(np.split(idx, cuts)):
                owned[k].extend(part.tolist())
        per_task = np.zeros((num_clients, schedule.num_tasks), dtype=int)
        for k in range(num_clients):
            for i in owned[k]:
                per_task[k, classes[int(y[i])]] += 1
        if per_task.min() >= min_per_task:
            return [np.sort(np.asarray(o, dtype=np.int64)) for o in owned]
    raise ValueError(
        f"could not give each of {num_clients} clients {min_per_task} samples in every task with "
        f"alpha={alpha}; raise alpha or use fewer clients"
    )


def incremental_view(
    x: np.ndarray,
    y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    schedule: TaskSchedule,
    *,
    num_clients: int,
    alpha: float,
    rounds_per_task: int,
    seed: int,
    group: str = "all",
):
    """The round engine's input for class-incremental training (:class:`fedcore.engine.RoundData`).

    Clients get Dirichlet shares of each task (:func:`split_by_task`); the test set keeps the
    schedule's classes and is the one evaluation set.
    """
    from fedcore.types import RoundData

    owned = split_by_task(y, schedule, num_clients=num_clients, alpha=alpha, seed=seed)
    task_of = schedule.task_of_class()
    to_task = np.vectorize(lambda c: task_of[int(c)], otypes=[np.int64])
    keep = np.isin(test_y, list(task_of))
    return RoundData(
        client_x=[x[o] for o in owned],
        client_y=[y[o] for o in owned],
        client_group=[group] * num_clients,
        eval_sets={"test": (test_x[keep], test_y[keep])},
        client_task=[to_task(y[o]) for o in owned],
        task_classes=schedule.as_lists(),
        rounds_per_task=int(rounds_per_task),
    )
