"""Plots people would rather look at than read. matplotlib only (Agg), returning the file paths."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence, Tuple, cast

import numpy as np


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed); imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    import matplotlib

    fig.tight_layout()
    # tight_layout leaves a placeholder layout engine on the figure, and savefig then lays the figure
    # out again in a draw that renders nothing: about a seventh of the time, for the same bytes. With
    # these settings off, set_layout_engine(None) leaves no engine (on, it would install one).
    with matplotlib.rc_context({"figure.autolayout": False, "figure.constrained_layout.use": False}):
        fig.set_layout_engine(None)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def plot_arrivals(
    records: List[Dict], acc_matrix: np.ndarray, corruptions: Sequence[str], folder: str | Path, *, title: str = ""
) -> List[Path]:
    """online accuracy per arrival, accuracy-matrix heatmap, weight drift, gate weights and sigma."""
    plt = pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    a = [r["arrival"] for r in records]
    labels = [f"{r['arrival']}:{r['corruption'][:10]}" for r in records]
    paths = []

    fig, ax = plt.subplots(figsize=(max(6, len(a) * 0.28), 3.6))
    ax.plot(a, [r["online_acc"] for r in records], "o-", label="online (stream)")
    ax.plot(a, [r["holdout_avg_seen"] for r in records], "s--", label="global, mean hold-out of seen")
    ax.plot(a, [r["source_acc"] for r in records], "^:", label="global, clean source test")
    ax.set_xticks(a, labels, rotation=90, fontsize=7)
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    ax.set_title(f"{title} accuracy per arrival")
    ax.legend(fontsize=7)
    paths.append(save(fig, folder / "online_accuracy.png"))

    fig, ax = plt.subplots(figsize=(max(4, len(corruptions) * 0.6), max(3, len(a) * 0.2)))
    im = ax.imshow(acc_matrix, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(corruptions)), [c[:12] for c in corruptions], rotation=60, fontsize=7)
    ax.set_yticks(a, labels, fontsize=6)
    ax.set_xlabel("hold-out of client")
    ax.set_ylabel("global model after arrival")
    fig.colorbar(im, ax=ax, label="accuracy")
    ax.set_title(f"{title} accuracy matrix", fontsize=9)
    paths.append(save(fig, folder / "accuracy_matrix.png"))

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(a, [r["drift_step"] for r in records], "o-", label=r"$\|\theta_G^{(k)}-\theta_G^{(k-1)}\|$")
    ax.plot(a, [r["drift_total"] for r in records], "s-", label=r"$\|\theta_G^{(k)}-\theta_G^{(0)}\|$")
    ax.set_xlabel("arrival")
    ax.set_ylabel("L2 distance (parameters)")
    ax.set_title(f"{title} weight drift")
    ax.legend(fontsize=8)
    paths.append(save(fig, folder / "weight_drift.png"))

    fig, ax1 = plt.subplots(figsize=(6, 3.2))
    ax1.bar(a, [r["weight"] for r in records], color="tab:blue", alpha=0.6, label="merge weight w_k")
    ax1.set_xlabel("arrival")
    ax1.set_ylabel("w_k", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(
        a, [r.get("sigma", np.nan) for r in records], "o-", color="tab:red", label="sigma_k (entropy)"
    )  # a refused client reports none
    ax2.set_ylabel("sigma_k (nats)", color="tab:red")
    ax1.set_title(f"{title} gate weights")
    paths.append(save(fig, folder / "gate_weights.png"))
    return paths


def plot_privacy(records: List[Dict], folder: str | Path) -> Path:
    """Each client's cumulative ε after every arrival (a step line per client), refusals marked."""
    points = [
        {
            "step": r["arrival"],
            "client": r["client_id"],
            "label": f"{r['client_id']}:{r['corruption'][:10]}",
            "eps_client_total": r["eps_client_total"],
            "privacy_refused": r.get("privacy_refused", 0.0),
        }
        for r in records
    ]
    budget = (
        records[0]["eps_budget_remaining"] + records[0]["eps_client_total"]
        if "eps_budget_remaining" in records[0]
        else None
    )
    return plot_ledger(points, folder, step="arrival", budget=budget, width=len(records))


