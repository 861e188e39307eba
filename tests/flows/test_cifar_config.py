"""The CIFAR-10-C variant's config and stages (composition only; no CIFAR data needed)."""

import pytest

from flows.config import compose as C
from flows.runs import federation as F
from flows.stages import main

PATHS = "bpfedctta.variants.cifar10.paths"


@pytest.fixture(scope="module")
def base():
    return C.compose([])


@pytest.fixture(scope="module")
def cifar():
    return C.compose(["variant=cifar10"])


def test_cifar_variant_selects_cifar10(cifar):
    assert cifar.data.name == "cifar10"


def test_cifar_variant_selects_resnet20(cifar):
    assert cifar.model.name == "resnet20"


def test_cifar_variant_keeps_the_roots_norm(base, cifar):
    assert cifar.model.norm == base.model.norm


def test_cifar_variant_runs_at_severity_5(cifar):
    assert cifar.data.severity == 5


def test_cifar_variant_runs_the_seed_papers_10_corruptions(cifar):
    assert len(cifar.data.corruptions) == 10


@pytest.mark.parametrize(
    "where",
    [
        lambda cfg: F.prepared_path(cfg).parent,
        lambda cfg: F.partition_dir(cfg).parent,
        lambda cfg: F.source_model_path(cfg).parent,
        lambda cfg: C.resolve_path(cfg.paths.results),
    ],
    ids=["prepared", "partitions", "models", "results"],
)
def test_nothing_it_writes_lands_where_the_default_variants_outputs_are(base, cifar, where):
    assert where(cifar) != where(base)


def test_cifar_stages_name_their_own_stage_when_prepared_data_is_missing(cifar, tmp_path, capsys):
    from flows.runs.tasks import build_hint

    assert (
        build_hint(cifar, "prepare")
        == "`dvc repro prepare@cifar10` (or `python -m flows.stages prepare variant=cifar10`)"
    )
    # the variant's data moved elsewhere: no stage writes it there, and the advice says so
    over = ["variant=cifar10", f"{PATHS}.prepared={tmp_path}/p", f"{PATHS}.partitions={tmp_path}/q"]
    assert main(["partition", *over]) == 2
    err = capsys.readouterr().err
    assert "`python -m flows.stages prepare` with this run's data and paths settings; no DVC stage" in err
    assert "prepare@mnist`" not in err and "prepare@cifar10`" not in err


def test_cifar_stages_name_their_own_stage_when_partitions_are_missing(cifar, tmp_path, capsys):
    from flows.runs.tasks import build_hint

    assert build_hint(cifar, "partition").startswith("`dvc repro partition@cifar10` (or `python -m flows")
    over = ["variant=cifar10", f"{PATHS}.partitions={tmp_path}/q", f"{PATHS}.models={tmp_path}/m"]
    assert main(["adapt", *over]) == 2
    assert "no DVC stage writes this file (each variant's: `dvc repro partition@<variant>`)" in capsys.readouterr().err


def test_missing_cifar_files_name_what_to_do(tmp_path, capsys):
    assert main(["prepare", "variant=cifar10", f"paths.data_root={tmp_path}", f"{PATHS}.prepared={tmp_path}/p"]) == 2
    err = capsys.readouterr().err
    assert "cifar10-jpeg.zip" in err
    assert "cifar-10-batches-py" in err


def test_a_cifar_stress_cell_names_the_cifar_stage_when_partitions_are_missing(base):
    from flows.runs.stress import cell_config
    from flows.runs.tasks import build_hint

    # a cell runs the root config with its cell laid over the CIFAR variant: its inputs are that variant's
    cell = cell_config(base, "lr1e-1-p1", "cifar10")
    assert build_hint(cell, "partition").startswith("`dvc repro partition@cifar10`")
