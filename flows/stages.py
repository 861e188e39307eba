"""Command line for the pipeline stages and flows.

    python -m flows.stages prepare|partition|pretrain|adapt [--params params.yaml] [overrides...]
    python -m flows.stages arrival method=tent aggregator=ugsa      # one experiment, Hydra overrides
    python -m flows.stages sweep 'sweep.methods=[bn,tent]' 'sweep.privacy=[plain,dp-eps5]'
    python -m flows.stages prepare variant=cifar10   # likewise partition, pretrain, adapt: CIFAR-10-C
    python -m flows.stages pretrain variant=private && python -m flows.stages adapt variant=private   # private-TTA grid
    python -m flows.stages audit variant=private     # canary membership audit of the private form
    python -m flows.stages stress bpfedctta.stress.cell=lr1e-1-p3 && python -m flows.stages stress_report
    python -m flows.stages stress_private dptta.stress.cell=lr1e-1-p3 && python -m flows.stages stress_private_report
    python -m flows.stages stress_cifar bpfedctta.stress_cifar.cell=lr1e-1-p1 && python -m flows.stages stress_cifar_report
    python -m flows.stages partition_domains fedpad.grid=digits && python -m flows.stages fedpad fedpad.grid=digits
    python -m flows.stages rounds trainer=proto strategy=fedpad     # one FedPAD run, a Prefect task per round
    python -m flows.stages partition_fedpd fedpd.grid=digits && python -m flows.stages fedpd fedpd.grid=digits
    python -m flows.stages rounds_fedpd trainer=proser strategy=fedpd   # one FedPD++ run, a Prefect task per round
    python -m flows.stages partition_ppfcil ppfcil.grid=mnist && python -m flows.stages ppfcil ppfcil.grid=mnist

With ``--params`` the stage reads the file DVC tracks; without it, conf/ is composed with the
overrides. Either way the selected ``variant`` (mnist, the default, cifar10 or private) is laid over the
config. ``adapt`` is the sweep over ``sweep.*`` that writes results/ for DVC.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any, Mapping

import numpy as np

from flows import config as C


def _prepare(cfg) -> None:
    from fedcore.data import load_dataset, save_prepared
    from flows.federation import prepared_path

    t0 = time.perf_counter()
    data = load_dataset(cfg.data.name, C.resolve_path(cfg.paths.data_root))
    digest = save_prepared(data, prepared_path(cfg))
    print(f"prepared {cfg.data.name}: {len(data)} images {data.x.shape[1:]} sha256={digest[:12]} "
          f"({time.perf_counter() - t0:.1f}s) -> {prepared_path(cfg)}")


def _partition(cfg) -> None:
    from fedcore.data import build_partition, load_prepared
    from flows.federation import partition_dir, prepared_path

    d = cfg.data
    t0 = time.perf_counter()
    data = load_prepared(prepared_path(cfg))
    part = build_partition(
        data, dataset=d.name, num_source_clients=int(d.num_source_clients), dirichlet_alpha=float(d.dirichlet_alpha),
        corruptions=list(d.corruptions), severity=int(d.severity), stream_size=int(d.stream_size),
        holdout_size=int(d.holdout_size), stream_order=str(d.stream_order), source_fraction=float(d.source_fraction),
        source_test_fraction=float(d.source_test_fraction), holdout_fraction=float(d.holdout_fraction),
        official_train_size=d.official_train_size, seed=int(cfg.seed))
    out = part.save(partition_dir(cfg))
    print(f"partition {d.name}: {len(part.source_x)} source clients {[len(x) for x in part.source_x]}, "
          f"{len(part.targets)} target clients x {d.stream_size} stream / {d.holdout_size} hold-out "
          f"({time.perf_counter() - t0:.1f}s) -> {out}")


def _pretrain(cfg) -> None:
    from flows.federation import pretrain

    print(f"source model -> {pretrain(cfg)}")


def _arrival(cfg) -> None:
    from flows.federation import arrival

    res = arrival(cfg)
    print(json.dumps(res.summary, indent=1))


def _summary_key(method: str, aggregator: str, form: str, seed: int) -> str:
    """A sweep cell's key in summary.json: ``method+aggregator[+form]+s<seed>``."""
    return "+".join([method, aggregator] + ([form] if form != "plain" else []) + [f"s{seed}"])