def plot_ledger(points: List[Dict], folder: str | Path, *, step: str, budget: float | None, width: int) -> Path:
    """privacy_ledger.png of any system: each client's cumulative ε after every ``step`` at which it sent (or
    was refused), a step line per client, refusals marked, the budget dashed. ``points``: dicts with ``step``,
    ``client``, ``label``, ``eps_client_total`` and ``privacy_refused``; ``width``: the number of steps."""
    plt = pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(max(6, width * 0.25), 3.6))
    clients = sorted({p["client"] for p in points})
    for k in clients:
        pts = [(p["step"], p["eps_client_total"]) for p in points if p["client"] == k]
        name = next(p["label"] for p in points if p["client"] == k)
        ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", marker="o", ms=3, label=name)
    refused = [p for p in points if p["privacy_refused"]]
    if refused:
        ax.plot(
            [p["step"] for p in refused],
            [p["eps_client_total"] for p in refused],
            "rx",
            ms=9,
            label="refused (budget spent)",
        )
    if budget is not None:
        ax.axhline(budget, color="k", ls="--", lw=1, label=f"budget ε={budget:g}")
    ax.set_xlabel(step)
    ax.set_ylabel("cumulative ε of the client")
    ax.set_title("privacy ledger")
    ax.legend(fontsize=6, ncol=2, loc="upper left")
    return save(fig, folder / "privacy_ledger.png")


def plot_rounds(records: List[Dict], domains: Sequence[str], folder: str | Path, *, title: str = "") -> Path:
    """Per round: accuracy per domain (worst in bold), the model weights α per client, the weight drift
    ‖α^t − α^{t−1}‖₁ and deviation change ‖d^t − d^{t−1}‖_∞, the global model norm and each domain's
    prototype distance to the global prototypes (the FedPAD paper's Figs. 6–8)."""
    plt = pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    r = [rec["round"] + 1 for rec in records]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0, 0]
    for d in domains:
        ax.plot(r, [rec.get(f"acc.{d}", np.nan) for rec in records], label=d)
    ax.plot(r, [rec.get("worst_acc", np.nan) for rec in records], "k-", lw=2.5, label="worst")
    ax.set(xlabel="round", ylabel="test accuracy", title="accuracy per domain")
    ax.legend(fontsize=7)
    ax = axes[0, 1]
    import re

    per_client = re.compile(r"^alpha\.c(\d+)$")  # alpha.c3; a domain's mean is alpha.<domain> (e.g. alpha.cartoon)
    alpha_keys = sorted({k for rec in records for k in rec if per_client.match(k)}, key=lambda k: int(k[7:]))
    for k in alpha_keys:
        ax.plot(r, [rec.get(k, np.nan) for rec in records], lw=1, label=k[6:])
    ax.set(
        xlabel="round",
        ylabel="α (model weight)",
        title="model weights α per client" if alpha_keys else "no per-client weights (uniform or example-weighted)",
    )
    if alpha_keys:
        ax.legend(fontsize=6, ncol=2)
    ax = axes[1, 0]
    for key, style in (("weight_drift", "o-"), ("deviation_change", "s--")):
        vals = [rec.get(key, np.nan) for rec in records]
        if np.isfinite(vals).any():
            ax.semilogy(r, vals, style, ms=3, label=key)
    ax.set(xlabel="round", title="‖α^t−α^{t−1}‖₁ and ‖d^t−d^{t−1}‖_∞")
    if ax.lines:
        ax.legend(fontsize=7)
    ax = axes[1, 1]
    ax.plot(r, [rec["model_norm"] for rec in records], "k-", label="‖w‖ (global model)")
    ax.set(xlabel="round", ylabel="model norm", title="model norm and prototype distance per domain")
    twin = ax.twinx()
    for d in domains:
        vals = [rec.get(f"proto_dist.{d}", np.nan) for rec in records]
        if np.isfinite(vals).any():
            twin.plot(r, vals, "--", label=f"proto dist: {d}")
    if twin.lines:
        twin.legend(fontsize=7)
    fig.suptitle(title)
    return save(fig, folder / "rounds.png")


