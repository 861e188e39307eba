"""The CIFAR-10-C experiment's config and stages (composition only; no CIFAR data needed)."""

import pytest

from flows import config as C
from flows import federation as F
from flows.stages import main


def test_cifar_block_selects_cifar10_resnet20_and_its_own_paths():
    base = C.compose([])
    cfg = C.cifar_experiment(base)
    assert (cfg.data.name, cfg.model.name, cfg.model.norm) == ("cifar10", "resnet20", base.model.norm)
    assert cfg.data.severity == 5 and len(cfg.data.corruptions) == 10
    assert cfg.pretrain.rounds == base.cifar.rounds and cfg.adapt.passes == base.cifar.passes
    assert cfg.flow.experiment == base.cifar.experiment
    # nothing it writes lands where the default experiment's DVC outputs are
    assert F.prepared_path(cfg).parent != F.prepared_path(base).parent
    assert not str(F.partition_dir(cfg)).startswith(str(F.partition_dir(base).parent) + "/")
    assert F.source_model_path(cfg).parent != F.source_model_path(base).parent
    assert C.resolve_path(cfg.paths.results) != C.resolve_path(base.paths.results)
    assert base.data.name == "mnist5k"  # the base config is left as it was


def test_cifar_stages_name_their_own_stage_when_inputs_are_missing(tmp_path, capsys):
    over = [f"cifar.prepared={tmp_path}/p", f"cifar.partitions={tmp_path}/q", f"cifar.models={tmp_path}/m"]
    assert main(["partition_cifar", *over]) == 2
    assert "dvc repro prepare_cifar`" in capsys.readouterr().err
    assert main(["adapt_cifar", *over]) == 2
    assert "dvc repro partition_cifar`" in capsys.readouterr().err


def test_missing_cifar_files_name_what_to_do(tmp_path, capsys):
    assert main(["prepare_cifar", f"paths.data_root={tmp_path}", f"cifar.prepared={tmp_path}/p"]) == 2
    err = capsys.readouterr().err
    assert "cifar10-jpeg.zip" in err and "cifar-10-batches-py" in err


@pytest.mark.parametrize("stage", ["prepare_cifar", "partition_cifar", "pretrain_cifar", "adapt_cifar"])
def test_every_cifar_stage_is_in_the_dvc_pipeline(stage):
    import yaml

    stages = yaml.safe_load((C.ROOT / "dvc.yaml").read_text())["stages"]
    assert stages[stage]["cmd"] == f"python -m flows.stages {stage} --params params.yaml"
