"""The CIFAR-10-C variant's config and stages (composition only; no CIFAR data needed)."""

import pytest

from flows import config as C
from flows import federation as F
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


def test_cifar_stages_name_their_own_stage_when_prepared_data_is_missing(tmp_path, capsys):
    over = ["variant=cifar10", f"{PATHS}.prepared={tmp_path}/p", f"{PATHS}.partitions={tmp_path}/q"]
    assert main(["partition", *over]) == 2
    assert "dvc repro prepare@cifar10` (or `python -m flows.stages prepare variant=cifar10`)" in capsys.readouterr().err


def test_cifar_stages_name_their_own_stage_when_partitions_are_missing(tmp_path, capsys):
    over = ["variant=cifar10", f"{PATHS}.partitions={tmp_path}/q", f"{PATHS}.models={tmp_path}/m"]
    assert main(["adapt", *over]) == 2
    assert "dvc repro partition@cifar10`" in capsys.readouterr().err


def test_missing_cifar_files_name_what_to_do(tmp_path, capsys):
    assert main(["prepare", "variant=cifar10", f"paths.data_root={tmp_path}", f"{PATHS}.prepared={tmp_path}/p"]) == 2
    err = capsys.readouterr().err
    assert "cifar10-jpeg.zip" in err
    assert "cifar-10-batches-py" in err


def test_a_cifar_stress_cell_names_the_cifar_stage_when_partitions_are_missing(tmp_path, capsys):
    over = ["bpfedctta.stress_cifar.cell=lr1e-1-p1", f"{PATHS}.partitions={tmp_path}/q"]
    assert main(["stress_cifar", *over]) == 2
    assert "dvc repro partition@cifar10`" in capsys.readouterr().err
