"""The variants (conf/experiment/bpfedctta.yaml, dptta.yaml) and the DVC stages that run them.

The expected values are literals: what the default config, ``cifar_experiment(cfg)`` and
``private_grid(cfg)`` resolved to when the variants were Python overlays in flows/config/compose.py.
"""

from functools import lru_cache

import pytest
from omegaconf import OmegaConf

from flows.config import compose as C
from flows.stages import main

DEFAULT = {
    "seed": 0,
    "device": "cpu",
    "paths": {
        "data_root": "../shared/data",
        "prepared": "data/prepared",
        "partitions": "data/partitions",
        "models": "models",
        "results": "results",
        "checkpoints": "checkpoints",
        "domains": "data/domains",
    },
    "data": {
        "name": "mnist5k",
        "in_channels": 1,
        "num_classes": 10,
        "num_source_clients": 5,
        "dirichlet_alpha": 0.5,
        "source_fraction": 0.5,
        "source_test_fraction": 0.15,
        "holdout_fraction": 0.3,
        "official_train_size": None,
        "corruptions": [
            "gaussian_noise",
            "shot_noise",
            "impulse_noise",
            "defocus_blur",
            "glass_blur",
            "motion_blur",
            "zoom_blur",
            "snow",
            "frost",
            "fog",
        ],
        "severity": 3,
        "stream_size": 1000,
        "holdout_size": 200,
        "stream_order": "shuffled",
    },
    "model": {"name": "cnn", "norm": "batch"},
    "method": {
        "name": "bpa",
        "params": {
            "optimizer": "sgd",
            "lr": 0.01,
            "momentum": 0.9,
            "steps": 1,
            "adapt_params": "norm",
            "sigma0": 1.0,
            "precision_mode": "confidence",
        },
    },
    "aggregator": {"name": "ugsa", "params": {"gamma": 0.5, "beta": 0.2, "normalizer": "history"}},
    "privacy": {"mode": "off"},
    "trainer": {"name": "sgd", "params": {}},
    "strategy": {"name": "fedavg", "params": {"weighting": "examples"}},
    "flow": {
        "ray_address": None,
        "num_cpus": 2,
        "gpus_per_task": 1,
        "tracking_uri": None,
        "experiment": "fedcore",
        "register_model": None,
        "register": "configured",
        "champion_metric": "final_avg_holdout_acc",
        "aliases": [],
        "retries": 2,
        "retry_delay_seconds": 1,
        "resume": False,
        "stop_after": None,
        "inject_fault": None,
        "inject_crash": None,
        "progress": True,
        "arrival_runs": "at_end",
    },
    "pretrain": {
        "rounds": 20,
        "local_epochs": 1,
        "lr": 0.05,
        "batch_size": 64,
        "momentum": 0.9,
        "weight_decay": 0.0005,
        "augment": False,
        "lr_schedule": "constant",
        "channels_last": False,
    },
    "adapt": {"passes": 3, "batch_size": 64, "order": None, "stream": "shuffled"},
    "sweep": {
        "methods": ["source", "bn", "tent", "bpa"],
        "aggregators": ["none", "sequential", "fedavg", "ugsa"],
        "privacy": ["plain"],
        "noise_source": None,
        "seeds": [0],
        "method_params": {},
        "aggregator_params": {},
    },
    "audit": {
        "client": 0,
        "epsilons": [1, 5, 10, 20],
        "trials": 200,
        "stream_size": 4,
        "confidence": 0.95,
        "lr": 0.1,
        "noise_source": "seeded",
    },
}
CIFAR10 = {
    **DEFAULT,
    "paths": {
        "data_root": "../shared/data",
        "prepared": "data/cifar10/prepared",
        "partitions": "data/cifar10/partitions",
        "models": "models_cifar",
        "results": "results/cifar10",
        "checkpoints": "checkpoints",
        "domains": "data/domains",
    },
    "data": {
        "name": "cifar10",
        "in_channels": 3,
        "num_classes": 10,
        "num_source_clients": 1,
        "dirichlet_alpha": 0.5,
        "source_fraction": 0.5,
        "source_test_fraction": 0.04,
        "holdout_fraction": 0.3,
        "official_train_size": 50000,
        "corruptions": [
            "gaussian_noise",
            "shot_noise",
            "impulse_noise",
            "defocus_blur",
            "glass_blur",
            "motion_blur",
            "zoom_blur",
            "snow",
            "frost",
            "fog",
        ],
        "severity": 5,
        "stream_size": 2000,
        "holdout_size": 500,
        "stream_order": "shuffled",
    },
    "model": {"name": "resnet20", "norm": "batch"},
    "flow": {
        "ray_address": None,
        "num_cpus": 2,
        "gpus_per_task": 1,
        "tracking_uri": None,
        "experiment": "fedcore-cifar10",
        "register_model": None,
        "register": "configured",
        "champion_metric": "final_avg_holdout_acc",
        "aliases": [],
        "retries": 2,
        "retry_delay_seconds": 1,
        "resume": False,
        "stop_after": None,
        "inject_fault": None,
        "inject_crash": None,
        "progress": True,
        "arrival_runs": "at_end",
    },
    "pretrain": {
        "rounds": 10,
        "local_epochs": 2,
        "lr": 0.1,
        "batch_size": 64,
        "momentum": 0.9,
        "weight_decay": 0.0005,
        "augment": "sample",
        "lr_schedule": "cosine",
        "channels_last": True,
    },
    "adapt": {"passes": 1, "batch_size": 64, "order": None, "stream": "shuffled"},
    "sweep": {**DEFAULT["sweep"], "seeds": [0, 1, 2]},
}
PRIVATE = {
    **DEFAULT,
    "paths": {
        "data_root": "../shared/data",
        "prepared": "data/prepared",
        "partitions": "data/partitions",
        "models": "models_group",
        "results": "results/private",
        "checkpoints": "checkpoints",
        "domains": "data/domains",
    },
    "model": {"name": "cnn", "norm": "group"},
    "pretrain": {
        "rounds": 20,
        "local_epochs": 3,
        "lr": 0.05,
        "batch_size": 64,
        "momentum": 0.9,
        "weight_decay": 0.0005,
        "augment": False,
        "lr_schedule": "constant",
        "channels_last": False,
    },
    "sweep": {
        "methods": ["source", "tent", "eata", "sar", "deyo", "come", "bpa"],
        "aggregators": ["ugsa"],
        "privacy": ["plain", "clip", "dp0", "dp-eps1", "dp-eps5", "dp-eps10", "dp-eps20"],
        "noise_source": "seeded",
        "seeds": [0],
        "method_params": {},
        "aggregator_params": {},
    },
}