def _adapt(cfg, written=None) -> list:
    """The sweep, then the table and summary the ``adapt`` stage declares; returns the sweep's results.

    summary.json holds every cell's summary by :func:`_summary_key`, and under ``headline`` the configured
    ``method`` + ``aggregator`` (+ ``privacy``) cell's, when the sweep ran it: the numbers ``dvc exp show``
    and ``dvc exp diff`` put side by side whatever the sweep's cells.

    ``written``: md5s of inputs the caller wrote itself (the nightly job), see :func:`flows.federation.sweep`.
    """
    from flows.federation import sweep
    from flows.tracking import summary_rows

    t0 = time.perf_counter()
    results = sweep(cfg, written=written)
    out = C.resolve_path(cfg.paths.results)
    out.mkdir(parents=True, exist_ok=True)
    table = summary_rows(results)
    (out / "table.md").write_text(table + "\n")
    summary = {_summary_key(r["method"], r["aggregator"], r.get("form", "plain"), r["seed"]): r["summary"]
               for r in results}
    head = C.arrival_config(cfg)
    head_key = _summary_key(head.method, head.aggregator, head.form, head.seed)
    if head_key in summary:  # the configured cell under a fixed name: one column per metric in `dvc exp show`
        summary["headline"] = summary[head_key]
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    print(f"\n{cfg.data.name} ({len(cfg.data.corruptions)} corruptions, severity {cfg.data.severity}, "
          f"{cfg.adapt.passes} passes), sweep took {time.perf_counter() - t0:.0f}s\n")
    print(table)
    print(f"\nBrowse the runs: mlflow ui --backend-store-uri {C.tracking_uri(cfg)} --host 127.0.0.1 --port 5000")
    return results


