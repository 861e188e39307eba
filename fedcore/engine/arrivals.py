"""Sequential arrival: unlabelled clients arrive one after another and are merged into θ_G.

The step functions (:func:`adapt_client`, :func:`evaluate_global`) do the work; the driver
:func:`run_arrivals` calls them in order through a ``submit`` callable (see
:mod:`fedcore.engine.submit`), so the plain loop and the Prefect flow run the same code.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, cast

import numpy as np
import torch

from fedcore.adapt import (
    GRADIENT_METHODS,
    METHODS,
    USES_BATCH_STATS,
    check_method_settings,
    create_method,
    method_class,
    softmax_entropy,
)
from fedcore.aggregate import MergeHistory, State, advance, create_aggregator, l2_distance
from fedcore.data.partition import Partition, TargetClient, order_stream
from fedcore.engine.checkpoint import CheckpointError, RunInterrupted, load_state, save_state
from fedcore.engine.spec import ModelSpec
from fedcore.engine.submit import Submit, run_now
from fedcore.evaluate import accuracy, batch_statistics, forgetting
from fedcore.privacy import Ledger, PrivacyConfig, privatize_gate
from fedcore.tensors import batches, resolve_device, state_to_cpu, to_tensor

# What submitting an arrival gives: the client's future, whether the ledger refused it, the ledger's
# record of the client and the ledger's state.
_Pending = Tuple[Any, bool, Dict[str, float], Dict[int, Dict[str, Any]]]

STREAMS = ("shuffled", "class_sorted", "as_partitioned")


@dataclass(frozen=True)
class ArrivalConfig:
    method: str = "bpa"
    method_params: Dict[str, Any] = field(default_factory=dict)
    aggregator: str = "ugsa"
    aggregator_params: Dict[str, Any] = field(default_factory=dict)
    passes: int = 1
    order: Optional[Sequence[int]] = None  # arrival order of target client ids; None = 0..K-1
    batch_size: int = 64
    seed: int = 0
    device: str = "cpu"
    privacy: Dict[str, Any] = field(default_factory=dict)  # see fedcore.privacy.PrivacyConfig; {} = off
    # The order a client streams its samples in, drawn afresh for each arrival from (seed, arrival):
    # shuffled | class_sorted (temporally correlated, the stress case) | as_partitioned (the saved order).
    stream: str = "shuffled"

    def __post_init__(self) -> None:
        METHODS.get(self.method)  # unknown names fail here, listing the valid ones
        check_method_settings(self.method, self.method_params)  # and misspelt settings, or a wrong kind of value
        pcfg = self.privacy_config()
        if pcfg.mode != "off" and self.method not in GRADIENT_METHODS:
            raise ValueError(
                f"privacy mode {pcfg.mode!r} privatises gradient updates, and method {self.method!r} "
                f"takes none; private forms exist for: {', '.join(sorted(GRADIENT_METHODS))}"
            )
        create_aggregator(self.aggregator, **self.aggregator_params)
        for key in ("lr", "sigma0"):
            v = self.method_params.get(key)
            if v is not None and v <= 0:
                raise ValueError(f"method {key} must be > 0, got {v}")
        if self.passes < 1:
            raise ValueError(f"passes must be >= 1, got {self.passes}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.stream not in STREAMS:
            raise ValueError(f"unknown stream order {self.stream!r}; valid names are: {', '.join(STREAMS)}")

    def schedule(self, num_clients: int) -> List[int]:
        order = list(range(num_clients)) if self.order is None else [int(k) for k in self.order]
        bad = [k for k in order if not 0 <= k < num_clients]
        if bad:
            raise ValueError(f"arrival order names client(s) {bad}, but only 0..{num_clients - 1} exist")
        return order * self.passes

    def privacy_config(self) -> PrivacyConfig:
        return PrivacyConfig.from_dict(self.privacy)

    @property
    def uses_per_arrival(self) -> int:
        """How many private gradients each stream sample enters in one arrival."""
        return method_class(self.method).uses_per_sample(self.method_params)

    @property
    def form(self) -> str:
        """The privacy form's name (:attr:`PrivacyConfig.name`), for names and tables.

        ``clip`` is the paper's clip-only form (each method's plain form, per-sample gradients
        clipped); ``dp0`` is the private form at σ = 0. Neither has a guarantee.
        """
        return self.privacy_config().name

    def fingerprint(self) -> str:
        d = asdict(self)
        d["order"] = None if self.order is None else list(self.order)
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------ steps
@dataclass
class AdaptResult:
    """What a target client sends back after adapting on its whole stream."""

    state: State
    online_acc: float  # predict-then-adapt accuracy on the stream (labels used only to score)
    sigma: float  # the adapted model's mean prediction entropy on the stream (nats)
    num_examples: int
    seconds: float
    extras: Dict[str, float] = field(default_factory=dict)


def adapt_client(
    *,
    global_state: State,
    spec: ModelSpec,
    client: TargetClient,
    cfg: ArrivalConfig,
    seed: int,
    arrival: int = -1,
    source_x: np.ndarray | None = None,
    refused: bool = False,
) -> AdaptResult:
    """Adapt the received global model on the client's unlabelled stream, batch by batch.

    ``source_x``: source samples for methods that need them (EATA's Fisher). ``refused``: the
    client's privacy budget is spent, so it only predicts with the global model it received
    and sends that model back unchanged.
    """
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    device = resolve_device(cfg.device)
    model = spec.build().to(device)
    model.load_state_dict(global_state)
    params = dict(cfg.method_params)
    params.setdefault("num_classes", spec.num_classes)
    if refused:
        method = create_method("source", model)
    else:
        pcfg = cfg.privacy_config()
        if pcfg.mode != "off":
            params["privacy"] = pcfg.spec(cfg.uses_per_arrival)
        if source_x is not None:
            params["source_x"] = to_tensor(source_x, device=device)
        method = create_method(cfg.method, model, **params)
    order = stream_order(client.stream_y, cfg, arrival)
    x, y = to_tensor(client.stream_x[order], device=device), client.stream_y[order]
    correct = 0
    for sl in batches(len(x), cfg.batch_size):
        logits = method(x[sl])
        correct += int((logits.argmax(1).cpu().numpy() == y[sl]).sum())
    extras = method.diagnostics()
    # σ_k measures the model the client predicts with: BatchNorm with batch statistics, in the
    # stream's batch size, for the methods that adapt that way (eval mode for ``source``).
    with torch.no_grad(), batch_statistics(model, cfg.method in USES_BATCH_STATS and not refused):
        ent = [softmax_entropy(model(x[sl])) for sl in batches(len(x), cfg.batch_size)]
    sigma = float(torch.cat(ent).mean())
    # Released noised in dp mode; a refused client releases nothing (the server ignores it anyway).
    sigma = math.nan if refused else privatize_gate(sigma, cfg.privacy_config(), num_classes=spec.num_classes, n=len(x))
    return AdaptResult(
        state=state_to_cpu(model.state_dict()),
        online_acc=correct / len(x),
        sigma=sigma,
        num_examples=len(x),
        seconds=time.perf_counter() - t0,
        extras=extras,
    )


def stream_order(labels: np.ndarray, cfg: ArrivalConfig, arrival: int) -> np.ndarray:
    """The permutation a client streams in at ``arrival``: each seed and each visit its own order (the
    labels are read only to sort a ``class_sorted`` stream, never by the method)."""
    if cfg.stream == "as_partitioned":
        return np.arange(len(labels))
    rng = np.random.default_rng([cfg.seed, arrival + 1])
    return order_stream(labels, order=cfg.stream, rng=rng)


def evaluate_global(
    *,
    state: State,
    spec: ModelSpec,
    partition: Partition,
    clients: Sequence[int],
    device: str = "cpu",
    batch_stats: bool = False,
    batch_size: int = 64,
) -> Dict[str, Any]:
    """Accuracy of a global model on the clean source test set and on the given hold-outs.

    With ``batch_stats`` the hold-outs are scored with BatchNorm batch statistics over batches of
    ``batch_size`` (the stream's), as the adapting methods use the model; the clean source test
    set is always scored in plain eval mode (running statistics), as a deployed model would be.
    """
    dev = resolve_device(device)
    model = spec.build().to(dev)
    model.load_state_dict(state)
    hold = {
        int(j): accuracy(
            model,
            partition.targets[j].holdout_x,
            partition.targets[j].holdout_y,
            device=dev,
            batch_stats=batch_stats,
            batch_size=batch_size,
        )
        for j in clients
    }
    return {
        "source_acc": accuracy(model, partition.source_test_x, partition.source_test_y, device=dev),
        "holdout": hold,
    }


@dataclass
class ServerState:
    """Everything needed to continue after arrival ``done``: the flow's durable state."""

    done: int
    fingerprint: str
    global_state: State
    theta0: State
    history: MergeHistory
    records: List[Dict[str, Any]]
    acc_rows: List[List[float]]
    ledgers: Dict[int, Dict[str, Any]] = field(default_factory=dict)  # privacy ledger per client (dp mode)

    def to_payload(self) -> Dict[str, Any]:
        d = asdict(self)
        d.pop("fingerprint")
        d["history"] = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.history).items()}
        return d

    @classmethod
    def from_payload(cls, payload: Dict[str, Any], fingerprint: str) -> "ServerState":
        d = dict(payload)
        d["history"] = MergeHistory(
            **cast(Dict[str, Any], {k: tuple(v) if k != "merged" else v for k, v in d["history"].items()})
        )
        return cls(fingerprint=fingerprint, **d)


