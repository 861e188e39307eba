"""Synchronous rounds: select clients, train them (as tasks), aggregate, evaluate, checkpoint.

:func:`run_rounds` is the one round loop. The plain driver runs each client step at once; the
Prefect flow passes its own ``submit`` that runs the same :func:`train_step` as a task on Ray.
Source pretraining is this loop with the ``sgd`` trainer and ``fedavg``.

The server keeps everything that must outlive a round (the strategy's state, each client's
``client_state``, the records) and writes it atomically after every round, so a killed run
resumes where it stopped with identical results.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import time
import warnings
from collections.abc import Sequence as SequenceABC
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Protocol, Sequence, Tuple, cast

import numpy as np
import torch

from fedcore.aggregate.strategies import STRATEGIES, Aggregated, Fold, Strategy, create_strategy
from fedcore.engine.checkpoint import CheckpointError, RunInterrupted, load_state, save_state
from fedcore.engine.spec import init_state
from fedcore.engine.submit import Submit, SubmitRound, run_now
from fedcore.evaluate import accuracy
from fedcore.models import check_feature_layer
from fedcore.tensors import resolve_device
from fedcore.train import TRAINERS, create_trainer
from fedcore.types import ClientUpdate, ModelSpec, RoundData, State


class _ModelBound(Protocol):
    """A strategy with ``needs_model``: the engine hands it the network before setup."""

    def bind_model(self, model: torch.nn.Module) -> None: ...


@dataclass(frozen=True)
class RoundConfig:
    """Settings of one round-based experiment; every name and setting is checked on creation.

    ``participation`` is the fraction of clients selected each round (seeded, reproducible).
    """

    rounds: int = 10
    trainer: str = "sgd"
    trainer_params: Dict[str, Any] = field(default_factory=dict)
    strategy: str = "fedavg"
    strategy_params: Dict[str, Any] = field(default_factory=dict)
    participation: float = 1.0
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if not 0 < self.participation <= 1:
            raise ValueError(
                f"participation must be in (0, 1], got {self.participation}; "
                "1.0 selects every client, 0.2 a fifth of them each round"
            )
        trainer, strategy = self.make_trainer(), self.make_strategy()
        if self.trainer not in strategy.trainer:
            raise ValueError(
                f"strategy {self.strategy!r} is written for the trainer(s) "
                f"{', '.join(strategy.trainer)}, not {self.trainer!r}; set trainer to one of them"
            )
        shared = {"alpha"} & set(vars(trainer)) & set(vars(strategy))
        for key in sorted(shared):  # FedDyn's alpha is one number used on both sides
            if getattr(trainer, key) != getattr(strategy, key):
                raise ValueError(
                    f"trainer and strategy disagree on {key} ({getattr(trainer, key)} vs "
                    f"{getattr(strategy, key)}); set both to the same value"
                )

    def make_trainer(self):
        return create_trainer(self.trainer, **self.trainer_params)

    def make_strategy(self) -> Strategy:
        return create_strategy(self.strategy, **self.strategy_params)

    def select(self, round_index: int, num_clients: int) -> List[int]:
        """The clients of round ``round_index``: all, or a seeded sample of ⌈participation·N⌉ (at least 1)."""
        if self.participation >= 1:
            return list(range(num_clients))
        k = max(1, int(math.ceil(self.participation * num_clients - 1e-9)))
        rng = np.random.default_rng([self.seed, round_index, 0x5E1EC7])
        return sorted(int(i) for i in rng.choice(num_clients, size=k, replace=False))

    def client_seed(self, round_index: int, client_id: int) -> int:
        return self.seed * 100_003 + round_index * 1009 + client_id

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True, default=str).encode()).hexdigest()[:16]


def train_step(
    *,
    global_state: State,
    spec: ModelSpec,
    x: np.ndarray,
    y: np.ndarray,
    trainer: str,
    trainer_params: Dict[str, Any],
    broadcast: Dict[str, Any],
    client_state: Dict[str, Any],
    seed: int,
    device: str = "cpu",
    client_id: int = -1,
    round_index: int = -1,
) -> ClientUpdate:
    """One client's round: load the global weights, train locally, return the update.

    ``client_id`` and ``round_index`` only name the step (task names, logs); the result depends on ``seed``.
    """
    torch.manual_seed(seed)
    model = spec.build()
    model.load_state_dict(global_state)
    return create_trainer(trainer, **trainer_params).train(
        model,
        x,
        y,
        global_state=global_state,
        seed=seed,
        broadcast=broadcast,
        client_state=client_state,
        device=resolve_device(device),
    )


def evaluate_sets(
    state: State, spec: ModelSpec, sets: Mapping[str, Tuple[np.ndarray, np.ndarray]], *, device: str = "cpu"
) -> Dict[str, float]:
    """Accuracy (eval mode) on every named set, plus their mean ``avg_acc`` and minimum ``worst_acc``."""
    dev = resolve_device(device)
    model = spec.build().to(dev)
    model.load_state_dict(state)
    out = {f"acc.{name}": accuracy(model, x, y, device=dev) for name, (x, y) in sets.items()}
    if out:
        out["avg_acc"] = float(np.mean(list(out.values())))
        out["worst_acc"] = float(min(v for k, v in out.items() if k.startswith("acc.")))
    return out


def state_bytes(state: Mapping[str, Any]) -> int:
    """Bytes of the tensors in a (possibly nested) state or payload."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, Mapping):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def is_finite_update(update: ClientUpdate) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in update.state.values() if t.is_floating_point())


