"""``dvc exp show`` with the columns a reader compares: each system's headline metrics and the settings a user
changes.

    python -m flows.reports.exp                 # or `make exp`: a few dozen columns, not every flattened setting
    python -m flows.reports.exp --all           # every column, as plain `dvc exp show`
    python -m flows.reports.exp --csv -A        # any other option goes to `dvc exp show` as it is

Plain ``dvc exp show`` prints a column for every setting a stage tracks (about 1,200 here) and every key of
every metrics file; DVC has no setting for its default columns, so this picks them with ``--drop`` and
``--keep``. The metrics kept are :data:`flows.reports.tables.HEADLINE_KEYS` of each system's target method (the
arrival systems' ``headline``), and the settings :data:`SETTINGS` plus each round-based system's grid.
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import List, Sequence

from omegaconf import DictConfig

from flows import systems
from flows.config import compose as C
from flows.reports.tables import HEADLINE_KEYS

# the settings a user changes most: `dvc exp run -S <one of these>=...`
SETTINGS = (
    "variant",
    "seed",
    "data.name",
    "model.name",
    "method.name",
    "aggregator.name",
    "privacy.mode",
    "adapt.passes",
)
FIRST = ("Experiment", "Created")


def columns(cfg: DictConfig, *, csv: bool = False) -> List[str]:
    """The regular expressions of the columns kept (a metric may carry its file as ``<file>:`` where two
    metrics files have the same key). ``csv``: with ``rev``, which names the workspace and branch rows
    there (the table shows them under Experiment)."""
    out = [re.escape(c) for c in FIRST] + (["rev"] if csv else [])
    for system in systems.all_systems():
        keys = "|".join(re.escape(k) for k in HEADLINE_KEYS.get(system.evaluation, ()))
        if not keys or system.name not in cfg:
            continue
        if system.engine == "arrivals":
            prefix = "headline"
        else:
            prefix = str(cfg[system.name].get("target") or system.name)
            out.append(re.escape(f"{system.name}.grid"))
        out.append(rf"(?:[^:]+:)?{re.escape(prefix)}\.(?:{keys})")
    out += [re.escape(s) for s in SETTINGS]
    return list(dict.fromkeys(out))


def command(cfg: DictConfig, args: Sequence[str]) -> List[str]:
    """The ``dvc exp show`` command line for ``args`` (``--all``: every column)."""
    args = list(args)
    base = [sys.executable, "-m", "dvc", "exp", "show"]
    if "--all" in args:
        return base + [a for a in args if a != "--all"]
    keep = columns(cfg, csv="--csv" in args)
    return base + ["--drop", ".*", "--keep", "^(?:" + "|".join(keep) + ")$", *args]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    return subprocess.call(command(C.load(C.PARAMS), args), cwd=C.ROOT)


if __name__ == "__main__":
    sys.exit(main())