@dataclass
class ArrivalsResult:
    records: List[Dict[str, Any]]
    acc_matrix: np.ndarray  # (A, K): global model after arrival a on client j's hold-out (nan: not yet seen)
    summary: Dict[str, float]
    final_state: State
    schedule: List[int]
    ledgers: Dict[int, Dict[str, Any]] = field(default_factory=dict)


def summarise(records: List[Dict[str, Any]], acc_matrix: np.ndarray, schedule: List[int]) -> Dict[str, float]:
    last_visit = {}
    for a, k in enumerate(schedule):
        last_visit[k] = a
    seen = sorted(last_visit)
    final = acc_matrix[-1, seen]
    return {
        "avg_online_acc": float(np.mean([r["online_acc"] for r in records])),
        "final_avg_holdout_acc": float(np.mean(final)),
        "final_worst_holdout_acc": float(np.min(final)),
        "forgetting": forgetting(acc_matrix[:, seen], [last_visit[k] for k in seen]),
        "source_acc": float(records[-1]["source_acc"]),
        "total_drift": float(records[-1]["drift_total"]),
        **privacy_summary(records),
    }


def privacy_summary(records: List[Dict[str, Any]]) -> Dict[str, float]:
    """The largest ε any client has spent, and how many updates were refused (dp mode only)."""
    if not records or "eps_client_total" not in records[0]:
        return {}
    return {
        "eps_max_client": float(max(r["eps_client_total"] for r in records)),
        "eps_per_arrival": float(max(r["eps_arrival"] for r in records)),
        "privacy_refusals": float(sum(r["privacy_refused"] for r in records)),
    }


