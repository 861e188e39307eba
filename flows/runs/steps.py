"""The pipeline's steps, one function each, taking the composed config: what every DVC stage and nightly job runs.

The command line (:mod:`flows.stages`) maps stage names to these; the nightly flows and the stress
protocols call them directly. Round-based steps take the system whose grid they run.
"""

from __future__ import annotations

import json
import time

from flows.config import compose as C


def prepare(cfg) -> None:
    from fedcore.data import load_dataset, save_prepared
    from flows.runs.federation import prepared_path

    t0 = time.perf_counter()
    data = load_dataset(cfg.data.name, C.resolve_path(cfg.paths.data_root))
    digest = save_prepared(data, prepared_path(cfg))
    print(
        f"prepared {cfg.data.name}: {len(data)} images {data.x.shape[1:]} sha256={digest[:12]} "
        f"({time.perf_counter() - t0:.1f}s) -> {prepared_path(cfg)}"
    )


def partition(cfg) -> None:
    from fedcore.data import build_partition, load_prepared
    from flows.runs.federation import partition_dir, prepared_path
    from flows.runs.tasks import build_hint

    d = cfg.data
    t0 = time.perf_counter()
    data = load_prepared(prepared_path(cfg), build=lambda: build_hint(cfg, "prepare"))
    part = build_partition(
        data,
        dataset=d.name,
        num_source_clients=int(d.num_source_clients),
        dirichlet_alpha=float(d.dirichlet_alpha),
        corruptions=list(d.corruptions),
        severity=int(d.severity),
        stream_size=int(d.stream_size),
        holdout_size=int(d.holdout_size),
        stream_order=str(d.stream_order),
        source_fraction=float(d.source_fraction),
        source_test_fraction=float(d.source_test_fraction),
        holdout_fraction=float(d.holdout_fraction),
        official_train_size=d.official_train_size,
        seed=int(cfg.seed),
    )
    out = part.save(partition_dir(cfg))
    print(
        f"partition {d.name}: {len(part.source_x)} source clients {[len(x) for x in part.source_x]}, "
        f"{len(part.targets)} target clients x {d.stream_size} stream / {d.holdout_size} hold-out "
        f"({time.perf_counter() - t0:.1f}s) -> {out}"
    )


def pretrain(cfg) -> None:
    from flows.runs.federation import pretrain

    print(f"source model -> {pretrain(cfg)}")


def arrival(cfg) -> None:
    from flows.runs.federation import arrival

    res = arrival(cfg)
    print(json.dumps(res.summary, indent=1))


def summary_key(method: str, aggregator: str, form: str, seed: int) -> str:
    """A sweep cell's key in summary.json: ``method+aggregator[+form]+s<seed>``."""
    return "+".join([method, aggregator] + ([form] if form != "plain" else []) + [f"s{seed}"])


def adapt(cfg, written=None) -> list:
    """The sweep, then the table and summary the ``adapt`` stage declares; returns the sweep's results.

    summary.json holds every cell's summary by :func:`summary_key`, and under ``headline`` the configured
    ``method`` + ``aggregator`` (+ ``privacy``) cell's, when the sweep ran it: the numbers ``dvc exp show``
    and ``dvc exp diff`` put side by side whatever the sweep's cells.

    ``written``: md5s of inputs the caller wrote itself (the nightly job), see :func:`flows.runs.federation.sweep`.
    """
    from flows.runs.federation import sweep
    from flows.services.tracking import summary_rows

    t0 = time.perf_counter()
    results = sweep(cfg, written=written)
    out = C.resolve_path(cfg.paths.results)
    out.mkdir(parents=True, exist_ok=True)
    table = summary_rows(results)
    (out / "table.md").write_text(table + "\n")
    summary = {
        summary_key(r["method"], r["aggregator"], r.get("form", "plain"), r["seed"]): r["summary"] for r in results
    }
    head = C.arrival_config(cfg)
    head_key = summary_key(head.method, head.aggregator, head.form, head.seed)
    if head_key in summary:  # the configured cell under a fixed name: one column per metric in `dvc exp show`
        summary["headline"] = summary[head_key]
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    print(
        f"\n{cfg.data.name} ({len(cfg.data.corruptions)} corruptions, severity {cfg.data.severity}, "
        f"{cfg.adapt.passes} passes), sweep took {time.perf_counter() - t0:.0f}s\n"
    )
    print(table)
    print(f"\nBrowse the runs: mlflow ui --backend-store-uri {C.tracking_uri(cfg)} --host 127.0.0.1 --port 5000")
    return results


def audit(cfg) -> None:
    """The canary audit of a DP-TTA variant's model: empirical ε lower bounds beside the accountant's ε
    (results/private/audit.*)."""
    if C.variant_system(cfg, str(cfg.variant)) != "dptta":
        raise ValueError(
            f"the canary audit runs on a DP-TTA variant's private model, not on variant {cfg.variant!r}; "
            f"add variant=<{'|'.join(sorted(cfg.dptta.variants))}> (conf/experiment/dptta.yaml)"
        )
    from flows.runs.federation import audit

    rows = audit(cfg)
    out = C.resolve_path(cfg.paths.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["| form | sigma | accountant ε | empirical ε lower bound | AUC |", "|---|---|---|---|---|"]
    for r in rows:
        acc = "∞ (no guarantee)" if r["epsilon_accountant"] == float("inf") else f"{r['epsilon_accountant']:.2f}"
        lines.append(f"| {r['form']} | {r['sigma']:.3f} | {acc} | {r['epsilon_lower']:.2f} | {r['auc']:.3f} |")
    (out / "audit.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def partition_domains(cfg, system: str = "fedpad") -> None:
    """The grid's domain-silo partition: each client holds one domain (``<system>.grids.<grid>``)."""
    from fedcore.data.domains import build_domain_partition, load_domains

    name = str(cfg[system].grid)
    g = C.grid(cfg, system, name)
    t0 = time.perf_counter()
    ds = load_domains(
        str(g.set),
        C.resolve_path(cfg.paths.data_root),
        size=int(g.size),
        seed=int(cfg.seed),
        max_per_domain=None if g.max_per_domain is None else int(g.max_per_domain),
    )
    part = build_domain_partition(
        ds,
        clients_per_domain=dict(g.clients_per_domain),
        test_fraction=float(g.test_fraction),
        size_skew=float(g.size_skew),
        seed=int(cfg.seed),
        label_alpha=None if g.get("label_alpha") is None else float(g.label_alpha),
        rows_per_client=None if g.get("rows_per_client") is None else int(g.rows_per_client),
    )
    out = part.save(C.domains_dir(cfg, system, name))
    sizes = ", ".join(
        f"{d}: {len(part.clients_of(d))} clients x ~{len(part.client_y[part.clients_of(d)[0]])}" for d in part.domains
    )
    print(f"partition {system}@{name} ({g.set}, {g.size}px): {sizes} ({time.perf_counter() - t0:.1f}s) -> {out}")


def run_grid(cfg, system: str) -> None:
    from flows.runs.rounds import grid, results_dir

    t0 = time.perf_counter()
    grid(cfg, system)
    out = results_dir(cfg, system, str(cfg[system].grid))
    print(f"\n{system} grid {cfg[system].grid} took {time.perf_counter() - t0:.0f}s\n")
    print((out / "table.md").read_text())
    if (out / "stats.md").is_file():
        print((out / "stats.md").read_text())


def single_run(cfg, system: str = "fedpad") -> None:
    from flows.runs.rounds import single

    print(json.dumps(single(cfg, system).summary, indent=1))