EXPECTED = {"mnist": DEFAULT, "cifar10": CIFAR10, "private": PRIVATE}


@lru_cache(maxsize=None)
def resolved(source: str, variant: str) -> dict:
    """The config a stage of ``variant`` runs with, from conf/ (Hydra) or from params.yaml (DVC)."""
    over = [f"variant={variant}"]
    d = C.to_dict(C.compose(over) if source == "conf" else C.load(C.PARAMS, over))
    return {**d, "audit": d["dptta"]["audit"]}


@pytest.mark.parametrize("source", ["conf", "params.yaml"])
@pytest.mark.parametrize("variant,block", [(v, b) for v in EXPECTED for b in DEFAULT])
def test_each_variant_resolves_to_the_values_its_stages_ran_with(source, variant, block):
    assert resolved(source, variant)[block] == EXPECTED[variant][block]


def test_the_default_variant_is_the_root_config():
    assert C.compose([]).variant == "mnist"


def test_params_yaml_holds_the_root_config_without_a_variant_laid_over():
    assert C.compose(["variant=cifar10"], lay_variant=False).data.name == "mnist5k"


def test_laying_a_variant_over_leaves_the_config_as_it_was():
    base = C.compose([])
    C.with_variant(base, "cifar10")
    assert base.data.name == "mnist5k"


@pytest.mark.parametrize("source", ["conf", "params.yaml"])
def test_unknown_variant_lists_the_valid_ones(source):
    with pytest.raises(ValueError, match="unknown variant 'cifar'; valid names are: cifar10, mnist, private"):
        C.compose(["variant=cifar"]) if source == "conf" else C.load(C.PARAMS, ["variant=cifar"])


def test_unknown_variant_on_the_command_line(capsys):
    assert main(["adapt", "variant=cifar"]) == 2
    assert "valid names are: cifar10, mnist, private" in capsys.readouterr().err


def _params_with(dotlist):
    cfg = OmegaConf.load(C.PARAMS)
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotlist))


def test_a_variant_key_the_root_lacks_is_named():
    cfg = _params_with(["bpfedctta.variants.cifar10.pretrain.rouns=4"])
    with pytest.raises(ValueError, match=r"variant 'cifar10' .* sets pretrain\.rouns, which the root config does not"):
        C.validate(cfg)


def test_a_variant_without_a_block_dvc_tracks_says_how_to_keep_the_roots():
    cfg = _params_with([])
    del cfg.dptta.variants.private["data"]
    with pytest.raises(ValueError, match=r"variant 'private' .* lacks data: .* write e\.g\. `data: \{\}`"):
        C.validate(cfg)


