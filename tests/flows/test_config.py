"""The real Hydra config, composed with tiny overrides; every group option instantiates."""

import pytest
from omegaconf import OmegaConf, open_dict

from flows.config import compose as C
from flows.config.params import check_stage_keys, render


@pytest.mark.parametrize(
    "group,option",
    [
        (g, p.stem)
        for g in ("data", "model", "method", "aggregator", "flow")
        for p in sorted((C.CONF_DIR / g).glob("*.yaml"))
    ],
)
def test_every_group_option_composes_and_builds(group, option):
    cfg = C.compose([f"{group}={option}"])
    C.model_spec(cfg).build()
    assert C.arrival_config(cfg).method == cfg.method.name


PAIRS = {
    "sgd": "fedavg",
    "prox": "fedavg",
    "scaffold": "scaffold",
    "feddyn": "feddyn",
    "proto": "fedpad",
    "proser": "fedpd",
    "fcil": "ppfcil",
}


@pytest.mark.parametrize(
    "group,option", [(g, p.stem) for g in ("trainer", "strategy") for p in sorted((C.CONF_DIR / g).glob("*.yaml"))]
)
def test_every_round_group_option_builds_a_round_config(group, option):
    """Each trainer with a strategy written for it, and each strategy with a trainer it takes."""
    trainer = (
        option
        if group == "trainer"
        else {
            "fedavg": "sgd",
            "fedadam": "sgd",
            "scaffold": "scaffold",
            "feddyn": "feddyn",
            "fedproto": "proto",
            "fedpad": "proto",
            "fedpd": "proser",
            "ppfcil": "fcil",
        }[option]
    )
    strategy = PAIRS[option] if group == "trainer" else option
    cfg = C.compose([f"trainer={trainer}", f"strategy={strategy}"])
    rcfg = C.single_round_config(cfg, "fedpad")
    assert (rcfg.trainer, rcfg.strategy) == (trainer, strategy)
    rcfg.make_trainer(), rcfg.make_strategy()


@pytest.mark.parametrize("system", C.round_systems())
def test_every_round_system_grid_and_method_builds(system):
    cfg = C.compose([])
    for name, g in cfg[system].grids.items():
        for m in g.methods:
            C.round_config(cfg, system, method=str(m), seed=0, grid_name=str(name))


def _group_files():
    """(file, kind, the component it configures, its settings) for every conf/ group file with settings, and
    the pretraining block (the sgd trainer's)."""
    import yaml

    for kind in ("trainer", "strategy", "aggregator", "method"):
        for path in sorted((C.CONF_DIR / kind).glob("*.yaml")):
            raw = yaml.safe_load(path.read_text())
            yield path.name, kind, raw["name"], raw.get("params") or {}
    for path in sorted((C.CONF_DIR / "privacy").glob("*.yaml")):
        yield path.name, "privacy", None, {k: v for k, v in yaml.safe_load(path.read_text()).items() if k != "mode"}
    pretrain = yaml.safe_load((C.CONF_DIR / "config.yaml").read_text())["pretrain"]
    yield "config.yaml (pretrain)", "trainer", "sgd", {k: v for k, v in pretrain.items() if k != "rounds"}


def test_every_library_default_is_written_once_on_its_class():
    from flows.config.defaults import KINDS

    # Prepare / Execute: each setting a group file writes as a value, against the library's default
    repeated = [
        f"{file}: {key}: {value!r}"
        for file, kind, name, settings in _group_files()
        for key, value in settings.items()
        if not (isinstance(value, str) and value.startswith("${default:"))
        and key in (defaults := KINDS[kind](name))
        and value == defaults[key]
        and isinstance(value, bool) == isinstance(defaults[key], bool)
    ]

    # Assert: a value is written only where it differs (a choice, with its reason beside it)
    assert not repeated, "these repeat the library's default; write ${default:<kind>} instead: " + "; ".join(repeated)
    cfg = C.compose(["trainer=proser"])
    assert cfg.trainer.params.beta == 1.0 and cfg.trainer.params.importance == "dpi"  # named, and chosen
    assert cfg.pretrain.lr == 0.05 and cfg.pretrain.rounds == 20


