"""The stress protocol's cells compose as declared, and its report pairs seeds correctly."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from flows import config as C
from flows import stress as S


@pytest.fixture(scope="module")
def cfg():
    return C.compose([])


def test_a_cell_lays_its_settings_over_the_mnist_variant(cfg):
    # Act
    out = S.cell_config(cfg, "bs16-lr1e-1-p3")

    # Assert
    tent = C.arrival_config(out, method="tent", aggregator="sequential", seed=2)
    bpa = C.arrival_config(out, method="bpa", aggregator="ugsa")
    assert tent.method_params["lr"] == 0.1 and bpa.method_params["lr"] == 0.1
    assert "lr" not in C.arrival_config(out, method="bn", aggregator="none").method_params
    assert (tent.passes, tent.batch_size, tent.stream, tent.seed) == (3, 16, "shuffled", 2)
    assert C.arrival_config(S.cell_config(cfg, "sorted-lr1e-2-p3"), method="tent").stream == "class_sorted"
    assert list(out.sweep.aggregators) == ["none", "sequential", "fedavg", "ugsa"]
    assert list(out.sweep.seeds) == [0, 1, 2]
    assert out.paths.results == "results/stress/bs16-lr1e-1-p3"
    assert cfg.adapt.batch_size == 64 and cfg.sweep.method_params == {}, "the root config is left as it was"


def test_every_declared_cell_composes(cfg):
    S.check(cfg)


def test_bad_cells_name_the_fix(cfg):
    with pytest.raises(ValueError, match="unknown stress cell 'lr1e-1-p4'; valid names are: lr1e-3-p1"):
        S.cell_config(cfg, "lr1e-1-p4")
    bad = cfg.copy()
    OmegaConf.set_struct(bad, False)
    bad.bpfedctta.stress.cells["x"] = {"learning_rate": 0.1}
    with pytest.raises(ValueError, match="a cell may set: lr, passes, stream, batch_size, beta"):
        S.cell_config(bad, "x")
    with pytest.raises(ValueError, match="name a stress cell"):
        S.run_cell(cfg)


def _write_cell(folder, gaps):
    """A fake cell: bpa+ugsa beats tent+sequential by ``gaps[seed]`` on final hold-out accuracy."""
    summary = {}
    for seed, gap in enumerate(gaps):
        for name, acc in (("tent+sequential", 0.5), ("bpa+ugsa", 0.5 + gap), ("bpa+sequential", 0.6)):
            summary[f"{name}+s{seed}"] = {"final_avg_holdout_acc": acc, "avg_online_acc": acc,
                                          "final_worst_holdout_acc": acc - 0.1, "forgetting": 0.0}
            run = folder / "cells" / f"{name.replace('+', '-')}-s{seed}"
            run.mkdir(parents=True)
            with (run / "arrivals.csv").open("w", newline="") as fh:
                w = csv.writer(fh)
                w.writerow(["arrival", "online_acc"])
                w.writerows([[a, acc] for a in range(4)])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(summary))


def test_report_pairs_by_seed_and_pools_cells(cfg, tmp_path):
    # Arrange: two of the declared cells ran
    root = tmp_path / "stress"
    _write_cell(root / "lr1e-1-p3", [0.10, 0.20, 0.30])
    _write_cell(root / "lr1e-2-p3", [-0.05, 0.05, 0.0])
    c = OmegaConf.merge(cfg, {"bpfedctta": {"stress": {"results": str(root)}}})

    # Act
    text = S.report(c)
    cell = S.load_cell(root / "lr1e-1-p3")

    # Assert
    t = S.paired(cell, "final_avg_holdout_acc", "bpa+ugsa", "tent+sequential")
    from scipy.stats import ttest_rel
    assert t["gap"] == pytest.approx(0.2) and t["wins"] == 3 and t["n"] == 3
    assert t["p"] == pytest.approx(ttest_rel([0.6, 0.7, 0.8], [0.5, 0.5, 0.5]).pvalue)
    assert f"Cells run: 2 of {len(S.cell_names(c))}" in text
    assert "| tent+sequential | +0.200 | 3/3 |" in text
    assert "| tent+sequential | 6 | +0.100 | 4/6 |" in text, "pooled over 2 cells x 3 seeds"
    report_md, summary_json = S.report_paths(c)
    assert report_md.read_text() == text
    assert json.loads(summary_json.read_text())["lr1e-1-p3"]["bpa+ugsa"]["final_avg_holdout_acc"] == pytest.approx(0.7)
    curves = S.online_curves(root / "lr1e-1-p3")
    assert curves["bpa+ugsa"].shape == (3, 4)
    np.testing.assert_allclose(curves["bpa+ugsa"].mean(0), 0.7)
    assert S.plot_cell(root / "lr1e-1-p3", title="t").stat().st_size > 0


def test_report_without_results_names_the_stage(cfg, tmp_path):
    c = OmegaConf.merge(cfg, {"bpfedctta": {"stress": {"results": str(tmp_path / "none")}}})
    with pytest.raises(FileNotFoundError, match=r"dvc repro stress@lr1e-3-p1"):
        S.report(c)


def test_an_ablation_cell_sets_the_gate_and_narrows_the_sweep(cfg):
    out = S.cell_config(cfg, "ugsa-none-b0")
    assert list(out.sweep.methods) == ["tent", "bpa"] and list(out.sweep.aggregators) == ["ugsa"]
    ugsa = C.arrival_config(out, method="bpa", aggregator="ugsa")
    assert ugsa.aggregator_params == {"gamma": 0.5, "beta": 0, "normalizer": "none"}
    assert "β = 0, normaliser none" in S.describe(cfg, "ugsa-none-b0")


def test_a_private_cell_lays_its_lr_over_the_groupnorm_variant(cfg):
    out = S.cell_config(cfg, "lr1e-1-p3", "dptta")
    sar = C.arrival_config(out, method="sar", aggregator="sequential", form="dp-eps10", seed=1)
    assert sar.method_params["lr"] == 0.1 and sar.passes == 3 and sar.seed == 1
    assert out.model.norm == "group" and out.paths.models == "models_group"
    assert out.sweep.noise_source == "seeded", "a research grid: DVC reruns it bit for bit"
    assert list(out.sweep.privacy) == ["plain", "clip", "dp-eps10"] and list(out.sweep.aggregators) == ["sequential"]
    assert out.paths.results == "results/stress_private/lr1e-1-p3"
    assert out.paths.checkpoints == "checkpoints/stress_private/lr1e-1-p3"
    S.check(cfg, name="dptta")
    with pytest.raises(ValueError, match="unknown stress protocol 'dp'; valid names are: bpfedctta, cifar10, dptta"):
        S.cell_config(cfg, "lr1e-1-p3", "dp")
    with pytest.raises(FileNotFoundError, match=r"dvc repro stress_private@lr1e-3-p3"):
        S.report(OmegaConf.merge(cfg, {"dptta": {"stress": {"results": "/nonexistent/stress_private"}}}), "dptta")


def test_a_cifar_cell_lays_its_lr_over_the_cifar10_variant_with_its_own_source_model(cfg):
    out = S.cell_config(cfg, "lr1e-1-p1", "cifar10")
    tent = C.arrival_config(out, method="tent", aggregator="sequential")
    assert tent.method_params["lr"] == 0.1 and tent.passes == 1
    assert (out.data.name, out.model.name, out.paths.models) == ("cifar10", "resnet20", "models_cifar")
    assert list(out.sweep.methods) == ["bn", "tent", "bpa"] and list(out.sweep.aggregators) == ["sequential", "ugsa"]
    assert out.paths.results == "results/stress_cifar/lr1e-1-p1"
    assert out.flow.experiment == "fedcore-cifar10-stress"
    S.check(cfg, name="cifar10")
    with pytest.raises(ValueError, match="bpfedctta.stress_cifar.cell=<name>, one of lr1e-1-p1"):
        S.run_cell(cfg, "cifar10")
    with pytest.raises(FileNotFoundError, match=r"dvc repro stress_cifar@lr1e-1-p1"):
        S.report(OmegaConf.merge(cfg, {"bpfedctta": {"stress_cifar": {"results": "/nonexistent/sc"}}}), "cifar10")


def _write_private_cell(folder, acc):
    """A fake private cell: ``acc[key][seed]`` final accuracy of each ``method+aggregator[+form]``."""
    summary = {}
    for key, by_seed in acc.items():
        for seed, a in enumerate(by_seed):
            summary[f"{key}+s{seed}"] = {"final_avg_holdout_acc": a, "avg_online_acc": a,
                                         "final_worst_holdout_acc": a, "forgetting": 0.0}
            run = folder / "cells" / f"{key.replace('+', '-')}-s{seed}"  # dp-eps10 keeps its hyphen
            run.mkdir(parents=True)
            (run / "arrivals.csv").write_text("arrival,online_acc\n" + "".join(f"{i},{a}\n" for i in range(3)))
    (folder / "summary.json").write_text(json.dumps(summary))


def test_the_private_report_pairs_plain_with_source_and_each_form_with_plain(cfg, tmp_path):
    # Arrange: tent falls below the source; clip recovers it, DP recovers part
    root = tmp_path / "stress_private"
    _write_private_cell(root / "lr1e-1-p3", {
        "source+sequential": [0.8, 0.8, 0.8], "tent+sequential": [0.5, 0.6, 0.4],
        "tent+sequential+clip": [0.8, 0.85, 0.8], "tent+sequential+dp-eps10": [0.6, 0.6, 0.5]})
    c = OmegaConf.merge(cfg, {"dptta": {"stress": {"results": str(root)}}})

    # Act
    text = S.report(c, "dptta")
    cell = S.load_cell(root / "lr1e-1-p3")
    curves = S.online_curves(root / "lr1e-1-p3", "dptta")

    # Assert
    assert sorted(S.privacy_pairs(cell)) == [("tent+sequential", "source+sequential"),
                                             ("tent+sequential+clip", "tent+sequential"),
                                             ("tent+sequential+dp-eps10", "tent+sequential")]
    assert "| tent+sequential − source+sequential | -0.300 | 0/3 |" in text
    assert "| tent+sequential+clip − tent+sequential | +0.317 | 3/3 |" in text
    assert "| tent+sequential+dp-eps10 − tent+sequential | +0.067 | 2/3 |" in text
    assert list(curves) == ["source+sequential", "tent+sequential", "tent+sequential+clip",
                            "tent+sequential+dp-eps10"], "the sweep's order: method, then form"
    np.testing.assert_allclose(curves["tent+sequential+dp-eps10"].mean(1), [0.6, 0.6, 0.5])
    assert S.report_paths(c, "dptta")[0].name == "stress_private_report.md"
    assert S.plot_cell(root / "lr1e-1-p3", title="t", name="dptta").stat().st_size > 0


def test_a_plain_method_is_paired_with_the_source_run_under_its_own_aggregator():
    cell = {"source+none": {}, "source+ugsa": {}, "tent+ugsa": {}, "tent+ugsa+clip": {}, "tent+fedavg": {}}
    assert sorted(S.privacy_pairs(cell)) == [("tent+fedavg", "source+none"), ("tent+fedavg", "source+ugsa"),
                                             ("tent+ugsa", "source+ugsa"), ("tent+ugsa+clip", "tent+ugsa")]