def test_a_variant_name_two_systems_define_is_refused():
    cfg = _params_with([])
    cfg.dptta.variants.mnist = cfg.bpfedctta.variants.mnist
    with pytest.raises(ValueError, match="variant 'mnist' is defined by both bpfedctta and dptta"):
        C.validate(cfg)


def test_a_bad_value_in_a_variant_fails_before_any_stage():
    with pytest.raises(ValueError, match="only dp takes -eps"):
        C.compose(["dptta.variants.private.sweep.privacy=[clip-eps5]"])
    with pytest.raises(ValueError, match="sweep.noise_source='seedless'; valid values are: secure, seeded"):
        C.compose(["dptta.variants.private.sweep.noise_source=seedless"])


@pytest.mark.parametrize("source", ["conf", "params.yaml"])
def test_the_research_grid_draws_seeded_noise_and_a_plain_dp_run_secure_noise(source):
    """DVC reruns the private grid bit for bit, so its dp cells are seeded; a dp run outside a grid is secure."""
    over = ["variant=private"]
    cfg = C.compose(over) if source == "conf" else C.load(C.PARAMS, over)
    assert C.privacy_form(cfg, "dp-eps5")["noise_source"] == "seeded"
    assert C.arrival_config(cfg, method="tent", form="dp-eps1").privacy_config().noise_source == "seeded"
    assert "noise_source" not in C.privacy_form(cfg, "clip")
    assert C.arrival_config(C.compose(["privacy=dp"])).privacy_config().noise_source == "secure"
    assert C.privacy_form(C.compose([]), "dp-eps5")["noise_source"] == "secure"


def test_the_audit_refuses_a_variant_without_a_private_model(capsys):
    assert main(["audit", "variant=mnist"]) == 2
    assert "add variant=<private>" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ dvc.yaml
@pytest.fixture(scope="module")
def dvc_stages():
    """The stages DVC builds from dvc.yaml and params.yaml (foreach expanded), by name."""
    from dvc.repo import Repo

    with Repo(str(C.ROOT)) as repo:
        return {s.addressing: s for s in repo.index.stages}


STEP_STAGES = [(step, v) for step in ("prepare", "partition", "pretrain", "adapt") for v in ("mnist", "cifar10")]
STEP_STAGES += [("pretrain", "private")]


@pytest.mark.parametrize("step,variant", STEP_STAGES)
def test_each_variant_step_runs_on_params_yaml(dvc_stages, step, variant):
    assert (
        dvc_stages[f"{step}@{variant}"].cmd == f"python -m flows.stages {step} --params params.yaml variant={variant}"
    )


OUTPUT_PATH = {"prepare": "prepared", "partition": "partitions", "pretrain": "models", "adapt": "results"}


@pytest.mark.parametrize("step,variant", STEP_STAGES)
def test_each_variant_stage_declares_the_folder_its_config_writes(dvc_stages, step, variant):
    outs = [o.def_path for o in dvc_stages[f"{step}@{variant}"].outs]
    written = str(C.compose([f"variant={variant}"]).paths[OUTPUT_PATH[step]])
    assert outs[0] == (f"{written}/cells" if step == "adapt" else written)


@pytest.mark.parametrize("stage,variant", [("private", "private"), ("audit", "private")])
def test_the_private_stages_run_the_private_variant(dvc_stages, stage, variant):
    assert dvc_stages[stage].cmd.endswith(f"--params params.yaml variant={variant}")


@pytest.mark.parametrize("stage,out", [("private", "cells"), ("audit", "audit.json")])
def test_the_private_stages_declare_outputs_under_the_private_variants_results(dvc_stages, stage, out):
    results = C.compose(["variant=private"]).paths.results
    assert f"{results}/{out}" in [o.def_path for o in dvc_stages[stage].outs]


@pytest.mark.parametrize(
    "variant,step,stage",
    [
        ("mnist", "prepare", "prepare@mnist"),
        ("mnist", "partition", "partition@mnist"),
        ("mnist", "pretrain", "pretrain@mnist"),
        ("cifar10", "prepare", "prepare@cifar10"),
        ("cifar10", "partition", "partition@cifar10"),
        ("cifar10", "pretrain", "pretrain@cifar10"),
        ("private", "prepare", "prepare@mnist"),
        ("private", "partition", "partition@mnist"),
        ("private", "pretrain", "pretrain@private"),
    ],
)
def test_a_missing_input_is_built_by_the_stage_that_writes_it(variant, step, stage):
    from flows.runs.tasks import build_hint

    cfg = C.compose([f"variant={variant}"])
    name = stage.split("@")[1]
    assert build_hint(cfg, step) == f"`dvc repro {stage}` (or `python -m flows.stages {step} variant={name}`)"


