"""Where continual adaptation degrades, across the stress grid at a glance.

The stress cells that set only ``lr`` and ``passes`` form a grid (lr rows, passes columns). For the
reference (``bn+none``: test-time batch statistics, no parameter update) and each method in
``ROWS``, this writes beside the report:

- ``<results>_grid.md``: final hold-out accuracy per grid cell, mean ± std over seeds;
- ``<results>_grid.png``: one heatmap per method of its gap to the reference (mean over the seeds
  both ran), so the region where continual Tent collapses, and whether BPA or UGSA hold there,
  reads off one figure.

Only the protocols in ``PROTOCOLS`` have a grid (their report stages declare these two files); a
cell not yet run is marked as such. The stress report (flows/runs/stress.py) holds each cell's full
table and paired tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
from omegaconf import DictConfig

from flows.runs.stress import load_cell, protocol, results_root

PROTOCOLS = ("bpfedctta",)
GRID_KEYS = frozenset({"lr", "passes"})
REFERENCE = "bn+none"
ROWS = ("tent+sequential", "bpa+sequential", "tent+fedavg", "bpa+fedavg", "tent+ugsa", "bpa+ugsa")
METRIC = "final_avg_holdout_acc"

Cell = Tuple[float, int]
Runs = Dict[str, Dict[Cell, Dict[int, float]]]  # {method: {(lr, passes): {seed: final hold-out accuracy}}}


def grid_cells(cfg: DictConfig, name: str = "bpfedctta") -> Dict[Cell, str]:
    """``{(lr, passes): cell name}`` of the declared cells that set lr and passes and nothing else."""
    proto = protocol(name)
    out: Dict[Cell, str] = {}
    for cell, settings in cfg[proto.system][proto.block].cells.items():
        s = dict(settings)
        if set(s) != GRID_KEYS:
            continue
        try:
            lr, passes = float(s["lr"]), s["passes"]
        except (TypeError, ValueError):
            raise ValueError(f"stress cell {cell!r} sets lr {s['lr']!r}; it must be a number") from None
        if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
            raise ValueError(f"stress cell {cell!r} sets passes {passes!r}; it must be a whole number ≥ 1")
        if (lr, passes) in out:
            raise ValueError(
                f"stress cells {out[(lr, passes)]!r} and {cell!r} are the same point "
                f"(lr {lr:g}, {passes} passes); remove one"
            )
        out[(lr, passes)] = str(cell)
    return out


def ran(cfg: DictConfig, name: str = "bpfedctta") -> List[Cell]:
    """The grid cells whose results exist."""
    root = results_root(cfg, name)
    return [k for k, cell in sorted(grid_cells(cfg, name).items()) if (root / cell / "summary.json").is_file()]


def collect(cfg: DictConfig, name: str = "bpfedctta") -> Runs:
    """Every seed's final hold-out accuracy of the reference and ``ROWS``, over the grid cells that ran."""
    root = results_root(cfg, name)
    cells = grid_cells(cfg, name)
    out: Runs = {}
    for key in ran(cfg, name):
        runs = load_cell(root / cells[key])
        for method in (REFERENCE, *ROWS):
            if method in runs:
                out.setdefault(method, {})[key] = {s: float(v[METRIC]) for s, v in runs[method].items()}
    return out


def gap(data: Runs, method: str, key: Cell) -> float | None:
    """The method's final hold-out accuracy minus the reference's in that cell, paired by seed (mean over
    the seeds both ran); None where either did not run."""
    mine, ref = data.get(method, {}).get(key, {}), data.get(REFERENCE, {}).get(key, {})
    seeds = sorted(set(mine) & set(ref))
    return float(np.mean([mine[s] - ref[s] for s in seeds])) if seeds else None


def _axes(cfg: DictConfig, name: str) -> Tuple[List[float], List[int]]:
    keys = grid_cells(cfg, name)
    return sorted({lr for lr, _ in keys}), sorted({p for _, p in keys})


