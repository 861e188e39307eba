"""The tables ``dvc plots`` reads (dvc.yaml, top-level ``plots:``), written beside each run's PNGs.

DVC plots CSV, TSV, JSON or YAML tables, and in a JSON list only records that all have the same
keys. The runs' own records do not always: PP-FCIL's round records gain ``acc.task<j>`` as tasks
arrive, a private arrival gains ``eps_*``. So each run's records are written here as a CSV with
one header, the union of their scalar fields in first-seen order, and an empty cell where a record
lacks a field (or holds NaN).

How long a step took (:data:`WALL_CLOCK`) is left out of every file written here and of the other stage
outputs: it differs on every run, and an output that holds it could never be rebuilt to the bytes
``dvc.lock`` records. So is how the server went about a round (:data:`SERVER_DIAGNOSTICS`: how often
FedPD++'s alignment found nothing to move), which says how a result was computed, not what it is.
MLflow keeps both, per step and per run.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence

import numpy as np

ARRIVALS_CSV = "arrivals.csv"  # one row per arrival (flows.runs.federation)
ACCURACY_CSV = "accuracy.csv"  # the accuracy matrix, one row per (arrival, seen hold-out client)
ROUNDS_CSV = "rounds.csv"  # one row per round (flows.runs.rounds)

# The record fields that measure the machine, not the method: logged to MLflow, never written to a stage output.
WALL_CLOCK = frozenset({"agg_seconds", "adapt_seconds"})
SERVER_DIAGNOSTICS = frozenset({"align_identity", "align_identity_layers"})
MLFLOW_ONLY = WALL_CLOCK | SERVER_DIAGNOSTICS


def reproducible(records: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """``records`` without their :data:`MLFLOW_ONLY` fields: what a stage output may hold."""
    return [{k: v for k, v in rec.items() if k not in MLFLOW_ONLY} for rec in records]


def _cell(value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and not math.isfinite(value):
        return ""  # Vega reads an empty cell as missing; "nan" would be a string
    return value


def write_records_csv(records: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """``records`` as a CSV: a column per scalar field (lists and dicts, such as ``clients``, and the
    :data:`MLFLOW_ONLY` fields are left out).

    Parameters
    ----------
    records:
        One dict per row (an arrival's or a round's record).
    path:
        The file written (replaced if it exists).

    Returns
    -------
    Path
        ``path``.
    """
    columns: Dict[str, None] = {}
    records = reproducible(records)
    for rec in records:
        for k, v in rec.items():
            if isinstance(v, (bool, int, float, str, np.integer, np.floating)):
                columns.setdefault(k)
    path = Path(path)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(columns)
        for rec in records:
            w.writerow([_cell(_scalar(rec.get(k, ""))) for k in columns])
    return path


def _scalar(v: Any) -> Any:
    return v.item() if isinstance(v, (np.integer, np.floating)) else v


def write_accuracy_csv(acc_matrix: np.ndarray, corruptions: Sequence[str], path: str | Path) -> Path:
    """The accuracy matrix in long form: ``arrival, client_id, corruption, acc`` for every client whose
    hold-out the global model after that arrival was scored on (the matrix's NaNs, clients not yet
    seen, have no row). ``acc_matrix``: (arrivals, clients)."""
    path = Path(path)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["arrival", "client_id", "corruption", "acc"])
        for a, row in enumerate(np.asarray(acc_matrix, dtype=float)):
            for k, v in enumerate(row):
                if math.isfinite(v):
                    w.writerow([a, k, f"{k}:{corruptions[k]}", round(float(v), 4)])
    return path


def write_arrival_tables(
    folder: str | Path, records: List[Dict[str, Any]], acc_matrix: np.ndarray, corruptions: Sequence[str]
) -> List[Path]:
    """``arrivals.csv`` and ``accuracy.csv`` of one arrival run, in ``folder`` (its cell); returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return [
        write_records_csv(records, folder / ARRIVALS_CSV),
        write_accuracy_csv(acc_matrix, corruptions, folder / ACCURACY_CSV),
    ]