def test_a_named_default_that_is_no_setting_is_refused_with_the_valid_ones():
    from flows.config.defaults import library_default

    cfg = OmegaConf.create(
        {"trainer": {"name": "prox", "params": {"mu": "${default:trainer}", "muu": "${default:trainer}"}}}
    )
    assert cfg.trainer.params.mu == 0.01
    with pytest.raises(Exception, match="trainer prox has no default for 'muu'; write a value. Its defaults are:.*mu"):
        OmegaConf.resolve(cfg)
    with pytest.raises(Exception, match="unknown kind 'trainr'; valid kinds are: trainer, strategy"):
        OmegaConf.resolve(OmegaConf.create({"x": {"name": "sgd", "params": {"lr": "${default:trainr}"}}}))
    assert library_default is not None


def test_dvc_composes_conf_with_the_library_defaults_in_its_own_process(tmp_path):
    """`dvc exp run -S` writes params.yaml from its own composition of conf/, in a process that never imports
    fedcore's config code: the ``${default:...}`` resolver reaches it through hydra_plugins/."""
    import subprocess
    import sys

    import yaml

    # Execute: DVC's composition, as `dvc exp run -S adapt.passes=1` runs it, in a fresh interpreter
    out = tmp_path / "params.yaml"
    code = (
        "from dvc.utils.hydra import compose_and_dump; "
        f"compose_and_dump({str(out)!r}, {str(C.CONF_DIR)!r}, None, 'config', {str(C.ROOT)!r}, ['adapt.passes=1'])"
    )
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, timeout=120)

    # Assert: what ours composes, value for value
    ours = C.to_dict(C.compose(["adapt.passes=1"], lay_variant=False))
    assert yaml.safe_load(out.read_text()) == ours


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


@pytest.mark.parametrize(
    "override,match",
    [
        ("method=cotta", "Could not find 'method/cotta'"),
        ("aggregator.params.gamma=-1", "gamma must be >= 0"),
        ("aggregator.params.beta=-1", "beta must be >= 0"),
        ("method.params.lr=-0.1", "lr must be > 0"),
        ("data.severity=7", "severity must be in 1..5"),
        ("data.stream_order=sorted", "valid values are: shuffled, class_sorted"),
        ("flow.arrival_runs=later", r"flow.arrival_runs='later'; valid values are: at_end, live"),
        ("data.corruptions=[a,b,c,d,e,f,g,h,i,j,k,l,m,n,o,p]", "only 15 corruption domains"),
    ],
)
def test_invalid_values_are_rejected(override, match):
    with pytest.raises(Exception, match=match):
        C.compose([override])