ArrivalHook = Callable[[Dict[str, Any], ServerState, AdaptResult], None]


def initial_state(
    source_state: State, cfg: ArrivalConfig, *, checkpoint_dir: str | Path | None = None, resume: bool = False
) -> ServerState:
    """The state a run starts from: the one saved in ``checkpoint_dir`` (with ``resume``), else the source model.

    A corrupt checkpoint raises :class:`CheckpointError` whether or not it is resumed, before anything
    is written over it; so does one written by another config when it is resumed.
    """
    fp = cfg.fingerprint()
    if checkpoint_dir is not None:
        found = load_state(checkpoint_dir)
        if resume and found is not None:
            if found.fingerprint != fp:
                raise CheckpointError(
                    f"checkpoint in {checkpoint_dir} was written by another config "
                    f"({found.fingerprint} != {fp}); resume with the same config or use a fresh "
                    "checkpoint folder"
                )
            return ServerState.from_payload(found.payload, found.fingerprint)
    return ServerState(
        done=0,
        fingerprint=fp,
        global_state=source_state,
        theta0=source_state,
        history=MergeHistory(),
        records=[],
        acc_rows=[],
    )


def iter_arrivals(
    partition: Partition,
    spec: ModelSpec,
    cfg: ArrivalConfig,
    start: ServerState,
    *,
    submit: Submit = run_now,
    stop_at: int | None = None,
) -> Iterator[Tuple[Dict[str, Any], ServerState, AdaptResult]]:
    """The arrivals after ``start.done`` (up to ``stop_at``, exclusive), one ``(record, state, result)`` each.

    Each yielded state is complete: a run continued from it (by this function, in any process)
    gives the same records and models as one that never stopped. The next client is submitted
    before this arrival is evaluated, so with an asynchronous ``submit`` its adaptation overlaps
    the evaluation.
    """
    K = len(partition.targets)
    schedule = cfg.schedule(K)
    end = len(schedule) if stop_at is None else min(int(stop_at), len(schedule))
    merger = create_aggregator(cfg.aggregator, **cfg.aggregator_params)
    fp = cfg.fingerprint()
    if start.fingerprint != fp:
        raise CheckpointError(
            f"a run state written by another config ({start.fingerprint} != {fp}) cannot be continued under this one"
        )
    st = start
    param_keys = [k for k, _ in spec.build().named_parameters()]
    ledger = Ledger(cfg.privacy_config(), uses=cfg.uses_per_arrival)
    ledger.load_state_dict(st.ledgers)
    n_source = method_class(cfg.method).source_samples(cfg.method_params)
    source_x = source_pool(partition, n_source, cfg.seed) if n_source else None

    def submit_arrival(a: int, global_state: State) -> _Pending:
        # The ledger is charged when the client is sent off, so the next client's decision
        # (submitted before this one's result is in) already sees this charge.
        k = schedule[a]
        refused = ledger.would_exceed(k)
        if not refused:
            ledger.charge(k)
        fut = submit(
            adapt_client,
            global_state=global_state,
            spec=spec,
            client=partition.targets[k],
            cfg=cfg,
            seed=cfg.seed * 100_003 + a,
            arrival=a,
            source_x=source_x,
            refused=refused,
        )
        return fut, refused, ledger.record(k, refused=refused), ledger.state_dict()

    pending = submit_arrival(st.done, st.global_state) if st.done < end else None
    for a in range(st.done, end):
        k = schedule[a]
        fut, refused, privacy_record, ledger_state = cast(_Pending, pending)  # set for every a < end
        res: AdaptResult = fut.result()
        if refused:  # nothing private was learnt: the server keeps its model and its merge history
            new_global, weight = st.global_state, 0.0
        else:
            new_global, weight = merger.merge(st.global_state, res.state, sigma=res.sigma, history=st.history)
        # The next client needs only the merged model: start it now, so that its adaptation
        # overlaps this arrival's evaluation, checkpoint and logging (same results, less wall time).
        pending = submit_arrival(a + 1, new_global) if a + 1 < end else None
        seen = sorted(set(schedule[: a + 1]))
        ev = evaluate_global(
            state=new_global,
            spec=spec,
            partition=partition,
            clients=seen,
            device=cfg.device,
            batch_stats=cfg.method in USES_BATCH_STATS,
            batch_size=cfg.batch_size,
        )
        row = [ev["holdout"].get(j, math.nan) for j in range(K)]
        record = {
            "arrival": a,
            "pass": a // K,
            "client_id": k,
            "corruption": partition.targets[k].corruption,
            "online_acc": res.online_acc,
            **({} if refused else {"sigma": res.sigma}),
            "weight": weight,
            "drift_step": l2_distance(new_global, st.global_state, param_keys),
            "drift_total": l2_distance(new_global, st.theta0, param_keys),
            "source_acc": ev["source_acc"],
            "holdout_acc_client": ev["holdout"][k],
            "holdout_avg_seen": float(np.mean([ev["holdout"][j] for j in seen])),
            "adapt_seconds": res.seconds,
            **res.extras,
            **privacy_record,
        }
        st = ServerState(
            done=a + 1,
            fingerprint=fp,
            global_state=new_global,
            theta0=st.theta0,
            history=st.history if refused else advance(st.history, sigma=res.sigma, weight=weight),
            records=st.records + [record],
            acc_rows=st.acc_rows + [row],
            ledgers=ledger_state,
        )
        yield record, st, res


