"""The stress protocol's cells compose as declared, and its report pairs seeds correctly."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from flows.config import compose as C
from flows.runs import stress as S


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


def test_a_cell_under_another_protocols_variant_is_refused_not_mixed():
    # Prepare: the CIFAR-10 variant selected, then an MNIST stress cell asked for
    cifar = C.compose(["variant=cifar10"])

    # Execute / Assert: refused (laying mnist over it would keep cifar10's data and model in mnist's folder)
    with pytest.raises(ValueError, match="the bpfedctta stress cells run on variant 'mnist'.*drop variant=cifar10"):
        S.cell_config(cifar, "lr1e-1-p3")
    # ...while the root variant, whose overlay sets nothing, still takes any protocol's
    assert S.cell_config(C.compose([]), "lr1e-1-p3").variant == "mnist"


def _write_cell(folder, gaps):
    """A fake cell: bpa+ugsa beats tent+sequential by ``gaps[seed]`` on final hold-out accuracy."""
    summary = {}
    for seed, gap in enumerate(gaps):
        for name, acc in (("tent+sequential", 0.5), ("bpa+ugsa", 0.5 + gap), ("bpa+sequential", 0.6)):
            summary[f"{name}+s{seed}"] = {
                "final_avg_holdout_acc": acc,
                "avg_online_acc": acc,
                "final_worst_holdout_acc": acc - 0.1,
                "forgetting": 0.0,
            }
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
    _write_private_cell(root / "ugsa-none-b1", {"bpa+ugsa": [0.7, 0.7, 0.7], "tent+ugsa": [0.6, 0.6, 0.65]})
    c = OmegaConf.merge(cfg, {"bpfedctta": {"stress": {"results": str(root)}}})

    # Act
    text = S.report(c)
    cell = S.load_cell(root / "lr1e-1-p3")

    # Assert
    t = S.paired(cell, "final_avg_holdout_acc", "bpa+ugsa", "tent+sequential")
    from scipy.stats import ttest_rel

    assert t["gap"] == pytest.approx(0.2) and t["wins"] == 3 and t["n"] == 3
    assert t["p"] == pytest.approx(ttest_rel([0.6, 0.7, 0.8], [0.5, 0.5, 0.5]).pvalue)
    assert f"Cells run: 3 of {len(S.cell_names(c))}" in text
    assert "| tent+sequential | +0.200 | 3/3 |" in text
    assert "| tent+sequential | 2 | 6 | +0.100 | 4/6 |" in text, (
        "pooled over the 2 cells x 3 seeds that hold it; the ablation cell, which lacks it, adds no blocks"
    )
    assert "| tent+ugsa | 1 | 3 | +0.083 | 3/3 |" in text, "the ablation cell is pooled where it holds both rows"
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
            summary[f"{key}+s{seed}"] = {
                "final_avg_holdout_acc": a,
                "avg_online_acc": a,
                "final_worst_holdout_acc": a,
                "forgetting": 0.0,
            }
            run = folder / "cells" / f"{key.replace('+', '-')}-s{seed}"  # dp-eps10 keeps its hyphen
            run.mkdir(parents=True)
            (run / "arrivals.csv").write_text("arrival,online_acc\n" + "".join(f"{i},{a}\n" for i in range(3)))
    (folder / "summary.json").write_text(json.dumps(summary))


def test_the_private_report_pairs_plain_with_source_and_each_form_with_plain(cfg, tmp_path):
    # Arrange: tent falls below the source; clip recovers it, DP recovers part
    root = tmp_path / "stress_private"
    _write_private_cell(
        root / "lr1e-1-p3",
        {
            "source+sequential": [0.8, 0.8, 0.8],
            "tent+sequential": [0.5, 0.6, 0.4],
            "tent+sequential+clip": [0.8, 0.85, 0.8],
            "tent+sequential+dp-eps10": [0.6, 0.6, 0.5],
        },
    )
    c = OmegaConf.merge(cfg, {"dptta": {"stress": {"results": str(root)}}})

    # Act
    text = S.report(c, "dptta")
    cell = S.load_cell(root / "lr1e-1-p3")
    curves = S.online_curves(root / "lr1e-1-p3", "dptta")

    # Assert
    assert sorted(S.privacy_pairs(cell)) == [
        ("tent+sequential", "source+sequential"),
        ("tent+sequential+clip", "tent+sequential"),
        ("tent+sequential+dp-eps10", "tent+sequential"),
    ]
    assert "| tent+sequential − source+sequential | -0.300 | 0/3 |" in text
    assert "| tent+sequential+clip − tent+sequential | +0.317 | 3/3 |" in text
    assert "| tent+sequential+dp-eps10 − tent+sequential | +0.067 | 2/3 |" in text
    assert list(curves) == [
        "source+sequential",
        "tent+sequential",
        "tent+sequential+clip",
        "tent+sequential+dp-eps10",
    ], "the sweep's order: method, then form"
    np.testing.assert_allclose(curves["tent+sequential+dp-eps10"].mean(1), [0.6, 0.6, 0.5])
    assert S.report_paths(c, "dptta")[0].name == "stress_private_report.md"
    assert S.plot_cell(root / "lr1e-1-p3", title="t", name="dptta").stat().st_size > 0


def test_a_clip_norm_axis_sorts_by_clip_norm_beside_its_form_and_pairs_with_plain():
    keys = [
        "tent+sequential+dp-eps10",
        "tent+sequential+clip-c15",
        "tent+sequential+clip",
        "tent+sequential",
        "tent+sequential+clip-c5",
        "tent+sequential+clip-c0.3",
        "source+sequential",
        "tent+sequential+dp-eps10-c5",
    ]
    assert sorted(keys, key=lambda k: S._sweep_order(k, "dptta")) == [
        "source+sequential",
        "tent+sequential",
        "tent+sequential+clip-c0.3",
        "tent+sequential+clip",
        "tent+sequential+clip-c5",
        "tent+sequential+clip-c15",
        "tent+sequential+dp-eps10",
        "tent+sequential+dp-eps10-c5",
    ], "numerically (c15 after c5), not as strings"
    assert ("tent+sequential+clip-c5", "tent+sequential") in S.privacy_pairs({k: {} for k in keys})
    beside = ["tent+ugsa+dp-eps3", "tent+ugsa+dp-eps2-c5", "tent+ugsa+dp-eps2"]
    assert sorted(beside, key=lambda k: S._sweep_order(k, "dptta")) == [
        "tent+ugsa+dp-eps2",
        "tent+ugsa+dp-eps2-c5",
        "tent+ugsa+dp-eps3",
    ], "a form beside its own base"


def test_a_cell_listing_one_form_twice_is_refused(cfg):
    c = OmegaConf.create(OmegaConf.to_container(cfg))
    c.dptta.stress.cells["lr1e-3-p3"] = {"lr": 0.001, "passes": 3, "privacy": ["plain", "clip", "clip-c1.0"]}
    with pytest.raises(ValueError, match="stress cell 'lr1e-3-p3': privacy lists 'clip' and 'clip-c1.0'"):
        S.check(c, name="dptta")


def test_a_plain_method_is_paired_with_the_source_run_under_its_own_aggregator():
    cell = {"source+none": {}, "source+ugsa": {}, "tent+ugsa": {}, "tent+ugsa+clip": {}, "tent+fedavg": {}}
    assert sorted(S.privacy_pairs(cell)) == [
        ("tent+fedavg", "source+none"),
        ("tent+fedavg", "source+ugsa"),
        ("tent+ugsa", "source+ugsa"),
        ("tent+ugsa+clip", "tent+ugsa"),
    ]


# ------------------------------------------------------------------------------------ the lr x passes grid
def test_the_grid_is_the_cells_that_set_only_lr_and_passes(cfg):
    from flows.runs import stress_grid as G

    cells = G.grid_cells(cfg)

    assert len(cells) == 12 and cells[(0.1, 3)] == "lr1e-1-p3" and cells[(0.001, 10)] == "lr1e-3-p10"
    assert not {"sorted-lr1e-1-p3", "bs16-lr1e-2-p3", "ugsa-none-b1"} & set(cells.values()), (
        "a stream, batch size or gate setting is not a point of the lr x passes grid"
    )
    assert len(G.grid_cells(cfg, "cifar10")) == 1 and G.grid_cells(cfg, "dptta")


def test_the_grid_tabulates_each_cell_and_maps_its_gap_to_bn_paired_by_seed(cfg, tmp_path):
    # Arrange: two grid cells and one ablation cell ran; tent+sequential collapses at lr 0.1, and at
    # lr 0.01 BN ran seed 2 only, so the gap pairs that seed alone
    from flows.runs import stress_grid as G

    root = tmp_path / "stress"
    _write_private_cell(
        root / "lr1e-1-p3",
        {"bn+none": [0.76, 0.76, 0.76], "tent+sequential": [0.2, 0.6, 0.4], "bpa+ugsa": [0.77, 0.76, 0.75]},
    )
    _write_private_cell(root / "lr1e-2-p1", {"tent+sequential": [0.75, 0.75, 0.74]})
    summary = json.loads((root / "lr1e-2-p1" / "summary.json").read_text())
    summary["bn+none+s2"] = dict(summary["tent+sequential+s2"], final_avg_holdout_acc=0.70)
    (root / "lr1e-2-p1" / "summary.json").write_text(json.dumps(summary))
    _write_private_cell(root / "lr3e-2-p3", {"tent+sequential": [0.7, 0.7, 0.7]})
    _write_private_cell(root / "ugsa-none-b1", {"bn+none": [0.1, 0.1, 0.1], "tent+sequential": [0.1, 0.1, 0.1]})
    c = OmegaConf.merge(cfg, {"bpfedctta": {"stress": {"results": str(root)}}})

    # Act
    data = G.collect(c)
    text = G.write(c)

    # Assert
    assert sorted(data["tent+sequential"]) == [(0.01, 1), (0.03, 3), (0.1, 3)], "the ablation cell is off the grid"
    assert G.gap(data, "tent+sequential", (0.1, 3)) == pytest.approx(-0.36)
    assert G.gap(data, "bpa+ugsa", (0.1, 3)) == pytest.approx(0.0, abs=1e-12)
    assert G.gap(data, "tent+sequential", (0.01, 1)) == pytest.approx(0.04), "seed 2 only: 0.74 - 0.70"
    assert G.gap(data, "tent+sequential", (0.03, 3)) is None, "no reference in that cell"
    assert G.gap(data, "tent+sequential", (0.03, 1)) is None and G.gap(data, "bpa+ugsa", (0.01, 1)) is None
    assert "3 of 12 grid cells ran" in text and "Not run: lr1e-3-p1, lr1e-3-p3" in text
    assert (
        "| 0.1 | 3 | 0.760 ± 0.000 | 0.400 ± 0.163 | not in the cell | not in the cell | not in the cell | "
        "not in the cell | 0.760 ± 0.008 |" in text
    )
    assert "| 0.01 | 1 | 0.700 ± 0.000 | 0.747 ± 0.005 | not in the cell |" in text
    assert "| 0.03 | 10 | not run | not run |" in text
    assert G._label(data, "tent+sequential", (0.03, 3), set(G.ran(c)))[1] == "no bn+none"
    assert G._label(data, "tent+sequential", (0.03, 10), set(G.ran(c)))[1] == "not run"
    md, png = G.paths(c)
    assert md.read_text() == text and md.name == "stress_grid.md" and md.parent == tmp_path
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_grid_is_written_before_any_grid_cell_ran(cfg, tmp_path):
    from flows.runs import stress_grid as G

    _write_private_cell(tmp_path / "stress" / "ugsa-none-b1", {"bn+none": [0.7], "tent+ugsa": [0.6]})
    c = OmegaConf.merge(cfg, {"bpfedctta": {"stress": {"results": str(tmp_path / "stress")}}})

    text = G.write(c)

    assert "0 of 12 grid cells ran" in text and G.paths(c)[1].is_file(), "the stage declares both files"


def test_bad_grid_cells_name_the_fix(cfg):
    from flows.runs import stress_grid as G

    def with_cells(**cells):
        bad = cfg.copy()
        OmegaConf.set_struct(bad, False)
        bad.bpfedctta.stress.cells = cells
        return bad

    with pytest.raises(ValueError, match="'lr1e-2-p3' and 'again' are the same point"):
        G.grid_cells(with_cells(**{"lr1e-2-p3": {"lr": 0.01, "passes": 3}, "again": {"lr": 1e-2, "passes": 3}}))
    with pytest.raises(ValueError, match="cell 'x' sets lr 'fast'; it must be a number"):
        G.grid_cells(with_cells(x={"lr": "fast", "passes": 3}))
    with pytest.raises(ValueError, match=r"cell 'x' sets passes 2.5; it must be a whole number"):
        G.grid_cells(with_cells(x={"lr": 0.1, "passes": 2.5}))
    with pytest.raises(ValueError, match="declares no cell that sets only lr and passes"):
        G.write(with_cells(x={"lr": 0.1, "passes": 3, "stream": "class_sorted"}))
    with pytest.raises(ValueError, match="'dptta' has no lr × passes grid; those that do: bpfedctta"):
        G.write(cfg, "dptta")


def test_the_report_stage_draws_the_grid_only_for_the_protocols_that_declare_one(cfg, tmp_path):
    from flows.stages import stress_report as _stress_report

    for block, system, name, cell in (
        ("stress", "bpfedctta", "bpfedctta", "lr1e-1-p3"),
        ("stress_cifar", "bpfedctta", "cifar10", "lr1e-1-p1"),
        ("stress", "dptta", "dptta", "lr1e-1-p3"),
    ):
        root = tmp_path / system / block
        _write_cell(root / cell, [0.1, 0.2, 0.3])
        _stress_report(OmegaConf.merge(cfg, {system: {block: {"results": str(root)}}}), name)

    assert (tmp_path / "bpfedctta" / "stress_grid.png").is_file()
    assert (tmp_path / "bpfedctta" / "stress_grid.md").is_file()
    assert (tmp_path / "bpfedctta" / "stress_cifar_report.md").is_file()
    assert not list(tmp_path.rglob("stress_cifar_grid.*")), "the CIFAR report stage declares no grid"
    assert (tmp_path / "dptta" / "stress_report.md").is_file() and not list((tmp_path / "dptta").glob("*grid*"))
