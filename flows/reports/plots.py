"""``dvc plots show``, naming each plot that has no data here and the command that builds its tables.

    python -m flows.reports.plots               # or `make plots`: dvc_plots/index.html, every plot with data
    python -m flows.reports.plots -o page       # any option goes to `dvc plots show` as it is

Where a plot's table is missing (its stage has not run in this clone, as the private grid after
``make run``), DVC says only "failed to load some plots for following revisions: 'workspace'". This
then asks DVC which (``dvc plots show --json``) and prints, for each such plot, the missing files and
the stage that writes them (from ``dvc.lock``), with ``make pull`` for a run someone else pushed.
The page itself is DVC's (with Vega bundled in: :mod:`flows.reports.plot_page`); the exit status is DVC's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence

from flows.services import integrity

FAILED = "failed to load some plots"


def _dvc(args: Sequence[str], root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dvc", "plots", "show", *args], cwd=root, capture_output=True, text=True
    )


def missing(errors: Sequence[Mapping[str, Any]]) -> Dict[str, List[str]]:
    """``{plot: [file, ...]}`` from the ``errors`` of ``dvc plots show --json`` (the workspace's only)."""
    out: Dict[str, List[str]] = {}
    for e in errors:
        if e.get("rev", "workspace") == "workspace" and e.get("name"):
            files = out.setdefault(str(e["name"]), [])
            if e.get("source") and e["source"] not in files:
                files.append(str(e["source"]))
    return out


def targets(args: Sequence[str]) -> List[str]:
    """The plots or files named in ``dvc plots show``'s arguments (not the options or their values)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("-o", "--out", "--html-template", "--templates-dir"):
            skip = True
        elif not a.startswith("-"):
            out.append(a)
    return out


def writer(path: str, root: Path | None = None) -> str | None:
    """The stage whose recorded output holds ``path`` (``dvc.lock``), or None."""
    for out in integrity.lock_outs(root):
        if path == out.path or path.startswith(out.path.rstrip("/") + "/"):
            return out.stage
    return None


def describe(by_plot: Mapping[str, Sequence[str]], root: Path | None = None) -> str:
    """One paragraph per plot without data: its missing files and how to get them."""
    lines = []
    for plot, files in by_plot.items():
        stages = sorted({s for s in (writer(f, root) for f in files) if s})
        shown = ", ".join(files[:2]) + (f" and {len(files) - 2} more" if len(files) > 2 else "")
        build = f"build it with `dvc repro {' '.join(stages)}`" if stages else "its stage has not run here (dvc.yaml)"
        lines.append(f"- {plot}: no {shown}; {build}, or fetch a pushed run with `make pull`")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    root = Path.cwd()  # DVC's repository is where it runs
    shown = _dvc(args, root)
    sys.stdout.write(shown.stdout)
    sys.stderr.write(shown.stderr)
    if FAILED in shown.stdout + shown.stderr:
        listed = _dvc(["--json", *targets(args)], root)
        try:
            errors = json.loads(listed.stdout).get("errors") or []
        except ValueError:
            errors = []
        by_plot = missing(errors)
        if by_plot:
            print(f"{len(by_plot)} plot(s) have no data in this workspace:\n{describe(by_plot, root)}", file=sys.stderr)
    return shown.returncode


if __name__ == "__main__":
    sys.exit(main())