@pytest.mark.parametrize(
    "overrides,match",
    [
        # a setting of the wrong kind names its key, not int()'s complaint
        (["pretrain.rounds=abc"], r"pretrain.rounds=abc: pretrain.rounds takes a number \(it is 20 in conf/\)"),
        (["seed=abc"], r"seed takes a number"),
        (["sweep.seeds=[0,a]"], r"sweep.seeds lists numbers .* not 'a'"),
        (["fedpd.grids.quick.known=abc"], r"fedpd.grids.quick.known takes a number"),
        # a key added to a block that lists all its settings is a misspelling (Hydra's `+` hint leads there)
        (["+adapt.pases=1"], r"adapt has no setting 'pases'; its settings are: passes, "),
        (["adapt.pases=1"], r"adapt.pases: adapt has no setting 'pases'; its settings are: passes, "),  # no +: Hydra's
        (["method.params.lrr=1"], r"method.params has no setting 'lrr'; its settings are: optimizer, lr, "),
        (["+flow.num_cpu=2"], r"flow has no setting 'num_cpu'.*num_cpus"),
        (["+seeed=1"], r"the root config has no setting 'seeed'"),
        (["+model.nrm=group"], r"model has no setting 'nrm'; its settings are: name, norm"),
        # a sweep-wide setting that no swept method (aggregator) has would reach no cell
        (
            ["+sweep.method_params.lrr=0.1"],
            r"sweep.method_params sets .lrr., which no method it reaches .* has.*: adapt_",
        ),
        (["+sweep.aggregator_params.bta=0"], r"sweep.aggregator_params sets .bta., which no aggregator it reaches"),
        # what would run nothing, or something else than asked
        (["sweep.methods=[]"], r"sweep.methods is empty, so the sweep would run nothing.*sweep.methods=\[tent,bpa\]"),
        (["fedpad.grids.quick.methods=[]"], r"fedpad grid 'quick': methods is empty"),
        (
            ["fedpd.target=fedpd+++"],
            r"fedpd.target='fedpd\+\+\+' is not one of fedpd's methods; valid names are: fedavg, ",
        ),
        (["device=gpu"], r"unknown device 'gpu'; valid values are: auto, cpu, cuda, cuda:N"),
        (["model.name=cnnn"], r"unknown model.name 'cnnn'; valid names are: cnn, "),
        (["model.norm=instance"], r"unknown model.norm 'instance'; valid names are: batch, group, layer"),
        (["data.stream_size=0"], r"data.stream_size must be >= 1, got 0"),
        (["privacy=dp", "privacy.budget=-3"], r"privacy.budget must be a finite epsilon > 0"),
        (["ppfcil.grids.quick.tasks=0"], r"ppfcil grid 'quick': tasks=0"),
        (["fedpad.grids.quick.model=lenett"], r"fedpad grid 'quick': unknown model 'lenett'; valid names are: cnn, "),
        (["adapt.order=[0,0,99]"], r"adapt.order=\[0, 0, 99\]: the 10 target clients are numbered 0..9"),
        # the canary audit: settings that would print a table reading as a pass
        (["dptta.audit.trials=0"], r"dptta.audit.trials=0: the audit needs at least 2"),
        (["dptta.audit.confidence=1.5"], r"strictly between 0 and 1"),
        (["dptta.audit.client=99"], r"dptta.audit.client=99: the private variant has 10 target clients, numbered 0..9"),
        # a variant replaces the root's settings it names: an override of one would be dropped without a word
        (
            ["variant=cifar10", "pretrain.rounds=2"],
            r"variant 'cifar10' sets pretrain.rounds to 10, which replaces yours.*bpfedctta.variants.cifar10.pretrain.rounds=2",
        ),
        (["variant=private", "sweep.methods=[tent]"], r"dptta.variants.private.sweep.methods=\[tent\]"),
        (
            ["variant=cifar10", "model=resnet18"],
            r"model=resnet18: variant 'cifar10' sets model.name=resnet20, which would",
        ),
        # misspelt block names, fractional counts, a single value for a list
        (["+adpt.passes=1"], r"the root config has no setting 'adpt'"),
        (["adapt.passes=2.5"], r"adapt.passes takes a whole number \(it is 3 in conf/\), not 2.5"),
        (["sweep.seeds=[0,1.5]"], r"sweep.seeds lists whole numbers"),
        (["seed=null"], r"seed counts something .* it cannot be null"),
        (["sweep.methods=tent"], r"sweep.methods takes a list .* write sweep.methods=\[tent\]"),
        (["flow.progress=3"], r"flow.progress takes true or false"),
        # a method's settings: a misspelling added with `+` (it used to fail only on the worker, in the
        # first arrival), a setting of another method, and one that a variant's method does not take
        (["+method.params.lrr=0.1"], r"method 'bpa' has no setting 'lrr'; its settings are: adapt_params, lr, "),
        (["method=tent", "+method.params.sigma0=2"], r"method 'tent' has no setting 'sigma0'"),
        (["method=bn", "+method.params.lr=0.1"], r"method 'bn' takes no settings"),
        # a setting whose default is null, so the override's own check cannot know its kind
        (
            ["method=come", "method.params.prior_weight=abc"],
            r"setting prior_weight='abc' is a str; it takes float or null",
        ),
    ],
)
def test_bad_settings_fail_at_composition_naming_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        C.compose(overrides)


@pytest.mark.parametrize(
    "override,match",
    [
        ("+fedpad.grids.quick.roundz=3", r"fedpad.grids.quick has no setting 'roundz'; its settings are: .*rounds"),
        ("+ppfcil.grids.quick.taskz=3", r"ppfcil.grids.quick has no setting 'taskz'; its settings are: .*tasks"),
        ("+fedpd.reportz=1", r"fedpd has no setting 'reportz'; its settings are: grid, grids, methods"),
    ],
)
def test_a_misspelt_key_in_a_system_block_is_refused_before_any_work(override, match):
    with pytest.raises(ValueError, match=match):
        C.compose([override])


