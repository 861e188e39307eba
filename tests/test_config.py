"""The real Hydra config, composed with tiny overrides; every group option instantiates."""

import pytest
from omegaconf import OmegaConf

from flows import config as C
from flows.params import check_stage_keys, render


@pytest.mark.parametrize("group,option", [(g, p.stem) for g in ("data", "model", "method", "aggregator", "flow")
                                          for p in sorted((C.CONF_DIR / g).glob("*.yaml"))])
def test_every_group_option_composes_and_builds(group, option):
    cfg = C.compose([f"{group}={option}"])
    C.model_spec(cfg).build()
    assert C.arrival_config(cfg).method == cfg.method.name


PAIRS = {"sgd": "fedavg", "prox": "fedavg", "scaffold": "scaffold", "feddyn": "feddyn", "proto": "fedpad",
         "proser": "fedpd", "fcil": "ppfcil"}


@pytest.mark.parametrize("group,option", [(g, p.stem) for g in ("trainer", "strategy")
                                          for p in sorted((C.CONF_DIR / g).glob("*.yaml"))])
def test_every_round_group_option_builds_a_round_config(group, option):
    """Each trainer with a strategy written for it, and each strategy with a trainer it takes."""
    trainer = option if group == "trainer" else {"fedavg": "sgd", "fedadam": "sgd", "scaffold": "scaffold",
                                                 "feddyn": "feddyn", "fedproto": "proto", "fedpad": "proto",
                                                 "fedpd": "proser", "ppfcil": "fcil"}[option]
    strategy = PAIRS[option] if group == "trainer" else option
    cfg = C.compose([f"trainer={trainer}", f"strategy={strategy}"])
    rcfg = C.single_round_config(cfg, "fedpad")
    assert (rcfg.trainer, rcfg.strategy) == (trainer, strategy)
    rcfg.make_trainer(), rcfg.make_strategy()


@pytest.mark.parametrize("system", C.ROUND_SYSTEMS)
def test_every_round_system_grid_and_method_builds(system):
    cfg = C.compose([])
    for name, g in cfg[system].grids.items():
        for m in g.methods:
            C.round_config(cfg, system, method=str(m), seed=0, grid_name=str(name))


def test_params_yaml_is_conf_composed():
    assert C.PARAMS.read_text() == render(), "params.yaml is stale: run `make params`"


def test_a_stage_key_with_a_dot_is_refused_by_make_params():
    """DVC splits ``dptta.stress.cells.<key>`` at every dot, so such a cell only failed when run."""
    dvc_yaml = (C.ROOT / "dvc.yaml").read_text()
    cfg = C.compose([])
    check_stage_keys(cfg, dvc_yaml)
    OmegaConf.set_struct(cfg, False)
    cfg.dptta.stress.cells["dp-c0.1"] = {"lr": 0.01}
    with pytest.raises(ValueError, match=r"dptta.stress.cells has keys with a dot: \['dp-c0.1'\].*stress_private"):
        check_stage_keys(cfg, dvc_yaml)


def test_params_file_and_overrides_agree():
    a = C.load(C.PARAMS, ["method.params.lr=0.02"])
    b = C.compose(["method.params.lr=0.02"])
    assert OmegaConf.to_container(a) == OmegaConf.to_container(b)


def test_sweep_cell_takes_group_defaults():
    cfg = C.compose([])
    acfg = C.arrival_config(cfg, method="tent", aggregator="none", seed=4)
    assert (acfg.method, acfg.aggregator, acfg.seed) == ("tent", "none", 4)
    assert acfg.method_params["lr"] == 0.01


@pytest.mark.parametrize("override,match", [
    ("method=cotta", "Could not find 'method/cotta'"),
    ("aggregator.params.gamma=-1", "gamma must be >= 0"),
    ("aggregator.params.beta=-1", "beta must be >= 0"),
    ("method.params.lr=-0.1", "lr must be > 0"),
    ("data.severity=7", "severity must be in 1..5"),
    ("data.stream_order=sorted", "valid values are: shuffled, class_sorted"),
    ("data.corruptions=[a,b,c,d,e,f,g,h,i,j,k,l,m,n,o,p]", "only 15 corruption domains"),
])
def test_invalid_values_are_rejected(override, match):
    with pytest.raises(Exception, match=match):
        C.compose([override])


def test_unknown_sweep_cell_lists_valid_names():
    with pytest.raises(ValueError, match="valid names are: bn, bpa, come, deyo, eata, sar, source, tent"):
        C.arrival_config(C.compose([]), method="cotta")