def table(cfg: DictConfig, data: Runs, name: str = "bpfedctta") -> str:
    lrs, passes = _axes(cfg, name)
    done = set(ran(cfg, name))
    lines = ["| lr | passes | " + " | ".join((REFERENCE, *ROWS)) + " |", "|---|---|" + "---|" * (1 + len(ROWS))]
    for lr in lrs:
        for p in passes:
            vals = [np.array(list(data.get(m, {}).get((lr, p), {}).values())) for m in (REFERENCE, *ROWS)]
            absent = "not in the cell" if (lr, p) in done else "not run"
            cells = [f"{v.mean():.3f} ± {v.std():.3f}" if v.size else absent for v in vals]
            lines.append(f"| {lr:g} | {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _label(data: Runs, method: str, key: Cell, done: set) -> Tuple[float, str]:
    g = gap(data, method, key)
    if g is not None:
        return g, f"{g:+.3f}"
    if key not in done:
        return np.nan, "not run"
    return np.nan, f"no {REFERENCE}" if key in data.get(method, {}) else "not in the cell"


def plot(cfg: DictConfig, data: Runs, path: Path, name: str = "bpfedctta") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs, passes = _axes(cfg, name)
    done = set(ran(cfg, name))
    labels = {m: [[_label(data, m, (lr, p), done) for p in passes] for lr in lrs] for m in ROWS}
    finite = [abs(v) for rows in labels.values() for row in rows for v, _ in row if np.isfinite(v)]
    limit = max([0.05, *finite])
    # symmetric-log colours: a gap of 0.01 is visible beside a collapse of 0.4
    norm = matplotlib.colors.SymLogNorm(linthresh=0.01, vmin=-limit, vmax=limit, base=10)
    cmap = plt.get_cmap("RdBu").with_extremes(bad="0.85")
    cols = 3
    rows = -(-len(ROWS) // cols)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(3.2 * cols + 1.2, 2.6 * rows + 0.6),
        squeeze=False,
        sharex=True,
        sharey=True,
        constrained_layout=True,
    )
    for n, (ax, method) in enumerate(zip(axes.ravel(), ROWS)):
        grid = np.array([[v for v, _ in row] for row in labels[method]])
        ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto")
        for i, row in enumerate(labels[method]):
            for j, (v, text) in enumerate(row):
                ax.text(
                    j,
                    i,
                    text,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="0.4" if not np.isfinite(v) else "white" if abs(v) > 0.1 else "black",
                )
        ax.set_xticks(range(len(passes)), [str(p) for p in passes])
        ax.set_yticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
        ax.set_title(method, fontsize=9)
        if n % cols == 0:
            ax.set_ylabel("adaptation lr")
        if n >= len(ROWS) - cols:
            ax.set_xlabel("passes")
    fig.colorbar(
        matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap),
        ax=axes.ravel().tolist(),
        shrink=0.8,
        label=f"final hold-out accuracy minus {REFERENCE} (paired by seed)",
    )
    fig.suptitle("Stress grid: where each method gains or loses against test-time batch statistics", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def paths(cfg: DictConfig, name: str = "bpfedctta") -> Tuple[Path, Path]:
    root = results_root(cfg, name)
    return root.parent / f"{root.name}_grid.md", root.parent / f"{root.name}_grid.png"


def write(cfg: DictConfig, name: str = "bpfedctta") -> str:
    """The grid's table and heatmaps, both always written (the stage declares both); the grid cells not
    yet run are named with the command that runs them."""
    if name not in PROTOCOLS:
        raise ValueError(f"the stress protocol {name!r} has no lr × passes grid; those that do: {', '.join(PROTOCOLS)}")
    proto = protocol(name)
    keys = grid_cells(cfg, name)
    if not keys:
        raise ValueError(f"{proto.system}.{proto.block}.cells declares no cell that sets only lr and passes")
    data = collect(cfg, name)
    done = ran(cfg, name)
    md, png = paths(cfg, name)
    missing = [keys[k] for k in sorted(keys) if k not in done]
    lines = [
        f"# {proto.title}: the lr × passes grid",
        "",
        f"Final hold-out accuracy, mean ± std over seeds; {len(done)} of {len(keys)} grid cells ran.",
    ]
    if missing:
        lines.append(f"Not run: {', '.join(missing)} (`dvc repro {proto.stage}@<cell>`).")
    lines += ["", table(cfg, data, name), "", f"![gap to {REFERENCE} per cell]({png.name})", ""]
    plot(cfg, data, png, name)
    text = "\n".join(lines)
    md.write_text(text)
    return text
