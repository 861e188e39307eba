"""What a system declares about itself, so that nothing else in the platform needs its name.

A :class:`System` is one research system on the platform (BPFedCTTA, DP-TTA, FedPAD, FedPD++,
PP-FCIL, or one of yours). The command line, the nightly job and its Prefect deployment, the model
registry, the round flow's inputs and reports, and the config checks read these fields; none of
them branches on a system's name or guesses its kind from the shape of its config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Literal, Tuple

from flows.config.schema import ARRIVAL_BLOCK, GRID_KEYS, round_block

Engine = Literal["arrivals", "rounds"]
ENGINES: Tuple[str, ...] = ("arrivals", "rounds")


@dataclass(frozen=True)
class System:
    """One system's declaration.

    Parameters
    ----------
    name:
        Its config block (``conf/experiment/<name>.yaml`` composes under ``<name>:``), its DVC stage
        prefix, its MLflow experiment (``fedcore-<name>`` for round-based systems) and its registry names.
    title, paper, page:
        How people call it, the paper it reproduces (title, venue, year), and its docs page.
    engine:
        ``arrivals`` (sequential test-time adaptation, :func:`fedcore.engine.run_arrivals`, variants laid
        over the root config) or ``rounds`` (synchronous rounds, :func:`fedcore.engine.run_rounds`, grids
        of method x seed cells).
    evaluation:
        How a round-based grid is built and judged: a name in :data:`flows.reports.evaluations.EVALUATIONS`
        (``domains``: per-domain accuracy, worst domain; ``openset``: AUROC and OSCR; ``incremental``:
        accuracy over tasks and forgetting). Arrival systems say ``arrivals``.
    headline:
        The summary metric a run is ranked, registered and reported by (higher is better).
    quick:
        The default a nightly run and ``make run`` use: a variant (arrivals) or a grid (rounds).
    partition_stage:
        Round-based systems: the DVC stage (and ``python -m flows.stages`` step) that builds a grid's
        partition, run as ``<partition_stage>@<grid>``.
    stages:
        Arrival systems: the DVC stages a nightly run rebuilds and pushes, in order. Round-based
        systems derive theirs from ``partition_stage`` and the grid.
    cron:
        The nightly deployment's schedule (UTC).
    config:
        A YAML file composed under ``<name>`` when conf/ has no block of that name (a plug-in's own grids
        and methods); the built-in systems' blocks are in ``conf/experiment/<name>.yaml``.
    grid_keys:
        Round-based systems: the settings its grids take (:data:`flows.config.schema.GRID_KEYS`, plus what its
        evaluation reads: an open-set grid's known and unknown classes, an incremental grid's tasks).
    settings:
        Keys of its config block beyond its engine's own (:mod:`flows.config.schema`: a round-based block takes
        ``grid``, ``stages``, ``target``, ``trainer``, ``methods`` and ``grids``; an arrival block ``variants``),
        each with its schema: ``LEAF`` for a value. A key outside these is refused as a misspelling.
    extra_steps:
        Steps of ``python -m flows.stages`` beyond the standard ones: name -> (``"module:function"``,
        keyword arguments); the function is called with the composed config and those arguments (a
        report pooled over grids, a privacy curve, a stress protocol).
    """

    name: str
    title: str
    paper: str
    page: str
    engine: Engine
    evaluation: str
    headline: str
    quick: str
    cron: str
    description: str
    partition_stage: str | None = None
    stages: Tuple[str, ...] = ()
    config: str | None = None
    grid_keys: FrozenSet[str] = GRID_KEYS
    settings: Dict[str, Any] = field(default_factory=dict)
    extra_steps: Dict[str, Tuple[str, Dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(
                f"system {self.name!r}: unknown engine {self.engine!r}; valid names are: {', '.join(ENGINES)}"
            )
        if self.engine == "rounds" and not self.partition_stage:
            raise ValueError(
                f"system {self.name!r} runs rounds but names no partition_stage (the step that "
                "builds a grid's partition, e.g. partition_domains)"
            )
        if self.engine == "arrivals" and not self.stages:
            raise ValueError(f"system {self.name!r} runs arrivals but lists no stages to rebuild and push")

    def schema(self) -> Dict[str, Any]:
        """Every key its config block takes (:mod:`flows.config.schema`)."""
        own = round_block(self.grid_keys) if self.engine == "rounds" else ARRIVAL_BLOCK
        return {**own, **self.settings}

    def nightly_stages(self, grid: str | None = None) -> list[str]:
        """The DVC stages a nightly run of ``grid`` (default: the quick one) writes, in order."""
        if self.engine == "arrivals":
            return list(self.stages)
        grid = grid or self.quick
        return [f"{self.partition_stage}@{grid}", f"{self.name}@{grid}"]

    def deployment(self) -> Dict[str, Any]:
        """This system's nightly deployment, as ``infra/prefect.yaml`` lists it."""
        flow = "nightly" if self.engine == "arrivals" else "nightly_rounds"
        params: Dict[str, Any] = {"system": self.name}
        if self.engine == "rounds":
            params["grid"] = self.quick
        params.update({"overrides": [], "push": True})
        return {
            "name": f"nightly-{self.name}",
            "description": self.description,
            "entrypoint": f"flows/runs/nightly.py:{flow}",
            "work_pool": {"name": "fedcore-process"},
            "parameters": params,
            "schedules": [{"cron": self.cron, "timezone": "UTC"}],
        }