def plot_methods(
    rows: List[Dict],
    path: str | Path,
    *,
    title: str = "",
    bars: Sequence[Tuple[str, str]] = (("avg", "average"), ("worst", "worst domain")),
    ylabel: str = "test accuracy",
) -> Path:
    """Grouped bars per method, mean ± std over seeds: by default average and worst-domain accuracy.

    ``bars`` lists ``(key, label)``; each row holds ``<key>_mean`` and ``<key>_std``.
    """
    plt = pyplot()
    names = [row["method"] for row in rows]
    x = np.arange(len(names))
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(names) + 2), 3.8))
    for j, (key, label) in enumerate(bars):
        off = (j - (len(bars) - 1) / 2) * width
        ax.bar(
            x + off,
            [row[f"{key}_mean"] for row in rows],
            width,
            yerr=[row[f"{key}_std"] for row in rows],
            capsize=3,
            label=label,
        )
    ax.set_xticks(x, names, rotation=35, ha="right", fontsize=8)
    lo = min(row[f"{key}_mean"] - row[f"{key}_std"] for row in rows for key, _ in bars)
    ax.set_ylim(max(0.0, lo - 0.05), 1.0)
    ax.set(ylabel=ylabel, title=title)
    ax.legend(fontsize=8)
    return save(fig, Path(path))