@dataclass
class RoundsResult:
    records: List[Dict[str, Any]]  # one per round
    final_state: State
    summary: Dict[str, float]
    ledgers: Dict[int, Dict[str, Any]] = field(default_factory=dict)  # each private client's ledger at the end


RoundHook = Callable[[Dict[str, Any], State], None]


def run_rounds(
    data: RoundData,
    spec: ModelSpec,
    cfg: RoundConfig,
    *,
    init: State | None = None,
    submit: Submit = run_now,
    submit_round: SubmitRound | None = None,
    evaluate: Callable[[State], Dict[str, float]] | None = None,
    checkpoint_dir: str | Path | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    on_round: RoundHook | None = None,
    progress: bool = False,
    desc: str | None = None,
) -> RoundsResult:
    """Synchronous federated training for ``cfg.rounds`` rounds.

    Parameters
    ----------
    init:
        Starting weights; default: the network initialised under ``cfg.seed``.
    submit, submit_round:
        How the client steps run: ``submit(train_step, **call)`` per client (default: in this
        process, each client trained when the round takes its update), or
        ``submit_round(train_step, calls, take)`` with the whole round's calls, which hands each
        result to ``take`` in call order as it becomes ready (a flow that orchestrates a round as
        one unit; see :data:`fedcore.engine.submit.SubmitRound`). Each update is folded into the
        round's aggregate as it is taken (:meth:`fedcore.aggregate.base.Strategy.fold`).
    evaluate:
        ``state -> metrics`` after every round; default: accuracy on ``data.eval_sets``.
    checkpoint_dir, resume, stop_after:
        The server state is saved atomically after every round; ``resume`` continues after the
        last saved round; ``stop_after`` raises :class:`RunInterrupted` once that many rounds are saved.
    on_round:
        Called with each round's record and the new global state, after the checkpoint.
    """
    strategy = cfg.make_strategy()
    # staged data has task_classes and rounds_per_task (RoundData checks it); both are read only when staged
    tasks, per_task = cast(List[List[int]], data.task_classes), cast(int, data.rounds_per_task)
    if data.staged and cfg.rounds != len(tasks) * int(per_task):
        raise ValueError(
            f"rounds ({cfg.rounds}) must be tasks x rounds_per_task ({len(tasks)} x "
            f"{per_task} = {len(tasks) * int(per_task)})"
        )
    if cfg.make_trainer().needs_features:
        check_feature_layer(spec.build())  # a model without a feature layer fails before any work
    evaluate = evaluate or (lambda s: evaluate_sets(s, spec, data.eval_sets, device=cfg.device))
    param_keys = [k for k, _ in spec.build().named_parameters()]
    if strategy.needs_model:
        # a network the strategy cannot handle fails before any work
        cast(_ModelBound, strategy).bind_model(spec.build())
    folder = Path(checkpoint_dir) if checkpoint_dir is not None else None
    fp = cfg.fingerprint()
    state = init_state(spec, cfg.seed) if init is None else {k: v.clone() for k, v in init.items()}
    strategy.setup(state, num_clients=data.num_clients, param_keys=param_keys)
    token = secrets.token_hex(4)  # this call's files: never the name of a file an older checkpoint names
    clients = _ClientStates(folder, fingerprint=fp, token=token)
    records: List[Dict[str, Any]] = []
    done = 0
    if folder is not None:
        found = load_state(folder, fingerprint=fp if resume else None)  # corrupt -> CheckpointError, untouched
        if resume and found is not None:
            p = found.payload
            done, state, records = int(p["done"]), p["global_state"], list(p["records"])
            clients.resume_from(p)
            strategy.load_state_dict(p["strategy"])
    model_bytes = state_bytes(state)
    steps = range(done, cfg.rounds)
    first = done  # the first round this call runs
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(
            steps, desc=desc or f"{cfg.trainer}+{cfg.strategy} rounds", unit="round", initial=done, total=cfg.rounds
        )
    for r in steps:
        selected = strategy.select(r, cfg.select(r, data.num_clients), num_clients=data.num_clients)
        # every client also learns where it is in the schedule (FedPD++'s mask threshold rises with it)
        broadcast = {
            **strategy.broadcast(),
            "round": r,
            "rounds": cfg.rounds,
            "seed": cfg.seed,
            "participation": cfg.participation,
        }
        if data.staged:
            broadcast.update(task=data.task_of(r), task_classes=data.task_classes, rounds_per_task=int(per_task))

        def call(i: int, r: int = r, broadcast: Dict[str, Any] = broadcast, state: State = state) -> Dict[str, Any]:
            x, y = data.client_data(i, r)
            return dict(
                global_state=state,
                spec=spec,
                x=x,
                y=y,
                trainer=cfg.trainer,
                trainer_params=dict(cfg.trainer_params),
                broadcast=broadcast,
                client_state=clients.get(i),
                seed=cfg.client_seed(r, i),
                device=cfg.device,
                client_id=i,
                round_index=r,
            )

        calls = _Calls(selected, call)  # each built when asked for: a saved client state is read then
        sizes = [data.client_size(i, r) for i in selected]
        before = dict(clients.saved_at)  # the files the last checkpoint names
        intake = _Intake(strategy.fold(state, sizes=sizes, num_clients=data.num_clients), r, selected, data, clients)
        if submit_round is not None:
            submit_round(train_step, calls, intake)
        elif submit is run_now:  # one client at a time: each update is folded in before the next is trained
            for j in range(len(calls)):
                intake(j, submit(train_step, **calls[j]).result())
        else:
            futures = [submit(train_step, **calls[j]) for j in range(len(calls))]
            for j, fut in enumerate(futures):
                intake(j, fut.result())
            del futures
        del calls
        if intake.taken != len(selected):
            raise RuntimeError(f"round {r}: {intake.taken} of {len(selected)} client updates were handed over")
        updates, dropped, agg_seconds = intake.updates, intake.dropped, intake.agg_seconds
        refused = [i for i, _ in dropped]
        lines = strategy.discarded(dropped) if dropped else {}
        t0 = time.perf_counter()
        agg = intake.fold.finish() if updates else Aggregated(state)
        for i, line in (lines or {}).items():  # what the server says of the dropped, in every round
            agg.per_client.setdefault(i, {}).update(line)
        new_state = agg.state
        agg_seconds += time.perf_counter() - t0
        for i, upd in dropped:  # sent, so spent: a client whose update is not merged still keeps its privacy account
            if upd.client_state and "ledger" in upd.client_state:
                clients.set(i, {**clients.get(i), "ledger": upd.client_state["ledger"]}, round_index=r)
        record = _round_record(
            r,
            data,
            updates,
            refused,
            agg,
            agg_seconds,
            new_state,
            param_keys,
            bytes_down=len(selected) * (model_bytes + state_bytes(broadcast)),
            bytes_up=intake.bytes_up,
        )
        if data.staged:
            record["task"] = data.task_of(r)
        record.update(evaluate(new_state))
        records.append(record)
        state, done = new_state, r + 1
        if folder is not None:
            if r == first:
                clients.write_unsaved(round_index=r)
            _save_round(folder, r, state, strategy, clients, before, records, fingerprint=fp, sweep=r == first)
        if on_round is not None:
            on_round(record, state)
        if stop_after is not None and done >= stop_after and done < cfg.rounds:
            raise RunInterrupted(f"stopped after round {done} as asked; resume to continue")
    return RoundsResult(
        records=records,
        final_state=state,
        summary=summarise_rounds(records),
        ledgers=clients.ledgers(),
    )