def arrivals_result(st: ServerState, schedule: List[int]) -> ArrivalsResult:
    """A finished run's result from its last state."""
    acc = np.asarray(st.acc_rows, dtype=float)
    return ArrivalsResult(
        records=st.records,
        acc_matrix=acc,
        summary=summarise(st.records, acc, schedule),
        final_state=st.global_state,
        schedule=schedule,
        ledgers=st.ledgers,
    )


def run_arrivals(
    partition: Partition,
    spec: ModelSpec,
    source_state: State,
    cfg: ArrivalConfig,
    *,
    submit: Submit = run_now,
    checkpoint_dir: str | Path | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    on_arrival: ArrivalHook | None = None,
    progress: bool = False,
) -> ArrivalsResult:
    """Unlabelled clients arrive one after another; each adapts from θ_G and is merged into it.

    Parameters
    ----------
    checkpoint_dir:
        Where the server state is written after every arrival. With ``resume=True`` the run
        continues after the last completed arrival found there.
    stop_after:
        Stop (raising :class:`RunInterrupted`) once this many arrivals are done and saved.
    on_arrival:
        Called after each arrival's merge, evaluation and checkpoint with the arrival's record.
    """
    schedule = cfg.schedule(len(partition.targets))
    start = initial_state(source_state, cfg, checkpoint_dir=checkpoint_dir, resume=resume)
    st = start
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(
            desc=f"{cfg.method}+{cfg.aggregator} arrivals", unit="client", initial=start.done, total=len(schedule)
        )
    try:
        for record, st, res in iter_arrivals(partition, spec, cfg, start, submit=submit, stop_at=stop_after):
            if checkpoint_dir is not None:
                save_state(checkpoint_dir, st.to_payload(), fingerprint=st.fingerprint)
            if on_arrival is not None:
                on_arrival(record, st, res)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    if stop_after is not None and st.done < len(schedule):
        raise RunInterrupted(f"stopped after arrival {st.done} as asked; resume to continue")
    return arrivals_result(st, schedule)


def source_pool(partition: Partition, size: int, seed: int) -> np.ndarray:
    """``size`` labelled-source images (labels dropped), the same for every arrival of a run."""
    x = np.concatenate(partition.source_x)
    idx = np.random.default_rng(seed).permutation(len(x))[:size]
    return x[np.sort(idx)]