def plot_domain_shares(
    series: Dict[str, np.ndarray], domains: Sequence[str], path: str | Path, *, title: str = ""
) -> Path:
    """One panel per domain: its share of each round's client average (the server's weights summed over the
    domain's merged clients), one line per method, in a style of its own so that equal lines stay apart.
    ``series[method]``: (rounds, domains), mean over seeds; a round with no merged client is NaN."""
    plt = pyplot()
    cols = min(len(domains), 4)
    rows = -(-len(domains) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols + 1, 2.8 * rows + 0.6), squeeze=False, sharey=True)
    for k, d in enumerate(domains):
        ax = axes[k // cols, k % cols]
        for j, (method, values) in enumerate(series.items()):
            style = ("-", "--", ":", "-.")[j % 4]
            ax.plot(np.arange(1, len(values) + 1), values[:, k], style, lw=1.2, label=method)
        ax.set(xlabel="round", title=d)
        if k % cols == 0:
            ax.set_ylabel("share of the average")
    for k in range(len(domains), rows * cols):
        axes[k // cols, k % cols].set_visible(False)
    axes[0, 0].legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    return save(fig, Path(path))


def plot_openset_rounds(
    records: List[Dict], domains: Sequence[str], folder: str | Path, *, score: str, title: str = ""
) -> Path:
    """Per round: closed-set accuracy and AUROC (of the unknown ``score``) per domain, FedPD++'s mask sizes, and its
    alignment (transport cost and entropy, BatchNorm-statistics drift between clients)."""
    plt = pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    r = [rec["round"] + 1 for rec in records]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, key, label in (
        (axes[0, 0], "acc", "closed-set accuracy"),
        (axes[0, 1], f"auroc.{score}", f"AUROC ({score} score)"),
    ):
        for d in domains:
            ax.plot(r, [rec.get(f"{key}.{d}", np.nan) for rec in records], label=d)
        ax.plot(r, [rec.get("avg_acc" if key == "acc" else key, np.nan) for rec in records], "k-", lw=2.5, label="mean")
        ax.set(xlabel="round", ylabel=label, title=f"{label} per domain")
        ax.legend(fontsize=7)
    ax = axes[1, 0]
    for part in ("close", "open", "share", "rest", "whole"):
        vals = [rec.get(f"mask.{part}", np.nan) for rec in records]
        if np.isfinite(vals).any():
            ax.plot(r, vals, "o-", ms=3, label=part)
    ax.set(
        xlabel="round",
        ylabel="mean mask mass",
        title="parameter parts (mask mass per client)" if ax.lines else "no masks (plain averaging)",
    )
    if ax.lines:
        ax.legend(fontsize=7)
    ax = axes[1, 1]
    for key, style in (("align_cost", "o-"), ("transport_entropy", "s--"), ("bn_drift", "^:")):
        vals = [rec.get(key, np.nan) for rec in records]
        if np.isfinite(vals).any():
            ax.plot(r, vals, style, ms=3, label=key)
    ax.set(xlabel="round", title="alignment: cost, transport entropy, BN drift" if ax.lines else "no alignment")
    if ax.lines:
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return save(fig, folder / "rounds.png")


def plot_incremental(
    records: List[Dict], acc_matrix: Sequence[Sequence[float]], folder: str | Path, *, title: str = ""
) -> Path:
    """Class-incremental run: the accuracy matrix (task j after task i), accuracy on the seen classes per round
    with the task boundaries, each client's aggregation weight, and each client's privacy spending (ε)."""
    plt = pyplot()
    import re

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    r = [rec["round"] + 1 for rec in records]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0, 0]
    acc = np.asarray(acc_matrix, dtype=float)
    im = ax.imshow(acc, vmin=0, vmax=1, cmap="viridis")
    for (i, j), v in np.ndenumerate(acc):
        if np.isfinite(v):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w" if v < 0.6 else "k")
    ax.set(xlabel="accuracy on task j", ylabel="after training task i", title="accuracy matrix")
    ax.set_xticks(range(acc.shape[1]))
    ax.set_yticks(range(acc.shape[0]))
    fig.colorbar(im, ax=ax, fraction=0.046)
    ax = axes[0, 1]
    ax.plot(r, [rec.get("acc.seen", np.nan) for rec in records], "k-", lw=2.5, label="all seen classes")
    tasks = sorted({int(rec["task"]) for rec in records if "task" in rec})
    for j in tasks:
        ax.plot(r, [rec.get(f"acc.task{j}", np.nan) for rec in records], lw=1, label=f"task {j}")
    for prev, rec in zip(records, records[1:]):
        if rec.get("task") != prev.get("task"):
            ax.axvline(rec["round"] + 0.5, color="grey", ls=":", lw=1)
    ax.set(xlabel="round", ylabel="test accuracy", title="accuracy per task (dotted: a new task arrives)", ylim=(0, 1))
    ax.legend(fontsize=7, ncol=2)
    for ax, key, label in ((axes[1, 0], "agg_weight", "aggregation weight"), (axes[1, 1], "epsilon", "ε spent")):
        pat = re.compile(rf"^{key}\.c(\d+)$")
        keys = sorted({k for rec in records for k in rec if pat.match(k)}, key=lambda k: int(k.rsplit("c", 1)[1]))
        for k in keys:
            ax.plot(r, [rec.get(k, np.nan) for rec in records], "o", ms=3, label=k.rsplit(".", 1)[1])
        ax.set(
            xlabel="round",
            ylabel=label,
            title=f"{label} per client (when selected)" if keys else f"no {label} (not recorded in this run)",
        )
        if keys:
            ax.legend(fontsize=6, ncol=3)
    fig.suptitle(title)
    return save(fig, folder / "rounds.png")


def plot_privacy_utility(
    curves: Dict[str, List[Tuple[float, float, float]]],
    path: str | Path,
    *,
    reference: Tuple[float, float] | None = None,
    title: str = "",
    ylabel: str = "average incremental accuracy",
) -> Path:
    """Utility against ε_total, one line per family (e.g. ``LBDP, C = 1``): points ``(ε, mean, std)``;
    ``reference`` is the noise-free run's (mean, std), drawn as a band. The x axis is logarithmic with a tick
    at every ε measured; families are shifted sideways by up to ±4 % of ε so that error bars at one ε stay
    apart, and the legend sits outside the axes."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.2))
    n = len(curves)
    for i, (label, pts) in enumerate(curves.items()):
        pts = sorted(pts)
        shift = 1 + 0.08 * ((i + 0.5) / n - 0.5) if n > 1 else 1.0
        ax.errorbar(
            [p[0] * shift for p in pts],
            [p[1] for p in pts],
            yerr=[p[2] for p in pts],
            marker="o",
            capsize=3,
            label=label,
            ls="-" if len(pts) > 1 else "none",
        )
    if reference is not None:
        ax.axhline(reference[0], color="k", ls="--", lw=1, label="no noise (± std)")
        ax.axhspan(reference[0] - reference[1], reference[0] + reference[1], color="k", alpha=0.08)
    ax.set_xscale("log")
    eps = sorted({p[0] for pts in curves.values() for p in pts})
    ax.set_xticks(eps, [f"{e:g}" for e in eps])
    ax.minorticks_off()
    ax.set(xlabel="ε_total per client (δ = 1e-5)", ylabel=ylabel, title=title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return save(fig, Path(path))


def plot_curves(
    curves: Dict[str, np.ndarray],
    path: str | Path,
    *,
    title: str = "",
    xlabel: str = "",
    ylabel: str = "",
    reference: str | None = None,
) -> Path:
    """One line per ``method+aggregator`` key (in the dict's order): the mean over rows (seeds) of a
    (seeds, steps) array, with a band of ± one std. Colour names the method, line style the aggregator.

    With ``reference`` (a key), a second panel shows each adapting curve (not ``source``) minus the
    reference's, seed by seed: the per-step difficulty that all methods share drops out, and drift
    or collapse stands out.
    """
    plt = pyplot()
    methods = list(dict.fromkeys(k.split("+")[0] for k in curves))
    aggregators = list(dict.fromkeys(k.split("+")[-1] for k in curves))
    colours = {m: f"C{i}" for i, m in enumerate(methods)}
    styles = {a: s for a, s in zip(aggregators, ("-", "--", ":", "-.", (0, (5, 1)), (0, (1, 3))))}
    panels = 2 if reference in curves else 1
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3.6 * panels), sharex=True, squeeze=False)
    for row, ax in enumerate(axes[:, 0]):
        for key, arr in curves.items():
            arr = np.atleast_2d(arr)
            if row == 1:
                if key == reference or key.startswith("source+"):  # the unadapted model would set the scale
                    continue
                ref = np.atleast_2d(curves[cast(str, reference)])  # a second panel only when reference is a key
                n = min(len(arr), len(ref))
                arr = arr[:n] - ref[:n]
            mean, std = arr.mean(0), arr.std(0)
            x = np.arange(1, len(mean) + 1)
            method, aggregator = key.split("+")[0], key.split("+")[-1]
            ax.plot(x, mean, color=colours[method], linestyle=styles.get(aggregator, "-"), lw=1.3, label=key)
            if len(arr) > 1:
                ax.fill_between(x, mean - std, mean + std, color=colours[method], alpha=0.08)
        ax.grid(alpha=0.3)
        if row == 0:
            ax.set(ylabel=ylabel, title=title)
            ax.set_ylim(0, 1)
            ax.legend(fontsize=7, ncol=3, loc="lower left")
        else:
            ax.axhline(0, color="k", lw=0.8)
            ax.set(ylabel=f"minus {reference}")
    axes[-1, 0].set(xlabel=xlabel)
    return save(fig, Path(path))