def test_the_private_variant_names_the_default_partition_stage_when_its_partitions_are_missing(tmp_path, capsys):
    # its partitions are partition@mnist's: that stage writes them
    over = ["variant=private", f"dptta.variants.private.paths.models={tmp_path}/m"]
    from flows.runs.tasks import build_hint

    assert build_hint(C.compose(over), "partition").startswith("`dvc repro partition@mnist`")
    # partitions moved elsewhere: no stage writes them, and the advice says so rather than name one that would not
    over.append(f"paths.partitions={tmp_path}/q")
    assert main(["pretrain", *over]) == 2
    err = capsys.readouterr().err
    assert "`python -m flows.stages partition` with this run's data, seed and paths settings" in err
    assert "partition@mnist`" not in err


def test_a_form_names_its_clip_norm_and_a_run_names_it_back():
    """The paper cross-validates C: ``-c<C>`` sets it on any form that clips; C = 1 stays unnamed."""
    cfg = C.compose(["variant=private"])
    assert C.privacy_form(cfg, "clip-c5")["clip_norm"] == 5.0 and C.privacy_form(cfg, "clip")["clip_norm"] == 1.0
    dp = C.privacy_form(cfg, "dp-eps10-c0.5")
    assert (dp["mode"], dp["epsilon"], dp["clip_norm"], dp["noise_multiplier"]) == ("dp", 10.0, 0.5, None)
    for form, name in [
        ("clip-c5", "clip-c5"),
        ("clip-c0.3", "clip-c0.3"),
        ("dp0-c5", "dp0-c5"),
        ("dp-eps10-c0.5", "dp-eps10-c0.5"),
        ("clip-c1", "clip"),
        ("clip", "clip"),
        ("plain", "plain"),
    ]:
        assert C.arrival_config(cfg, method="tent", form=form).form == name, form


@pytest.mark.parametrize(
    "form, match",
    [
        ("plain-c5", "plain does not clip"),
        ("clip-x3", "cannot read 'x3'"),
        ("dp-c1-c2", "cannot read 'c2'"),
        ("clip-cfive", "'five' is not a number"),
        ("clip-eps5", "only dp takes -eps"),
        ("clip-c-1", "cannot be negative"),
        ("dp-sigma2", "privacy.noise_multiplier"),
        ("clip-c0", "form 'clip-c0': clip norm C must be a finite number > 0"),
    ],
)
def test_a_bad_clip_norm_in_a_form_names_the_grammar(form, match):
    with pytest.raises(ValueError, match=match):
        C.compose([f"dptta.variants.private.sweep.privacy=[plain,{form}]"])


@pytest.mark.parametrize(
    "forms, match",
    [
        ("[plain,clip,clip-c1]", "lists 'clip' and 'clip-c1', which both run as 'clip'"),
        ("[clip-c5,clip-c5.0]", "lists 'clip-c5' and 'clip-c5.0', which both run as 'clip-c5'"),
        ("[clip-c0.1234567,clip-c0.1234568]", "both run as 'clip-c0.123457'"),
        ("[dp-eps10-c0.5,dp-c0.5-eps10]", "both run as 'dp-eps10-c0.5'"),
    ],
)
def test_two_forms_that_run_under_one_name_are_refused(forms, match):
    with pytest.raises(ValueError, match=match):
        C.compose([f"dptta.variants.private.sweep.privacy={forms}"])


def test_a_bare_form_takes_the_configured_groups_settings_and_its_run_says_so():
    """``privacy=clip privacy.clip_norm=5``: the sweep's ``clip`` runs at C = 5, named ``clip-c5``."""
    cfg = C.compose(["privacy=clip", "privacy.clip_norm=5"])
    assert C.arrival_config(cfg, method="tent", form="clip").form == "clip-c5"
    assert C.arrival_config(cfg, method="tent", form="clip-c1").form == "clip"
    with pytest.raises(ValueError, match="lists 'clip' and 'clip-c5', which both run as 'clip-c5'"):
        C.compose(["privacy=clip", "privacy.clip_norm=5", "sweep.privacy=[clip,clip-c5]"])


@pytest.mark.parametrize("form", ["dp-eps1e-05", "clip-c5e-05", "dp-eps1e-05-c2.5e-03", "dp-eps0.3-c15"])
def test_every_run_name_reads_back_as_its_own_setting(form):
    cfg = C.compose(["variant=private"])
    name = C.arrival_config(cfg, method="tent", form=form).form
    assert C.privacy_form(cfg, name) == C.privacy_form(cfg, form), (form, name)