class _Intake:
    """Takes a round's updates one at a time, in client order (the ``take`` of a ``submit_round``).

    A finite update is folded into the round's aggregate, its client state handed to the store, and
    the rest kept without its weights (what the round's record needs); one with NaN or inf is set
    aside with a warning. So a weighted-sum server never holds the round's models.
    """

    def __init__(
        self, fold: Fold, round_index: int, selected: Sequence[int], data: RoundData, clients: _ClientStates
    ) -> None:
        self.fold, self.round_index, self.selected, self.data = fold, round_index, list(selected), data
        self.clients = clients
        self.updates: List[Tuple[int, ClientUpdate]] = []
        self.dropped: List[Tuple[int, ClientUpdate]] = []
        self.agg_seconds, self.bytes_up, self.taken = 0.0, 0, 0

    def __call__(self, j: int, upd: ClientUpdate) -> None:
        if j != self.taken:
            raise RuntimeError(
                f"round {self.round_index}: update {j} handed over after {self.taken}; a submit_round must hand "
                "each call's result over once, in call order"
            )
        self.taken += 1
        i = self.selected[j]
        if not is_finite_update(upd):
            self.dropped.append((i, upd))
            warnings.warn(
                f"round {self.round_index}: client {i} ({self.data.client_group[i]}) sent weights with NaN or "
                "inf; its update is not merged (if this repeats, lower its learning rate, or the noise it adds)",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        t0 = time.perf_counter()
        self.fold.add(i, upd)
        self.agg_seconds += time.perf_counter() - t0
        self.bytes_up += state_bytes(upd.state) + state_bytes(upd.payload)
        if upd.client_state:  # what the server keeps for the client: saved now, not held for the round
            self.clients.set(i, upd.client_state, round_index=self.round_index)
        self.updates.append((i, replace(upd, state={}, payload={}, client_state={})))


CLIENTS_DIR = "clients"  # in a rounds checkpoint: c<client>-r<round>-<run>.pt, each client's state as of that round


def _client_file(client: int, *, round_index: int, token: str) -> str:
    return f"c{client}-r{round_index:05d}-{token}"


def _save_round(
    folder: Path,
    r: int,
    state: State,
    strategy: Strategy,
    clients: "_ClientStates",
    before: Mapping[int, str],
    records: List[Dict[str, Any]],
    *,
    fingerprint: str,
    sweep: bool = False,
) -> None:
    """Checkpoint round ``r``: the server's state, which names each client's file (the round's clients wrote
    theirs as their updates were taken). A new client file never replaces one a checkpoint names, so a
    crash at any point leaves the last checkpoint whole; the files it does not name (a crashed round's,
    another run's) are removed once the server's state is written: those this round replaced
    (``before``: the files the last checkpoint named), and with ``sweep`` (a call's first save) every one."""
    payload = {
        "done": r + 1,
        "global_state": state,
        "strategy": strategy.state_dict(),
        "client_files": dict(clients.saved_at),
        "ledgered": sorted(clients.ledgered),
        "records": records,
    }
    save_state(folder, payload, fingerprint=fingerprint)
    named = set(clients.saved_at.values())
    stale = [f"{old}{suffix}" for old in before.values() if old not in named for suffix in (".pt", ".sha256")]
    where = folder / CLIENTS_DIR
    if sweep and where.is_dir():
        stale += [f.name for f in where.iterdir() if f.name.split(".")[0] not in named]
    for f in stale:
        (where / f).unlink(missing_ok=True)


class _ClientStates:
    """Each client's saved state (``client_state``: SCAFFOLD's c_i, a privacy ledger) between its rounds.

    With a checkpoint folder a state is written to a file of its own (:data:`CLIENTS_DIR`) as soon as
    the round takes it, and read back when the client is next selected: the driver holds no client's
    state between its rounds, however many clients it has seen (SCAFFOLD at K = 10,000 would otherwise
    keep a model's size per client ever trained). Without a folder they are kept in memory.
    """

    def __init__(self, folder: Path | None, *, fingerprint: str, token: str) -> None:
        self.folder = folder / CLIENTS_DIR if folder is not None else None
        self.fingerprint, self.token = fingerprint, token
        self.memory: Dict[int, Dict[str, Any]] = {}
        self.saved_at: Dict[int, str] = {}  # client -> its file (no suffix) in the folder
        self.ledgered: set[int] = set()  # clients whose state holds a privacy ledger
        self.unsaved: List[int] = []  # read from a checkpoint that held the states inside: written at the first save

    def resume_from(self, payload: Mapping[str, Any]) -> None:
        if "client_states" in payload:  # a checkpoint written before client files: the states themselves
            self.memory = {int(k): v for k, v in payload["client_states"].items()}
            self.unsaved = sorted(self.memory)
            self.ledgered = {i for i, v in self.memory.items() if "ledger" in v}
            return
        self.saved_at = {int(k): str(v) for k, v in payload["client_files"].items()}
        for i in self.saved_at:  # every file the checkpoint names must be there and whole, before any work
            self._read(i, check_only=True)
        if "ledgered" in payload:
            self.ledgered = {int(i) for i in payload["ledgered"]}
        else:  # an older checkpoint does not say which: look
            self.ledgered = {i for i in self.saved_at if "ledger" in self._read(i)}

    def get(self, i: int) -> Dict[str, Any]:
        if i in self.memory:
            return self.memory[i]
        return self._read(i) if i in self.saved_at else {}

    def set(self, i: int, state: Dict[str, Any], *, round_index: int) -> None:
        if "ledger" in state:
            self.ledgered.add(i)
        else:
            self.ledgered.discard(i)
        if self.folder is None:
            self.memory[i] = state
            return
        name = _client_file(i, round_index=round_index, token=self.token)
        save_state(self.folder, {"state": state}, fingerprint=self.fingerprint, name=name)
        self.saved_at[i] = name
        self.memory.pop(i, None)

    def write_unsaved(self, *, round_index: int) -> None:
        for i in self.unsaved:
            if i in self.memory:  # not replaced by this round
                self.set(i, self.memory[i], round_index=round_index)
        self.unsaved = []

    def ledgers(self) -> Dict[int, Any]:
        return {i: self.get(i)["ledger"] for i in sorted(self.ledgered)}

    def _read(self, i: int, *, check_only: bool = False) -> Dict[str, Any]:
        assert self.folder is not None
        found = load_state(self.folder, fingerprint=self.fingerprint, name=self.saved_at[i])
        if found is None:
            raise CheckpointError(
                f"the checkpoint in {self.folder.parent} names {CLIENTS_DIR}/{self.saved_at[i]}.pt, client {i}'s "
                "state, which is missing; restore the folder whole, or move it away to start fresh"
            )
        return {} if check_only else found.payload["state"]


class _Calls(SequenceABC):
    """A round's client calls, each built when asked for (a client's saved state is read from its file then)."""

    def __init__(self, selected: Sequence[int], make: Callable[[int], Dict[str, Any]]) -> None:
        self.selected, self.make = list(selected), make

    def __len__(self) -> int:
        return len(self.selected)

    def __getitem__(self, j):
        if not isinstance(j, int):
            raise TypeError("a round's calls are taken one index at a time")
        return self.make(self.selected[j])


def load_client_states(folder: str | Path) -> Dict[int, Dict[str, Any]]:
    """Every client's saved state in a rounds checkpoint folder (empty when there is none)."""
    found = load_state(folder)
    if found is None:
        return {}
    clients = _ClientStates(Path(folder), fingerprint=found.fingerprint, token="")
    clients.resume_from(found.payload)
    return {i: clients.get(i) for i in sorted({*clients.memory, *clients.saved_at})}


def _round_record(
    r: int,
    data: RoundData,
    updates,
    refused,
    agg,
    agg_seconds: float,
    state: State,
    param_keys: Sequence[str],
    *,
    bytes_down: int,
    bytes_up: int,
) -> Dict[str, Any]:
    n = sum(u.num_examples for _, u in updates)
    rec: Dict[str, Any] = {
        "round": r,
        "clients": [i for i, _ in updates],
        "refused": list(refused),
        "train_loss": sum(u.metrics["train_loss"] * u.num_examples for _, u in updates) / n if n else float("nan"),
        "agg_seconds": agg_seconds,
        "bytes_up": int(bytes_up),
        "bytes_down": int(bytes_down),
        "model_norm": math.sqrt(sum(float((state[k].double() ** 2).sum()) for k in param_keys)),
        **{k: float(v) for k, v in agg.metrics.items()},
    }
    groups: Dict[str, Dict[str, List[float]]] = {}
    for cid, values in sorted(agg.per_client.items()):
        for key, v in values.items():
            rec[f"{key}.c{cid}"] = float(v)
            groups.setdefault(key, {}).setdefault(data.client_group[cid], []).append(float(v))
    for key, by_group in groups.items():  # e.g. proto_dist.<domain>: the paper's Fig. 8 per domain
        for g, vals in by_group.items():
            finite = [v for v in vals if math.isfinite(v)]
            rec[f"{key}.{g}"] = float(np.mean(finite)) if finite else float("nan")
    return rec


def summarise_rounds(records: Sequence[Mapping[str, Any]]) -> Dict[str, float]:
    """The last round's evaluation (``final_*``: accuracies, and AUROC/OSCR for open-set runs, with the AUROC of
    each heterogeneous-unknown scenario, ``auroc_<scenario>``), plus mean aggregation time and bytes per round."""
    if not records:
        return {}
    last = records[-1]
    out = {
        f"final_{k}": float(v)
        for k, v in last.items()
        if k in ("avg_acc", "worst_acc", "auroc", "oscr") or k.startswith(("acc.", "auroc.", "oscr.", "auroc_"))
    }
    out["agg_seconds_mean"] = float(np.mean([r["agg_seconds"] for r in records]))
    out["bytes_per_round"] = float(np.mean([r["bytes_up"] + r["bytes_down"] for r in records]))
    out["final_train_loss"] = float(last["train_loss"])
    if "task" in last:  # class-incremental data: average incremental accuracy, final accuracy, forgetting
        from fedcore.incremental.evaluate import task_end_metrics

        out.update({k: float(cast(float, v)) for k, v in task_end_metrics(records).items() if not isinstance(v, list)})
    return out


def trainer_names() -> List[str]:
    return TRAINERS.names()


def strategy_names() -> List[str]:
    return STRATEGIES.names()


def source_round_data(partition) -> RoundData:
    """The labelled source clients of a test-time partition, scored on its clean source test set."""
    return RoundData(
        client_x=list(partition.source_x),
        client_y=list(partition.source_y),
        client_group=["source"] * len(partition.source_x),
        eval_sets={"source_test": (partition.source_test_x, partition.source_test_y)},
    )