def _blocks(node):
    """Every mapping under ``node``, ``node`` included."""
    yield node
    for value in node.values():
        if OmegaConf.is_dict(value):
            yield from _blocks(value)


def test_every_block_of_every_system_refuses_a_misspelt_key():
    """A key added anywhere in a system's block (a grid, a method, its settings, a variant, a stress cell,
    the audit, a grid's clients per domain) is refused by the checks that run before any stage starts."""
    from flows import systems

    cfg = C.compose([], lay_variant=False)
    C.validate(cfg)
    tried = 0
    for system in systems.all_systems():
        if system.name not in cfg:
            continue
        for block in list(_blocks(cfg[system.name])):
            with open_dict(block):
                block["zzmisspelt"] = 1
            try:
                with pytest.raises(ValueError, match="zzmisspelt"):
                    C.validate(cfg)
            finally:
                with open_dict(block):
                    del block["zzmisspelt"]
            tried += 1
    assert tried > 200  # every grid, method, variant, stress cell of the five systems


def test_settings_of_the_right_kind_and_open_blocks_still_compose():
    cfg = C.compose(
        [
            "pretrain.rounds=3",
            "privacy=dp",
            "privacy.epsilon=5.5",
            "sweep.seeds=[0,1]",
            "+sweep.method_params.lr=0.1",
            "+ppfcil.grids.quick.norm=group",
            "data=digits",
        ]
    )
    assert (cfg.pretrain.rounds, cfg.sweep.method_params.lr, cfg.ppfcil.grids.quick.norm) == (3, 0.1, "group")
    assert cfg.privacy.epsilon == 5.5 and list(cfg.sweep.seeds) == [0, 1]
    assert C.compose(["variant=cifar10", "bpfedctta.variants.cifar10.pretrain.rounds=2"]).pretrain.rounds == 2
    # a third choice beside true and false, a fraction where one is meant, what the variant sets anyway
    assert C.compose(["pretrain.augment=sample", "flow.gpus_per_task=0.5"]).pretrain.augment == "sample"
    assert C.compose(["variant=private", "model.norm=group"]).model.norm == "group"


def test_params_file_refuses_a_group_choice_and_an_unknown_key():
    with pytest.raises(
        ValueError, match=r"method=tent: params.yaml is conf/ already composed.*dvc exp run <stage> -S method=tent"
    ):
        C.load(C.PARAMS, ["method=tent"])
    with pytest.raises(ValueError, match=r"flow.num_cpu=2: flow has no setting 'num_cpu'"):
        C.load(C.PARAMS, ["flow.num_cpu=2"])
    with pytest.raises(ValueError, match=r"pretrain.rounds=abc: pretrain.rounds takes a number"):
        C.load(C.PARAMS, ["pretrain.rounds=abc"])


def test_a_params_file_with_a_bad_method_setting_fails_before_any_work(tmp_path):
    """What `dvc exp run -S method.params.lr=abc` (or a hand edit) leaves in params.yaml: DVC writes the
    value without our override checks, so the config's own validation must name it."""
    text = C.PARAMS.read_text()
    assert "\n  params:\n    optimizer: sgd\n    lr: 0.01\n" in text
    for bad, match in (
        ("lr: abc", r"setting lr='abc' is a str; it takes float"),
        ("lr: 0.01\n    lrr: 0.1", r"method 'bpa' has no setting 'lrr'"),
    ):
        f = tmp_path / "params.yaml"
        f.write_text(
            text.replace(
                "\n  params:\n    optimizer: sgd\n    lr: 0.01\n", f"\n  params:\n    optimizer: sgd\n    {bad}\n", 1
            )
        )
        with pytest.raises(ValueError, match=match):
            C.validate(C.load(f))


def test_unknown_sweep_cell_lists_valid_names():
    with pytest.raises(ValueError, match="valid names are: bn, bpa, come, deyo, eata, sar, source, tent"):
        C.arrival_config(C.compose([]), method="cotta")