def _audit(cfg) -> None:
    """The canary audit of a DP-TTA variant's model: empirical ε lower bounds beside the accountant's ε
    (results/private/audit.*)."""
    if C.variant_system(cfg, str(cfg.variant)) != "dptta":
        raise ValueError(f"the canary audit runs on a DP-TTA variant's private model, not on variant {cfg.variant!r}; "
                         f"add variant=<{'|'.join(sorted(cfg.dptta.variants))}> (conf/experiment/dptta.yaml)")
    from omegaconf import OmegaConf

    from flows.federation import audit

    rows = audit(OmegaConf.merge({"audit": cfg.dptta.audit}, cfg))  # flows.federation.audit reads cfg.audit
    out = C.resolve_path(cfg.paths.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["| form | sigma | accountant ε | empirical ε lower bound | AUC |", "|---|---|---|---|---|"]
    for r in rows:
        acc = "∞ (no guarantee)" if r["epsilon_accountant"] == float("inf") else f"{r['epsilon_accountant']:.2f}"
        lines.append(f"| {r['form']} | {r['sigma']:.3f} | {acc} | {r['epsilon_lower']:.2f} | {r['auc']:.3f} |")
    (out / "audit.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


STEP_PATHS = {"prepare": "prepared", "partition": "partitions", "pretrain": "models"}  # the paths.<key> each writes


def _stage_writing(cfg, step: str) -> tuple:
    """The DVC stage that builds this run's input of ``step`` (its ``paths.<key>``), and that stage's variant:
    the selected variant's own ``<step>@<variant>``, else, for a variant without one that reads the root's
    folder, the stage of a variant that does too (the private variant reads ``partition@mnist``'s)."""
    import yaml

    key, variant = STEP_PATHS[step], str(cfg.variant)
    foreach = yaml.safe_load((C.ROOT / "dvc.yaml").read_text())["stages"].get(step, {}).get("foreach") or {}

    def reads_root(name: str) -> bool:
        return key not in cfg[C.variant_system(cfg, name)].variants[name].get("paths", {})

    if variant not in foreach and reads_root(variant):
        variant = next((str(v) for v in foreach if str(v) in C.variants(cfg) and reads_root(str(v))), variant)
    return f"{step}@{variant}", variant


def _pointing_at(cfg, run):
    """Run ``run()``; a missing-input error then names the stage that builds the input for this variant
    (``dvc repro pretrain`` -> ``dvc repro pretrain@cifar10``)."""
    try:
        return run()
    except (FileNotFoundError, ValueError) as exc:
        msg = str(exc)
        for step in STEP_PATHS:
            stage, variant = _stage_writing(cfg, step)
            msg = msg.replace(f"dvc repro {step}`", f"dvc repro {stage}`").replace(
                f"flows.stages {step}`", f"flows.stages {step} variant={variant}`")
        if msg == str(exc):
            raise
        raise type(exc)(msg) from exc


def _partition_domains(cfg, system: str = "fedpad") -> None:
    """The grid's domain-silo partition: each client holds one domain (``<system>.grids.<grid>``)."""
    from fedcore.data.domains import build_domain_partition, load_domains

    name = str(cfg[system].grid)
    g = C.grid(cfg, system, name)
    t0 = time.perf_counter()
    ds = load_domains(str(g.set), C.resolve_path(cfg.paths.data_root), size=int(g.size), seed=int(cfg.seed),
                      max_per_domain=None if g.max_per_domain is None else int(g.max_per_domain))
    part = build_domain_partition(ds, clients_per_domain=dict(g.clients_per_domain),
                                  test_fraction=float(g.test_fraction), size_skew=float(g.size_skew),
                                  seed=int(cfg.seed),
                                  label_alpha=None if g.get("label_alpha") is None else float(g.label_alpha))
    out = part.save(C.domains_dir(cfg, system, name))
    sizes = ", ".join(f"{d}: {len(part.clients_of(d))} clients x ~{len(part.client_y[part.clients_of(d)[0]])}"
                      for d in part.domains)
    print(f"partition {system}@{name} ({g.set}, {g.size}px): {sizes} ({time.perf_counter() - t0:.1f}s) -> {out}")


def _grid(cfg, system: str) -> None:
    from flows.rounds import grid, results_dir

    t0 = time.perf_counter()
    grid(cfg, system)
    out = results_dir(cfg, system, str(cfg[system].grid))
    print(f"\n{system} grid {cfg[system].grid} took {time.perf_counter() - t0:.0f}s\n")
    print((out / "table.md").read_text())
    if (out / "stats.md").is_file():
        print((out / "stats.md").read_text())


def _fedpad_report(cfg) -> None:
    """Wilcoxon and Friedman on worst-domain accuracy, pooled over the grids in ``fedpad.report`` (blocks: grid × seed)."""
    from flows.rounds import results_dir, stats_report

    grids = [str(g) for g in cfg.fedpad.report]
    per_grid = {}
    for g in grids:
        path = results_dir(cfg, "fedpad", g) / "scores.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing. Build it with `dvc repro fedpad@{g}`.")
        per_grid[g] = json.loads(path.read_text())["worst_acc_by_seed"]
    common = [m for m in per_grid[grids[0]] if all(m in per_grid[g] for g in grids)]
    pooled = {m: [v for g in grids for v in per_grid[g][m]] for m in common}
    text = (f"# FedPAD against every method both grids ran: {', '.join(grids)}\n\n"
            + stats_report(pooled, "fedpad") + "\n")
    out = C.resolve_path(cfg.paths.results) / "fedpad" / "report.md"
    out.write_text(text)
    print(text)


PRIVACY_LABELS = {"lbdp": "LBDP", "dp": "classic DP", "nbafl": "NbAFL"}  # the fcil trainer's private forms
SAME_DATA = ("set", "size", "max_per_domain", "clients_per_domain", "test_fraction", "size_skew", "tasks", "clients",
             "alpha", "rounds_per_task", "participation", "model", "norm")  # what grids compared on one curve share


def _privacy_label(tp: Mapping[str, Any]) -> str:
    """A private method's curve: its form, and the variant of its account where it is not the default."""
    form = str(tp.get("privacy", "none"))
    label = PRIVACY_LABELS.get(form, form)
    if form == "lbdp" and tp.get("bdp_estimator", "mean") != "mean":
        label += f" ({tp['bdp_estimator']})"
    if form == "nbafl" and tp.get("nbafl_sensitivity", "average") != "average":
        label += f" ({tp['nbafl_sensitivity']}-case ΔS)"
    return f"{label}, C = {float(tp.get('clip_norm', 1.0)):g}"


def _ppfcil_privacy(cfg) -> None:
    """The privacy-utility curve of a PP-FCIL grid (``ppfcil.privacy_report``) and of the grids run beside it on
    the same data (``ppfcil.privacy_report_with``): average incremental accuracy against ε_total for each
    private form and clip norm, beside the noise-free reference; the paired gap between LBDP and classic DP
    at each (ε, C); and every private method's score."""
    from fedcore.evaluate.plots import plot_privacy_utility
    from fedcore.evaluate.stats import wilcoxon_against
    from flows.rounds import results_dir

    grid_name = str(cfg.ppfcil.privacy_report)
    grids = [grid_name, *[str(g) for g in cfg.ppfcil.get("privacy_report_with", [])]]
    main = C.grid(cfg, "ppfcil", grid_name)
    curves, reference, pairs, rows = {}, None, {}, []
    for g in grids:
        differ = [k for k in SAME_DATA if C.grid(cfg, "ppfcil", g).get(k) != main.get(k)]
        if differ:
            raise ValueError(f"ppfcil grid {g!r} is not on grid {grid_name!r}'s data and schedule ({', '.join(differ)} "
                             f"differ), so it cannot join its privacy curve; drop it from ppfcil.privacy_report_with "
                             f"or give it the same settings")
    for g in grids:
        spec = C.grid(cfg, "ppfcil", g)
        path = results_dir(cfg, "ppfcil", g) / "scores.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing. Build it with `dvc repro ppfcil@{g}`.")
        scores = json.loads(path.read_text())["avg_inc_acc_by_seed"]
        for m in spec.methods:
            tp = C.round_config(cfg, "ppfcil", method=str(m), seed=0, grid_name=g).trainer_params
            if str(m) not in scores:
                raise ValueError(f"{path} has no scores for method {m!r}, which grid {g!r} now lists; rebuild it with "
                                 f"`dvc repro ppfcil@{g}`")
            vals = scores[str(m)]
            point = (float(np.mean(vals)), float(np.std(vals)))
            form = tp.get("privacy", "none")
            if form == "none":
                reference = point
                continue
            if form == "clip":  # DP-SGD's mechanics without noise: no ε, a diagnostic (see the privacy-clip grid)
                continue
            eps, clip, label = float(tp["epsilon"]), float(tp.get("clip_norm", 1.0)), _privacy_label(tp)
            curves.setdefault(label, []).append((eps, *point))
            rows.append((label, eps, str(m), g, point, len(vals)))
            if label.split(",")[0] in ("LBDP", "classic DP"):
                pairs.setdefault((eps, clip), {})[form] = vals
    out = results_dir(cfg, "ppfcil", grid_name)
    plot_privacy_utility(curves, out / "privacy.png", reference=reference,
                         title=f"PP-FCIL {grid_name}: privacy-utility")
    lines = [f"# PP-FCIL privacy-utility ({' + '.join(grids)} grids)", "",
             "Average incremental accuracy, mean ± std over seeds; LBDP − classic DP paired over seeds.", "",
             "| ε_total | C | LBDP | classic DP | LBDP − DP | LBDP wins |", "|---|---|---|---|---|---|"]
    for (eps, clip), d in sorted(pairs.items()):
        if {"lbdp", "dp"} <= set(d):
            gap = wilcoxon_against({"lbdp": d["lbdp"], "dp": d["dp"]}, "lbdp")[0]
            lines.append(f"| {eps:g} | {clip:g} | {np.mean(d['lbdp']):.3f} ± {np.std(d['lbdp']):.3f} | "
                         f"{np.mean(d['dp']):.3f} ± {np.std(d['dp']):.3f} | {gap.mean_gap:+.3f} | {gap.wins}/{gap.n} |")
    if reference is not None:
        lines += ["", f"No noise (same objective): {reference[0]:.3f} ± {reference[1]:.3f}."]
    lines += ["", "Every private method:", "", "| form | ε_total | method (grid) | avg incremental acc | seeds |",
              "|---|---|---|---|---|"]
    lines += [f"| {label} | {eps:g} | {m} ({g}) | {pt[0]:.3f} ± {pt[1]:.3f} | {n} |"
              for label, eps, m, g, pt, n in sorted(rows)]
    (out / "privacy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _rounds(cfg, system: str = "fedpad") -> None:
    from flows.rounds import single

    print(json.dumps(single(cfg, system).summary, indent=1))


def _on_variant(step):
    """A step of a variant's pipeline: its missing-input errors name that variant's stages."""
    return lambda cfg: _pointing_at(cfg, lambda: step(cfg))


def _stress(cfg, protocol: str = "bpfedctta") -> None:
    """A stress cell; a missing input names the stage of the protocol's variant that builds it."""
    from flows.stress import protocol as proto
    from flows.stress import run_cell

    print(f"figure -> {_pointing_at(C.with_variant(cfg, proto(protocol).variant), lambda: run_cell(cfg, protocol))}")


def _stress_report(cfg, protocol: str = "bpfedctta") -> None:
    """The report of every cell that ran; for a protocol with an lr × passes grid, that grid at a glance."""
    from flows import stress_grid
    from flows.stress import report

    print(report(cfg, protocol))
    if protocol in stress_grid.PROTOCOLS:
        print(stress_grid.write(cfg, protocol))


STAGES = {"stress": _stress, "stress_report": _stress_report,
          "stress_private": lambda cfg: _stress(cfg, "dptta"),
          "stress_private_report": lambda cfg: _stress_report(cfg, "dptta"),
          "stress_cifar": lambda cfg: _stress(cfg, "cifar10"),
          "stress_cifar_report": lambda cfg: _stress_report(cfg, "cifar10"), "partition_domains": _partition_domains, "fedpad": lambda cfg: _grid(cfg, "fedpad"),
          "fedpad_report": _fedpad_report, "rounds": _rounds,
          "partition_fedpd": lambda cfg: _partition_domains(cfg, "fedpd"), "fedpd": lambda cfg: _grid(cfg, "fedpd"),
          "rounds_fedpd": lambda cfg: _rounds(cfg, "fedpd"),
          "partition_ppfcil": lambda cfg: _partition_domains(cfg, "ppfcil"), "ppfcil": lambda cfg: _grid(cfg, "ppfcil"),
          "rounds_ppfcil": lambda cfg: _rounds(cfg, "ppfcil"), "ppfcil_privacy": _ppfcil_privacy,
          **{name: _on_variant(fn) for name, fn in (("prepare", _prepare), ("partition", _partition),
                                                     ("pretrain", _pretrain), ("adapt", _adapt), ("sweep", _adapt),
                                                     ("arrival", _arrival), ("audit", _audit))}}


def _prefect_warnings_only(record: logging.LogRecord) -> bool:
    """A terminal filter: Prefect's records at WARNING and above, everyone else's as they come."""
    return record.levelno >= logging.WARNING or not record.name.startswith("prefect")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.stages", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=sorted(STAGES))
    ap.add_argument("--params", default=None, help="read this params file (DVC) instead of composing conf/")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. method=tent adapt.passes=1")
    args = ap.parse_intermixed_args(argv)  # overrides may follow --params (as the DVC stages write them)
    terminal = logging.StreamHandler()
    terminal.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    if "PREFECT_LOGGING_LEVEL" not in os.environ:
        # Flow and task logs go to the Prefect API at INFO (the UI's Logs tab, flows/runtime.py);
        # the terminal keeps showing Prefect's warnings only, not a line per task run.
        terminal.addFilter(_prefect_warnings_only)
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")  # Prefect's own handler, Ray workers
    logging.basicConfig(level=logging.INFO, handlers=[terminal])
    for noisy in ("httpx", "mlflow.store.db.utils", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from fedcore.engine.checkpoint import CheckpointError

    try:
        cfg = C.load(args.params, args.overrides)
        STAGES[args.stage](cfg)
    except (ValueError, FileNotFoundError, CheckpointError, HydraException, OmegaConfBaseException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
