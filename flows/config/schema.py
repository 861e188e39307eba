"""The keys each block of a system's config takes, checked before any work.

Hydra checks the groups it composes, but a system's block (``conf/experiment/<name>.yaml``, or a
plug-in's file) is free-form YAML: a misspelt key there (``+fedpad.grids.quick.roundz=3``) would be
read by nothing, and the run would go on with the default and write over the results DVC tracks. So
every block has a schema, and :func:`check` refuses a key it lacks, naming the valid ones.

A schema is a mapping of key -> what its value is:

* ``LEAF``: a value (a number, a name, a list), checked by the validator that reads it;
* ``OPEN``: a mapping checked elsewhere (a trainer's settings by the trainer class, a variant's by the
  root config, a grid's clients per domain by its domain set);
* a nested schema, for a block of fixed keys;
* :class:`Each`, for a block of names the user chooses (methods, grids, stress cells), each with one schema.

A round-based system's block takes :func:`round_block` of its evaluation's grid keys; an arrival system's
takes ``variants``. Either declares more in :attr:`flows.systems.base.System.settings`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

LEAF = "leaf"
OPEN = "open"


@dataclass(frozen=True)
class Each:
    """A block whose keys the user names (``methods``, ``grids``, ``cells``), every entry with ``schema``."""

    schema: Any


# A stress cell's settings, and where each lands in the config it lays them over.
STRESS_CELL = {
    "lr": "sweep.method_params.lr",
    "passes": "adapt.passes",
    "stream": "adapt.stream",
    "batch_size": "adapt.batch_size",
    "beta": "sweep.aggregator_params.beta",
    "normalizer": "sweep.aggregator_params.normalizer",
    "methods": "sweep.methods",
    "aggregators": "sweep.aggregators",
    "privacy": "sweep.privacy",
}
STRESS = {
    **dict.fromkeys(("methods", "aggregators", "privacy", "seeds", "results", "experiment", "cell"), LEAF),
    "cells": Each(dict.fromkeys(STRESS_CELL, LEAF)),
}
AUDIT = dict.fromkeys(("client", "epsilons", "trials", "stream_size", "confidence", "lr", "noise_source"), LEAF)

METHOD = {"trainer": LEAF, "trainer_params": OPEN, "strategy": LEAF, "strategy_params": OPEN, "scores": LEAF}
# The keys of a grid that every round-based evaluation reads; an evaluation adds its own.
GRID_KEYS = frozenset(
    {
        "set",
        "size",
        "max_per_domain",
        "clients_per_domain",
        "test_fraction",
        "size_skew",
        "model",
        "norm",
        "rounds",
        "participation",
        "methods",
        "seeds",
        "label_alpha",  # Dirichlet label skew within a domain (flows.runs.steps.partition_domains)
        "rows_per_client",  # every client's training rows, equal across domains (ditto)
    }
)


def round_block(grid_keys: Iterable[str]) -> dict:
    """A round-based system's block, whose grids take ``grid_keys``."""
    grid = {k: OPEN if k == "clients_per_domain" else LEAF for k in grid_keys}
    grid["trainer"] = OPEN  # the grid's trainer settings, over the block's and under each method's
    grid["strategy"] = OPEN  # the grid's strategy settings, under each method's
    grid["target"] = LEAF  # the method the grid's paired tests compare against the others (else the block's)
    return {
        "grid": LEAF,
        "stages": LEAF,
        "target": LEAF,
        "trainer": OPEN,  # every method's trainer settings: checked by the trainer class
        "methods": Each(METHOD),
        "grids": Each(grid),
    }


ARRIVAL_BLOCK = {"variants": OPEN}  # each variant's keys are checked against the root config


def check(node: Any, schema: Any, where: str) -> None:
    """Raise ValueError at the first key of ``node`` that ``schema`` does not take, naming the valid ones."""
    if schema in (LEAF, OPEN) or not isinstance(node, Mapping):
        return
    if isinstance(schema, Each):
        for name, entry in node.items():
            if isinstance(schema.schema, Mapping) and not isinstance(entry, Mapping):
                raise ValueError(
                    f"{where}.{name} is {entry!r}, not a block: each entry of {where} takes the settings "
                    f"{', '.join(sorted(schema.schema))}"
                )
            check(entry, schema.schema, f"{where}.{name}")
        return
    for key, value in node.items():
        if key not in schema:
            raise ValueError(
                f"{where} has no setting {str(key)!r}; its settings are: {', '.join(sorted(map(str, schema)))}"
            )
        check(value, schema[key], f"{where}.{key}")
