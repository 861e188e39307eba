"""The command line names the fix for bad input, and nothing is half-written."""

import pytest
import torch

from flows.config import compose as C
from flows.runs import federation as F
from flows.runs import tasks as T
from flows.stages import main


def test_unknown_method_on_the_command_line(capsys):
    assert main(["arrival", "method=cotta"]) == 2
    err = capsys.readouterr().err
    assert "method/cotta" in err and "bpa" in err


def test_impossible_value_on_the_command_line(capsys):
    assert main(["arrival", "aggregator.params.gamma=-1"]) == 2
    assert "gamma must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["privacy=dp", "privacy.epsilon=0"], "epsilon must be a finite number > 0"),
        (["privacy=dp", "privacy.delta=1.5"], "delta must lie strictly between 0 and 1"),
        (["privacy=dp", "privacy.clip_norm=-1"], "clip norm C must be a finite number > 0"),
        (["privacy=dp", "privacy.noise_multiplier=-0.1"], "sigma must be >= 0"),
        (["privacy=dp", "method=bn"], "private forms exist for: bpa, come, deyo, eata, sar, tent"),
        (["privacy=nonsense"], "privacy/nonsense"),
        (["sweep.privacy=[plain,dp-epsfive]"], "is not a number"),
        (["sweep.privacy=[clip-eps5]"], "only dp takes -eps"),
    ],
)
def test_impossible_privacy_settings_on_the_command_line(overrides, message, capsys):
    assert main(["sweep", *overrides, "data=digits", "paths.partitions=/nonexistent"]) == 2
    assert message in capsys.readouterr().err


def test_missing_prepared_data_names_the_command_that_writes_that_very_file(tmp_path, capsys):
    # the default variant's file: its stage
    assert main(["partition", f"paths.prepared={tmp_path}/prepared", f"paths.partitions={tmp_path}/p"]) == 2
    err = capsys.readouterr().err
    assert "`dvc repro prepare@mnist` (or `python -m flows.stages prepare variant=mnist`)" not in err
    # (the default's paths are data/prepared; a file elsewhere is no stage's)
    assert "`python -m flows.stages prepare` with this run's data and paths settings; no DVC stage" in err
    assert T.build_hint(C.compose([]), "prepare") == (
        "`dvc repro prepare@mnist` (or `python -m flows.stages prepare variant=mnist`)"
    )
    assert T.build_hint(C.compose(["variant=cifar10"]), "partition").startswith("`dvc repro partition@cifar10`")


def test_missing_params_file_names_the_fix(tmp_path, capsys):
    assert main(["prepare", "--params", str(tmp_path / "params.yaml")]) == 2
    assert "make params" in capsys.readouterr().err


def test_corrupt_or_mismatched_source_model_is_refused(tiny, tmp_path):
    bad = tmp_path / "source.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="dvc repro pretrain"):
        F.load_source(bad, tiny["spec"])
    other = tmp_path / "other.pt"
    torch.save({"state": tiny["source"], "spec": {"name": "resnet20"}}, other)
    with pytest.raises(ValueError, match="was trained for"):
        F.load_source(other, tiny["spec"])
    with pytest.raises(FileNotFoundError, match="dvc repro pretrain"):
        F.load_source(tmp_path / "missing.pt", tiny["spec"])


def test_a_missing_source_model_names_the_stage_that_writes_that_file(tmp_path):
    # the private variant's GroupNorm model is pretrain@private's output ...
    private = C.compose(["variant=private", f"paths.partitions={tmp_path}"])
    assert T.source_model_hint(private).startswith("`dvc repro pretrain@private`")
    # ... but a GroupNorm model in the root's folder is no stage's, so pretrain@mnist would be the wrong advice
    hint = T.source_model_hint(C.compose(["model.norm=group"]))
    assert "no DVC stage writes this file" in hint and "variant=private" in hint and "pretrain@mnist" not in hint
    assert T.source_model_hint(C.compose([])).startswith("`dvc repro pretrain@mnist`")
