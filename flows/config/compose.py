"""Compose the Hydra config (conf/) and turn it into fedcore's typed settings.

Three ways in, one source of truth:
* ``python -m flows.stages arrival method=tent aggregator=ugsa`` composes conf/ with Hydra overrides;
* ``dvc repro`` runs the stages on ``params.yaml``, which is conf/ composed with no overrides;
* ``dvc exp run -S method=tent`` (DVC's Hydra integration) recomposes params.yaml from conf/.

Either way the selected variant (``variant``; conf/experiment/bpfedctta.yaml and dptta.yaml) is then
laid over the root config.
"""

from __future__ import annotations

import copy
import functools
import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf

from fedcore.data.corruptions import CORRUPTION_NAMES
from fedcore.data.domains import DOMAIN_SETS
from fedcore.engine import ArrivalConfig, ModelSpec, RoundConfig
from fedcore.privacy import NOISE_SOURCES, PrivacyConfig
from flows import systems
from flows.config import defaults, schema

ROOT = Path(__file__).resolve().parents[2]
defaults.register()  # before conf/ is composed: its groups name the library's defaults
CONF_DIR = ROOT / "conf"
PARAMS = ROOT / "params.yaml"


def compose(overrides: List[str] | None = None, *, lay_variant: bool = True, system: str | None = None) -> DictConfig:
    """conf/config.yaml composed with Hydra ``overrides`` (e.g. ``["method=tent", "seed=1"]``), the selected
    variant laid over it; ``lay_variant=False`` gives the composition itself (what params.yaml holds).
    ``system``: the system a stage runs, whose settings alone are checked (:func:`validate`)."""
    overrides = list(overrides or [])
    late = _plugin_block_overrides(overrides)  # a plug-in's own block is composed after Hydra, so set it then
    overrides = [o for o in overrides if o not in late]
    settings = [o for o in overrides if not _is_group_choice(o)]
    cfg = with_plugins(_hydra(overrides))
    if settings:  # what the settings replaced: conf/ with the same groups chosen
        base = with_plugins(_hydra([o for o in overrides if o not in settings]))
        check_overrides(base, cfg, settings)
    if late:
        base = cfg
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([o.lstrip("+") for o in late]))
        check_overrides(base, cfg, late, source="the plug-in's config")
    validate(cfg, system)
    if lay_variant:
        check_not_replaced(cfg, overrides)
    return with_variant(cfg) if lay_variant else cfg


_COMPOSED: "OrderedDict[tuple, DictConfig]" = OrderedDict()
_COMPOSED_KEEP = 32


def _conf_stamp() -> tuple:
    """Every file under conf/ with its size and modification time: a composition is reused only while
    conf/ is unchanged."""
    return tuple(sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in CONF_DIR.rglob("*.yaml")))


def _hydra(overrides: List[str]) -> DictConfig:
    """conf/ composed by Hydra with ``overrides``: a copy of an earlier composition of the same overrides
    over the same conf/ when there is one (composing takes about 0.5 s, copying 0.04 s; a process that
    checks overrides or runs many configs composes the same ones again and again)."""
    key = (tuple(overrides), _conf_stamp())
    if key not in _COMPOSED:
        from hydra import compose as hydra_compose
        from hydra import initialize_config_dir
        from hydra.errors import ConfigCompositionException

        try:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                composed = hydra_compose(config_name="config", overrides=list(overrides))
        except ConfigCompositionException as exc:
            raise _unknown_key(exc, overrides) from None
        OmegaConf.resolve(composed)  # ${default:...} becomes the library's value (flows/config/defaults.py)
        _COMPOSED[key] = composed
        while len(_COMPOSED) > _COMPOSED_KEEP:
            _COMPOSED.popitem(last=False)
    _COMPOSED.move_to_end(key)
    return copy.deepcopy(_COMPOSED[key])


def _unknown_key(exc: Exception, overrides: List[str]) -> Exception:
    """Hydra's "Could not override 'a.b'" for a key conf/ does not have, said as every other misspelling is:
    the valid settings where the key was meant to go (Hydra's own hint, ``+a.b=...``, adds the misspelt key)."""
    found = re.match(r"Could not override '([^']+)'", str(exc))
    if not found:
        return exc
    key = found.group(1)
    parent, _, leaf = key.rpartition(".")
    rest = [o for o in overrides if _override_key(o) != key]
    try:
        node = OmegaConf.select(_hydra(rest), parent) if parent else _hydra(rest)
    except Exception:  # the others do not compose either: Hydra's message stands
        return exc
    if not isinstance(node, DictConfig):
        return exc
    where = parent or "the root config"
    return ValueError(f"{key}: {where} has no setting {leaf!r}; its settings are: {', '.join(map(str, node))}")


def load(
    params_file: str | Path | None = None, overrides: List[str] | None = None, *, system: str | None = None
) -> DictConfig:
    """``params.yaml`` (what DVC tracks) plus dot-list overrides, the selected variant laid over it;
    without a file, compose conf/. ``system``: the system a stage runs, whose settings alone are checked."""
    if params_file is None:
        return compose(overrides, system=system)
    path = Path(params_file)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; regenerate it with `make params`")
    cfg = with_plugins(OmegaConf.load(path))
    if overrides:
        choices = [o for o in overrides if _is_group_choice(o)]
        if choices:
            raise ValueError(
                f"{choices[0]}: {path.name} is conf/ already composed, so its config groups are chosen; a dot-list "
                f"override can change a setting but cannot choose another group. Drop --params to compose conf/ "
                f"with it (`python -m flows.stages <stage> {' '.join(overrides)}`), or run it through DVC: "
                f"`dvc exp run <stage> -S {choices[0]}`"
            )
        base = cfg
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([o.lstrip("+") for o in overrides]))
        check_overrides(base, cfg, list(overrides), source=path.name)
    validate(cfg, system)
    check_not_replaced(cfg, list(overrides or []))
    return with_variant(cfg)


def _plugin_block_overrides(overrides: List[str]) -> List[str]:
    """The overrides that set a key of a plug-in system's own block (``toy.grid=tiny``), after importing the
    plug-ins they and conf/config.yaml name: Hydra does not know those blocks, which are merged after it."""
    systems.configured_plugins(overrides)
    blocks = {s.name for s in systems.all_systems() if s.config}
    return [o for o in overrides if "=" in o and _override_key(o).split(".", 1)[0] in blocks]


def with_plugins(cfg: DictConfig) -> DictConfig:
    """Import the config's ``plugins``, then compose under its name each registered system's own config file
    (:attr:`flows.systems.base.System.config`) that conf/ does not already hold."""
    systems.load_plugins(cfg.get("plugins") or [])
    missing = [s for s in systems.all_systems() if s.config and s.name not in cfg]
    if missing:
        from omegaconf import open_dict

        with open_dict(cfg):
            for s in missing:
                cfg[s.name] = OmegaConf.load(s.config)
                OmegaConf.resolve(cfg[s.name])
    return cfg


@functools.lru_cache(maxsize=1)
def groups() -> Tuple[str, ...]:
    """conf/'s config groups (method, aggregator, privacy, ...). Read when first asked, not at import: a Ray
    worker that was shipped the code has no conf/ (:func:`from_run` needs none)."""
    return tuple(sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir()))


# Blocks whose settings are all listed in conf/: a key added to them (Hydra's `+key=value`, or any new key
# with --params) can only be a misspelling, which would otherwise be read by nothing. The round-based
# systems' blocks take optional keys (a grid's norm, a trainer's settings); their validators check those.
CLOSED_BLOCKS = ("adapt", "data", "flow", "model", "paths", "sweep")


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _is_group_choice(override: str) -> bool:
    """``method=tent`` (a config group chosen), as opposed to a setting (``method.params.lr=0.1``, ``seed=1``)."""
    key = _override_key(override)
    return key.split("@", 1)[0] in groups() and "=" in override


# Settings that count something: a fraction (``adapt.passes=2.5``) would be cut down by int() without a word,
# and null cannot be counted. Other numbers (an lr, a GPU share, a delay) take fractions.
COUNTS = frozenset(
    {
        "rounds",
        "passes",
        "seed",
        "seeds",
        "local_epochs",
        "batch_size",
        "steps",
        "tasks",
        "rounds_per_task",
        "clients",
        "known",
        "trials",
        "stream_size",
        "holdout_size",
        "num_cpus",
        "retries",
        "severity",
        "memory",
        "per_class",
        "client",
        "num_source_clients",
        "in_channels",
        "num_classes",
        "compress_rounds",
    }
)


def check_overrides(base: DictConfig, cfg: DictConfig, overrides: List[str], *, source: str = "conf/") -> None:
    """Each override sets a setting ``base`` has (in a closed block), with a value of the setting's kind:
    ``pretrain.rounds=abc`` or ``+adapt.pases=1`` fail here, naming the key, instead of later or never."""
    missing = object()
    for override in overrides:
        if "=" not in override or override.startswith("~"):
            continue
        key = _override_key(override)
        old = OmegaConf.select(base, key, default=missing)
        new = OmegaConf.select(cfg, key, default=None)
        if old is missing:
            _check_new_key(base, key, override)
            continue
        leaf = key.rpartition(".")[2]
        was = f"(it is {old!r} in {source})" if not isinstance(old, ListConfig) else f"(it is {list(old)} in {source})"
        if isinstance(old, ListConfig) and new is not None and not isinstance(new, ListConfig):
            raise ValueError(f"{override}: {key} takes a list {was}; write {key}=[{new}]")
        if new is None:
            if old is not None and leaf in COUNTS:
                raise ValueError(f"{override}: {key} counts something {was}; it cannot be null")
            continue
        _check_value(override, key, leaf, old, new, was)
        if isinstance(old, ListConfig) and len(old) and isinstance(new, ListConfig):
            for value in new:
                _check_value(override, key, leaf, old[0], value, was, listed=True)


def _check_new_key(base: DictConfig, key: str, override: str) -> None:
    """A key ``base`` lacks is a misspelling when its nearest existing block is the root or a closed one
    (``+adpt.passes=1``, ``+adapt.pases=1``); elsewhere it may be an optional setting (a grid's norm)."""
    parts = key.split(".")
    depth = len(parts) - 1
    while depth > 0 and OmegaConf.select(base, ".".join(parts[:depth]), default=None) is None:
        depth -= 1
    parent = ".".join(parts[:depth])
    if parent == "" or parent in CLOSED_BLOCKS:
        node = OmegaConf.select(base, parent) if parent else base
        keys = ", ".join(str(k) for k in node) if isinstance(node, DictConfig) else "(none)"
        raise ValueError(
            f"{override}: {parent or 'the root config'} has no setting {parts[depth]!r}; its settings are: {keys}"
        )


def _check_value(override: str, key: str, leaf: str, old: Any, new: Any, was: str, *, listed: bool = False) -> None:
    what = f"{key} lists" if listed else f"{key} takes"
    if isinstance(old, bool):
        if isinstance(new, (int, float)) and not isinstance(new, bool):  # text may be a third choice (augment: sample)
            raise ValueError(f"{override}: {what} true or false {was}, not {new!r}")
    elif isinstance(old, (int, float)):
        if isinstance(new, bool) or not isinstance(new, (int, float)):
            raise ValueError(f"{override}: {what} {'numbers' if listed else 'a number'} {was}, not {new!r}")
        if leaf in COUNTS and isinstance(new, float) and not new.is_integer():
            raise ValueError(f"{override}: {what} {'whole numbers' if listed else 'a whole number'} {was}, not {new!r}")


def check_not_replaced(cfg: DictConfig, overrides: List[str]) -> None:
    """No override sets a key that the selected variant then replaces (``variant=cifar10 pretrain.rounds=2``
    would otherwise run the variant's 10 rounds without a word), nor chooses a group whose settings it replaces
    (``variant=cifar10 model=resnet18`` would run its resnet20)."""
    if "variant" not in cfg:
        return
    name = str(cfg.variant)
    system = variant_system(cfg, name)
    overlay = cfg[system].variants[name]
    missing = object()
    for override in overrides:
        key = _override_key(override)
        if "=" not in override or key == "variant":
            continue
        value = OmegaConf.select(overlay, key, default=missing)
        if (
            isinstance(value, DictConfig)
            and _is_group_choice(override)
            and any(OmegaConf.select(cfg, f"{key}.{k}", default=None) != value[k] for k in value)
        ):
            items = [f"{key}.{k}={value[k]}" for k in value]
            sets = ", ".join(items[:3]) + (f" and {len(items) - 3} more" if len(items) > 3 else "")
            raise ValueError(
                f"{override}: variant {name!r} sets {sets}, which would replace what {override} "
                f"chooses. Choose another variant, or set the variant's own: "
                f"`{system}.variants.{name}.{key}.<setting>=...`"
            )
        if value is missing or isinstance(value, DictConfig) or value == OmegaConf.select(cfg, key, default=None):
            continue  # the variant does not set it, or sets what was asked for
        raise ValueError(
            f"{override}: variant {name!r} sets {key} to {value!r}, which replaces yours, so the run would "
            f"not use it. Set the variant's own: `{system}.variants.{name}.{key}={override.split('=', 1)[1]}` "
            f"(its outputs go to the variant's paths, which DVC tracks: for a trial run, set those too)"
        )


def to_dict(cfg: DictConfig) -> Dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def round_systems() -> List[str]:
    """The round-based systems (:mod:`flows.systems`), each composed under its own key."""
    return systems.names("rounds")


def variant_systems() -> List[str]:
    """The test-time adaptation systems, whose variants are laid over the root config."""
    return systems.names("arrivals")


VARIANT_BLOCKS = ("data", "model", "pretrain")  # every variant names these: DVC tracks them beside the root's


def not_arrival() -> Tuple[str, ...]:
    """Config blocks an arrival-pipeline run does not read: every system's own block, and the round groups."""
    return (*round_systems(), *variant_systems(), "trainer", "strategy")


def arrival_run(cfg: DictConfig) -> Dict[str, Any]:
    """The resolved config an arrival-pipeline flow (pretraining, one arrival run, the sweep) runs on: every
    block but the round-based systems' and groups. The variant systems' blocks stay: the selected variant is
    laid over the root already, but its name still says which system the run belongs to (its registry name,
    its ledgers)."""
    drop = (*round_systems(), "trainer", "strategy")
    return {k: v for k, v in to_dict(cfg).items() if k not in drop}


def from_run(config: Dict[str, Any]) -> DictConfig:
    """The config a flow was given (:func:`arrival_run`, :func:`round_run`), with the plug-ins it names imported
    (their systems, strategies and trainers), as the flow reads it."""
    cfg = OmegaConf.create(config)
    systems.load_plugins(cfg.get("plugins") or [])
    return cfg


RUN_BLOCKS = ("seed", "device", "flow", "paths", "plugins")  # what every run reads beside its system's block


def round_run(cfg: DictConfig, system: str, grid_name: str, *, single: bool = False) -> Dict[str, Any]:
    """The resolved config a round-based flow runs on: its system's block with this grid only (not the
    system's other grids), the run's own blocks, and for one run (``single``) the trainer and strategy."""
    d = to_dict(cfg)
    block = {k: v for k, v in d[system].items() if k != "grids"}
    # the grid's norm written out: a grid without one takes the root model's, a block this config leaves out
    block["grids"] = {grid_name: {**d[system]["grids"][grid_name], "norm": grid_norm(cfg, system, grid_name)}}
    keep = (*RUN_BLOCKS, "trainer", "strategy") if single else RUN_BLOCKS
    return {system: block, **{k: d[k] for k in keep if k in d}}


def validate(cfg: DictConfig, system: str | None = None) -> None:
    """Reject impossible values with a message that says what would be valid: every system's block, or only
    the block of the ``system`` a stage runs (``"arrivals"``: the arrival pipeline, whose variants belong to
    every arrival-engine system). The blocks every run reads (device, flow, model, data) are always checked."""
    arrivals = system is None or system not in round_systems()  # the arrival pipeline, or a variant system's step
    for s in systems.all_systems():  # every block's keys, so that a misspelling is refused whichever stage runs
        if s.name in cfg:
            schema.check(cfg[s.name], s.schema(), s.name)
    _validate_run(cfg)
    for s in round_systems():
        if s in cfg and (system is None or s == system):
            validate_rounds(cfg, s)
    if arrivals and any(s in cfg for s in variant_systems()):
        validate_variants(cfg)
    if arrivals and "dptta" in cfg and "audit" in cfg.dptta:
        validate_audit(cfg)  # once: _validate_run, above, runs again for every variant
    if arrivals:
        _check_sweep_settings(cfg)  # after the variants' own checks: it reads each variant's run


def _validate_run(cfg: DictConfig) -> None:
    """The blocks one run reads: data, pretraining, arrival and the sweep's privacy forms."""
    d = cfg.data
    if d.stream_order not in ("shuffled", "class_sorted"):
        raise ValueError(f"data.stream_order={d.stream_order!r}; valid values are: shuffled, class_sorted")
    if len(d.corruptions) > len(CORRUPTION_NAMES):
        raise ValueError(
            f"{len(d.corruptions)} target clients asked for, but only {len(CORRUPTION_NAMES)} "
            f"corruption domains exist: {', '.join(CORRUPTION_NAMES)}"
        )
    bad = [c for c in d.corruptions if c not in CORRUPTION_NAMES]
    if bad:
        raise ValueError(f"unknown corruption(s) {bad}; valid names are: {', '.join(CORRUPTION_NAMES)}")
    if not 1 <= int(d.severity) <= 5:
        raise ValueError(f"data.severity must be in 1..5, got {d.severity}")
    order = cfg.adapt.get("order") if "adapt" in cfg else None
    if order is not None and any(not 0 <= int(i) < len(d.corruptions) for i in order):
        raise ValueError(
            f"adapt.order={list(order)}: the {len(d.corruptions)} target clients are numbered "
            f"0..{len(d.corruptions) - 1} (one per data.corruptions entry)"
        )
    for key in ("stream_size", "holdout_size"):
        if key in d and int(d[key]) < 1:
            raise ValueError(f"data.{key} must be >= 1, got {d[key]}")
    _validate_model_and_device(cfg)
    pretrain_config(cfg)
    arrival_config(cfg)  # checks method, aggregator, lr, gamma, beta, passes, privacy
    for key in ("methods", "aggregators", "seeds", "privacy"):
        if "sweep" in cfg and key in cfg.sweep and not list(cfg.sweep[key]):
            raise ValueError(
                f"sweep.{key} is empty, so the sweep would run nothing (and write an empty table over "
                f"the last one); list at least one, e.g. sweep.{key}=[{','.join(map(str, _SWEEP_EXAMPLES[key]))}]"
            )
    source = cfg.sweep.get("noise_source", None) if "sweep" in cfg else None
    if source is not None and str(source) not in NOISE_SOURCES:
        raise ValueError(
            f"sweep.noise_source={source!r}; valid values are: {', '.join(NOISE_SOURCES)}, or null "
            "for each form's own privacy.noise_source"
        )
    forms = list(cfg.sweep.get("privacy", None) or []) if "sweep" in cfg else []
    check_forms(cfg, forms)  # a bad sweep form fails here, before any stage starts work
    runs = cfg.flow.arrival_runs
    if runs not in ARRIVAL_RUNS:
        raise ValueError(
            f"flow.arrival_runs={runs!r}; valid values are: {', '.join(ARRIVAL_RUNS)} (when each "
            "arrival's nested MLflow run is written)"
        )


ARRIVAL_RUNS = ("at_end", "live")


_SWEEP_EXAMPLES = {"methods": ["tent", "bpa"], "aggregators": ["ugsa"], "seeds": [0], "privacy": ["plain"]}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _validate_model_and_device(cfg: DictConfig) -> None:
    from fedcore.models import MODELS
    from fedcore.models.norm import NORMS

    if str(cfg.model.name) not in MODELS:
        raise ValueError(f"unknown model.name {cfg.model.name!r}; valid names are: {', '.join(MODELS.names())}")
    if str(cfg.model.norm) not in NORMS:
        raise ValueError(f"unknown model.norm {cfg.model.norm!r}; valid names are: {', '.join(NORMS)}")
    if not _DEVICE.fullmatch(str(cfg.device)):  # whether a GPU is there is checked where the work runs
        raise ValueError(f"unknown device {cfg.device!r}; valid values are: auto, cpu, cuda, cuda:N")


def validate_audit(cfg: DictConfig) -> None:
    """The canary audit's settings (``dptta.audit``): a bad one would give a table that reads as a pass."""
    a, where = cfg.dptta.audit, "dptta.audit"
    if int(a.trials) < 2:
        raise ValueError(
            f"{where}.trials={a.trials}: the audit needs at least 2 IN/OUT pairs (its bound grows "
            "with about ln(trials); 200 is the default)"
        )
    if not 0 < float(a.confidence) < 1:
        raise ValueError(f"{where}.confidence={a.confidence}: a confidence level lies strictly between 0 and 1")
    if int(a.stream_size) < 1:
        raise ValueError(f"{where}.stream_size={a.stream_size}: each trial needs at least one stream sample")
    if float(a.lr) <= 0:
        raise ValueError(f"{where}.lr={a.lr}: must be > 0")
    bad = [e for e in a.epsilons if float(e) <= 0]
    if bad or not list(a.epsilons):
        raise ValueError(f"{where}.epsilons={list(a.epsilons)}: list one or more epsilons, each > 0")
    clients = len(run_view(cfg, "private").data.corruptions) if "private" in variants(cfg) else None
    if not 0 <= int(a.client) < (clients or int(a.client) + 1):
        raise ValueError(
            f"{where}.client={a.client}: the private variant has {clients} target clients, "
            f"numbered 0..{(clients or 1) - 1}"
        )


def model_spec(cfg: DictConfig) -> ModelSpec:
    return ModelSpec(
        name=cfg.model.name,
        in_channels=int(cfg.data.in_channels),
        num_classes=int(cfg.data.num_classes),
        norm=cfg.model.norm,
    )


def pretrain_config(cfg: DictConfig) -> RoundConfig:
    """Source pretraining: the round engine with the ``sgd`` trainer and ``fedavg``.

    Every ``pretrain`` setting but ``rounds`` is the trainer's (:class:`fedcore.train.LocalTrainer`):
    a setting the root config leaves out keeps the trainer's default, and a misspelt one fails
    with the valid names.
    """
    p = to_dict(cfg.pretrain)
    trainer = {k: v for k, v in p.items() if k != "rounds"}
    return RoundConfig(
        rounds=int(p["rounds"]),
        trainer="sgd",
        trainer_params=trainer,
        strategy="fedavg",
        seed=int(cfg.seed),
        device=str(cfg.device),
    )


def privacy_form(cfg: DictConfig, form: str | None) -> Dict[str, Any]:
    """The privacy settings of a form: ``<mode>[-eps<e>][-c<C>]``.

    Why a name and not Hydra: a sweep runs all its forms in one stage (one DVC output, its cells side by side
    on Ray), so they are a list of values in ``sweep.privacy``. Hydra can choose one ``privacy`` group per
    composition, or launch a process per choice (``-m``), but cannot put several group choices, each with its
    own epsilon or clip norm, in one list.

    ``<mode>`` is ``plain``, ``clip``, ``dp0`` or ``dp``; ``-eps<e>`` sets dp's epsilon (``dp-eps5``);
    ``-c<C>`` sets the clip norm of any form that clips (``clip-c5``, ``dp-eps10-c0.3``), the axis
    the DP-TTA paper cross-validates. ``None`` means the selected ``privacy`` group as configured. A
    named form is a sweep cell: its dp settings take the grid's ``sweep.noise_source`` when that is
    set (research grids say ``seeded``, so that DVC reruns them bit for bit).
    """
    if form is None:
        return dict(OmegaConf.to_container(cfg.privacy, resolve=True)) if "privacy" in cfg else {}
    name, *settings = _form_parts(form)
    own = "privacy" in cfg and _form_name(cfg.privacy) == name
    base = cfg.privacy if own else _group("privacy", name)
    out = dict(OmegaConf.to_container(base, resolve=True))
    grammar = "valid forms are: plain, clip[-c<C>], dp0[-c<C>], dp[-eps<e>][-c<C>] (e.g. dp-eps5-c0.5)"
    seen = set()
    for setting in settings:
        key = "eps" if setting.startswith("eps") else "c" if setting.startswith("c") else None
        if key is None or key in seen:
            hint = "; a fixed σ is set by privacy.noise_multiplier" if setting.startswith("sigma") else ""
            raise ValueError(f"privacy form {form!r}: cannot read {setting!r}; {grammar}{hint}")
        seen.add(key)
        if key == "eps" and name != "dp":
            raise ValueError(f"privacy form {form!r}: only dp takes -eps<e>; {grammar}")
        if key == "c" and name == "plain":
            raise ValueError(f"privacy form {form!r}: plain does not clip, so it takes no -c<C>; {grammar}")
        text = setting[len(key) :]
        try:
            value = float(text)
        except ValueError:
            why = (
                "'-' separates settings, so a value cannot be negative"
                if not text
                else f"{text!r} is not a number (e.g. dp-eps5, clip-c0.5)"
            )
            raise ValueError(f"privacy form {form!r}: {why}") from None
        if key == "eps":
            out["epsilon"], out["noise_multiplier"] = value, None
        else:
            out["clip_norm"] = value
    source = cfg.sweep.get("noise_source", None) if "sweep" in cfg else None
    if source is not None and out.get("mode") == "dp":
        out["noise_source"] = str(source)
    return out


def _form_parts(form: str) -> List[str]:
    """``dp-eps1e-05-c5`` -> ``["dp", "eps1e-05", "c5"]``: '-' separates settings, except in an exponent."""
    parts: List[str] = []
    for token in form.split("-"):
        if parts and len(parts) > 1 and parts[-1][-1:] == "e" and parts[-1][-2:-1].isdigit() and token.isdigit():
            parts[-1] += f"-{token}"
        else:
            parts.append(token)
    return parts


def check_forms(cfg: DictConfig, forms, where: str = "sweep.privacy") -> None:
    """Every form in ``forms`` is valid, and no two run under one name (they would share a run folder)."""
    names: Dict[str, str] = {}
    for form in forms:
        settings = privacy_form(cfg, str(form))
        try:
            name = PrivacyConfig.from_dict(settings).name
        except ValueError as exc:
            raise ValueError(f"{where} form {form!r}: {exc}") from None
        same = names.setdefault(name, str(form))
        if same != str(form):
            raise ValueError(f"{where} lists {same!r} and {form!r}, which both run as {name!r}; list it once")


def _form_name(privacy: DictConfig) -> str:
    return {"off": "plain"}.get(str(privacy.mode), str(privacy.mode))


def _check_sweep_settings(cfg: DictConfig) -> None:
    """``sweep.method_params`` (``aggregator_params``) sets only settings that some method (aggregator) it
    reaches has: one swept by the root or a variant, or the one configured for a single run. A setting none
    of them has would reach no run, so it is a misspelling."""
    if "sweep" not in cfg:
        return
    views: List[DictConfig] = []
    for key, group, listed in (
        ("method_params", "method", "methods"),
        ("aggregator_params", "aggregator", "aggregators"),
    ):
        shared = cfg.sweep.get(key, None) or {}
        if not shared:
            continue
        views = views or [cfg, *(run_view(cfg, v) for v in variants(cfg))]
        names = sorted({str(n) for view in views for n in [*view.sweep[listed], view[group].name]})
        have = {str(k) for n in names for k in (_group(group, n).get("params") or {})}
        unknown = sorted(set(map(str, shared)) - have)
        if unknown:
            raise ValueError(
                f"sweep.{key} sets {', '.join(map(repr, unknown))}, which no {group} it reaches "
                f"({', '.join(names)}) has, so it would change no run; their settings are: "
                f"{', '.join(sorted(have)) or '(none)'}"
            )


def _with_sweep_settings(cfg: DictConfig, params: DictConfig, key: str) -> Dict[str, Any]:
    """A method's (aggregator's) params with ``sweep.<key>`` laid over the settings it has: ``{lr: 0.1}``
    reaches every swept method with an lr, ``{beta: 0}`` every aggregator with a beta. (Hydra's overrides set
    the one ``method`` group composed; a sweep builds every swept method's config from its group file here.)"""
    out = dict(OmegaConf.to_container(params, resolve=True))
    shared = cfg.sweep.get(key, None) if "sweep" in cfg else None
    shared = OmegaConf.to_container(shared, resolve=True) if shared is not None else {}
    out.update({k: v for k, v in shared.items() if k in out})
    return out


def arrival_config(
    cfg: DictConfig,
    *,
    method: str | None = None,
    aggregator: str | None = None,
    seed: int | None = None,
    form: str | None = None,
) -> ArrivalConfig:
    """The arrival settings; ``method``/``aggregator``/``seed``/``form`` pick a sweep cell (defaults from conf/)."""
    mcfg = cfg.method if method is None or method == cfg.method.name else _group("method", method)
    acfg = (
        cfg.aggregator if aggregator is None or aggregator == cfg.aggregator.name else _group("aggregator", aggregator)
    )
    a = cfg.adapt
    return ArrivalConfig(
        method=str(mcfg.name),
        method_params=_with_sweep_settings(cfg, mcfg.params, "method_params"),
        aggregator=str(acfg.name),
        aggregator_params=_with_sweep_settings(cfg, acfg.params, "aggregator_params"),
        passes=int(a.passes),
        order=None if a.order is None else list(a.order),
        batch_size=int(a.batch_size),
        seed=int(cfg.seed if seed is None else seed),
        device=str(cfg.device),
        privacy=privacy_form(cfg, form),
        stream=str(a.stream),
    )


# ------------------------------------------------------------------------------------ variants
def variants(cfg: DictConfig) -> Dict[str, str]:
    """Every variant's name and the system it belongs to (``<system>.variants.<name>``)."""
    return {str(name): system for system in variant_systems() if system in cfg for name in cfg[system].variants}


def variant_system(cfg: DictConfig, name: str) -> str:
    """The system a variant belongs to; an unknown name fails with the valid ones."""
    known = variants(cfg)
    if name not in known:
        raise ValueError(f"unknown variant {name!r}; valid names are: {', '.join(sorted(known))}")
    return known[name]


# Why variants are laid over the root here and are not a Hydra config group: DVC runs one stage per variant
# (dvc.yaml `foreach`) from one params.yaml and tracks each stage's params by key. As a group, params.yaml would
# hold the selected variant's values only, so the other variants' stages would have no params to track and
# `dvc exp run -S` could not change them. Kept as blocks of the system's own file, every variant is in
# params.yaml at once, and `variant=<name>` picks one. Stress cells (flows/runs/stress.py) are kept the same
# way, for the same reason.
def with_variant(cfg: DictConfig, name: str | None = None) -> DictConfig:
    """``cfg`` with a variant laid over it (default: the selected one, ``cfg.variant``): a key the variant
    sets replaces the root's, a key it leaves out keeps the root's. ``cfg`` itself is left as it was."""
    if "variant" not in cfg:  # a config from before variants, or a hand-made one: nothing to lay over
        return cfg
    name = str(cfg.variant if name is None else name)
    overlay = cfg[variant_system(cfg, name)].variants[name]
    out = OmegaConf.merge(cfg, overlay)
    out.variant = name
    return out


def validate_variants(cfg: DictConfig) -> None:
    """Variant names are unique, the selected one exists, and each variant names the blocks DVC tracks, sets
    only keys the root config has, and yields a valid run."""
    seen: Dict[str, str] = {}
    for system in variant_systems():
        for name in cfg[system].variants if system in cfg else []:
            if str(name) in seen:
                raise ValueError(
                    f"variant {name!r} is defined by both {seen[str(name)]} and {system} "
                    f"(conf/experiment/{system}.yaml); rename one"
                )
            seen[str(name)] = system
    if "variant" in cfg:
        variant_system(cfg, str(cfg.variant))
    for name, system in seen.items():
        overlay = cfg[system].variants[name]
        if not isinstance(overlay, DictConfig):
            raise ValueError(
                f"variant {name!r} (conf/experiment/{system}.yaml) is {overlay!r}, not a block: a variant "
                f"sets {', '.join(VARIANT_BLOCKS)} and any other root block it changes"
            )
        missing = [b for b in VARIANT_BLOCKS if b not in overlay]
        if missing:
            raise ValueError(
                f"variant {name!r} (conf/experiment/{system}.yaml) lacks {', '.join(missing)}: DVC "
                f"tracks each variant's {', '.join(VARIANT_BLOCKS)}; write e.g. `{missing[0]}: {{}}` "
                "to keep the root's"
            )
        _check_overlay(overlay, cfg, f"variant {name!r} (conf/experiment/{system}.yaml)", "")
        _validate_run(run_view(cfg, name))


def run_view(cfg: DictConfig, name: str) -> DictConfig:
    """What one run of variant ``name`` reads: the root blocks with the variant laid over them, without the
    systems' blocks (a fifth of the cost of :func:`with_variant`, which keeps them)."""
    blocks = {s.name for s in systems.all_systems()}
    root = OmegaConf.masked_copy(cfg, [k for k in cfg if k not in blocks])
    out = OmegaConf.merge(root, cfg[variant_system(cfg, name)].variants[name])
    out.variant = name
    return out


def _check_overlay(overlay: Any, root: Any, where: str, prefix: str) -> None:
    """Every key a variant sets is a key of the root config (a typo would otherwise add a key nothing reads)."""
    if not isinstance(overlay, DictConfig):
        return
    for key, value in overlay.items():
        path = f"{prefix}{key}"
        if not isinstance(root, DictConfig) or key not in root:
            valid = ", ".join(str(k) for k in root) if isinstance(root, DictConfig) else "none (not a block)"
            raise ValueError(f"{where} sets {path}, which the root config does not have; keys there: {valid}")
        _check_overlay(value, root[key], where, f"{path}.")


# ------------------------------------------------------------------------------------ round-based systems
def grid(cfg: DictConfig, system: str, name: str | None = None) -> DictConfig:
    """The named grid of a round-based system (``fedpad.grids.<name>``; default: ``<system>.grid``)."""
    block = cfg[system]
    name = str(block.grid if name is None else name)
    if name not in block.grids:
        raise ValueError(f"unknown {system} grid {name!r}; valid names are: {', '.join(sorted(block.grids))}")
    return block.grids[name]


def round_config(cfg: DictConfig, system: str, *, method: str, seed: int, grid_name: str | None = None) -> RoundConfig:
    """The settings of one cell (method x seed) of a round-based grid."""
    block, g = cfg[system], grid(cfg, system, grid_name)
    if method not in block.methods:
        raise ValueError(f"unknown {system} method {method!r}; valid names are: {', '.join(sorted(block.methods))}")
    m = OmegaConf.to_container(block.methods[method], resolve=True)
    # the block's trainer settings, then the grid's, then the method's; a block's or grid's setting reaches the
    # methods whose trainer (strategy) takes it (a PROSER schedule passes plain SGD by), and one that no method of
    # the experiment takes is refused by _check_shared_settings
    trainer = {
        **_taken("trainer", str(m["trainer"]), block.get("trainer")),
        **_taken("trainer", str(m["trainer"]), g.get("trainer")),
        **(m.get("trainer_params") or {}),
    }
    strategy = {**_taken("strategy", str(m["strategy"]), g.get("strategy")), **(m.get("strategy_params") or {})}
    return RoundConfig(
        rounds=grid_rounds(g, system),
        trainer=str(m["trainer"]),
        trainer_params=trainer,
        strategy=str(m["strategy"]),
        strategy_params=strategy,
        participation=float(g.participation),
        seed=int(seed),
        device=str(cfg.device),
    )


def _settings_of(kind: str, name: str) -> List[str] | None:
    """The settings a trainer or strategy takes (``None``: any)."""
    if kind == "trainer":
        from fedcore.train.base import TRAINERS as registry
    else:
        import fedcore.aggregate  # noqa: F401 - registers the strategies
        from fedcore.aggregate.base import STRATEGIES as registry
    return registry.settings(name)


def _taken(kind: str, name: str, settings: Any) -> Dict[str, Any]:
    """The shared ``settings`` (a block's or grid's) that the trainer or strategy ``name`` takes."""
    if settings is None:
        return {}
    values = OmegaConf.to_container(settings, resolve=True) if isinstance(settings, DictConfig) else dict(settings)
    valid = _settings_of(kind, name)
    return {k: v for k, v in values.items() if valid is None or k in valid}


def _check_shared_settings(cfg: DictConfig, system: str, name: str, g: DictConfig) -> None:
    """Every shared trainer / strategy setting (the block's ``trainer:``, a grid's ``trainer:`` and ``strategy:``)
    is one that some method of the experiment takes: a misspelt setting would otherwise reach none of them. (One
    that the grid's own methods do not take, after its methods were narrowed, is left unused.)"""
    block = cfg[system]
    for kind, where, owner in (
        ("trainer", block.get("trainer"), f"{system}.trainer"),
        ("trainer", g.get("trainer"), f"{system} grid {name!r}: trainer"),
        ("strategy", g.get("strategy"), f"{system} grid {name!r}: strategy"),
    ):
        if not where:
            continue
        names = sorted({str(m[kind]) for m in block.methods.values()})
        valid = [_settings_of(kind, n) for n in names]
        if any(v is None for v in valid):  # a trainer or strategy that takes any setting
            continue
        takes = sorted(set().union(*[set(v or ()) for v in valid]))
        for key in where:
            if str(key) not in takes:
                raise ValueError(
                    f"{owner} setting {key!r} is taken by none of {system}'s "
                    f"{'strategies' if kind == 'strategy' else 'trainers'} ({', '.join(names)}); their settings "
                    f"are: {', '.join(takes)}"
                )


def grid_rounds(g: DictConfig, system: str) -> int:
    """A grid's rounds: ``rounds``, or ``tasks × rounds_per_task`` for a class-incremental system's grid."""
    return int(g.tasks) * int(g.rounds_per_task) if is_incremental(system) else int(g.rounds)


def grid_target(cfg: DictConfig, system: str, g: DictConfig) -> str | None:
    """The method a grid's paired tests compare against the others: its own ``target``, else ``<system>.target``."""
    target = g.get("target") or cfg[system].get("target")
    return None if target is None else str(target)


def single_round_config(cfg: DictConfig, system: str) -> RoundConfig:
    """One run from the ``trainer`` and ``strategy`` groups on the system's selected grid."""
    block, g = cfg[system], grid(cfg, system)
    trainer = dict(OmegaConf.to_container(cfg.trainer.params, resolve=True))
    # the block's and the grid's trainer settings (as the grid's cells take them) wherever the trainer group
    # holds its library default; the strategy is the strategy group's (a grid's `strategy:` is for its cells)
    from flows.config.defaults import KINDS

    library = KINDS["trainer"](str(cfg.trainer.name))
    shared = {
        **_taken("trainer", str(cfg.trainer.name), block.get("trainer")),
        **_taken("trainer", str(cfg.trainer.name), g.get("trainer")),
    }
    for key, value in shared.items():
        if key not in trainer or trainer[key] == library.get(key):
            trainer[key] = value
    strategy = dict(OmegaConf.to_container(cfg.strategy.params, resolve=True))
    return RoundConfig(
        rounds=grid_rounds(g, system),
        trainer=str(cfg.trainer.name),
        trainer_params=trainer,
        strategy=str(cfg.strategy.name),
        strategy_params=strategy,
        participation=float(g.participation),
        seed=int(cfg.seed),
        device=str(cfg.device),
    )


def is_openset(system: str) -> bool:
    """An open-set system (its declared evaluation): trained on known classes, judged by AUROC and OSCR."""
    return systems.get(system).evaluation == "openset"


def is_incremental(system: str) -> bool:
    """A class-incremental system (its declared evaluation): data in tasks, judged by incremental accuracy."""
    return systems.get(system).evaluation == "incremental"


def method_scores(cfg: DictConfig, system: str, method: str | None, trainer: str) -> List[str]:
    """The unknown scores a method is judged by: its ``scores`` setting, else by its trainer (proser or msp)."""
    if method is not None:
        scores = cfg[system].methods[method].get("scores")
        if scores is not None:
            return [str(s) for s in scores]
    return ["proser"] if trainer == "proser" else ["msp"]


def grid_norm(cfg: DictConfig, system: str, grid_name: str | None = None) -> str:
    """A grid's norm layer: its ``norm``, else the root model's."""
    return str(grid(cfg, system, grid_name).get("norm") or cfg.model.norm)


def grid_model_spec(cfg: DictConfig, system: str, grid_name: str | None = None, *, num_classes: int) -> ModelSpec:
    g = grid(cfg, system, grid_name)
    return ModelSpec(
        name=str(g.model), in_channels=3, num_classes=int(num_classes), norm=grid_norm(cfg, system, grid_name)
    )


def validate_rounds(cfg: DictConfig, system: str) -> None:
    """Every grid's methods exist and build; participation and client counts are possible."""
    from fedcore.models import MODELS

    block = cfg[system]
    for name in block.stages:
        grid(cfg, system, str(name))
    target = block.get("target")
    if target is not None and str(target) not in block.methods:
        raise ValueError(
            f"{system}.target={target!r} is not one of {system}'s methods; valid names are: "
            f"{', '.join(sorted(map(str, block.methods)))}"
        )
    for name, g in block.grids.items():
        if not list(g.methods):
            raise ValueError(
                f"{system} grid {name!r}: methods is empty, so the grid would run nothing; list at least "
                f"one of: {', '.join(sorted(map(str, block.methods)))}"
            )
        if g.get("target") is not None and str(g.target) not in list(map(str, g.methods)):
            raise ValueError(
                f"{system} grid {name!r}: target={g.target!r} is not one of the grid's methods: "
                f"{', '.join(map(str, g.methods))}"
            )
        if str(g.model) not in MODELS:
            raise ValueError(
                f"{system} grid {name!r}: unknown model {g.model!r}; valid names are: {', '.join(MODELS.names())}"
            )
        counts = dict(g.clients_per_domain)
        domains = DOMAIN_SETS.get(str(g.set))
        if domains is None:
            raise ValueError(
                f"{system} grid {name!r}: unknown domain set {g.set!r}; valid names are: {', '.join(DOMAIN_SETS)}"
            )
        _check_domain_names(f"{system} grid {name!r}: clients_per_domain", counts, g.set, domains)
        if any(int(v) < 0 for v in counts.values()) or sum(int(v) for v in counts.values()) < 1:
            raise ValueError(
                f"{system} grid {name!r}: clients_per_domain {counts} must be >= 0 with at least one client"
            )
        if is_openset(system):
            random_split(g, f"{system} grid {str(name)!r}")
        if is_openset(system) and g.get("unknown_sets") is not None:
            _check_unknown_sets(f"{system} grid {str(name)!r}", g.unknown_sets, g.set, domains)
        if is_incremental(system):  # before the rounds (tasks x rounds_per_task) are read: the message names them
            _check_schedule(f"{system} grid {str(name)!r}", g)
        _check_shared_settings(cfg, system, str(name), g)
        for method in g.methods:
            rc = round_config(cfg, system, method=str(method), seed=0, grid_name=str(name))
            closed = int(rc.trainer_params.get("closed_rounds") or 0)
            if closed >= rc.rounds:
                raise ValueError(
                    f"{system} grid {name!r}, method {method!r}: closed_rounds ({closed}) must be below the grid's "
                    f"rounds ({rc.rounds}), or PROSER never trains"
                )
            if is_incremental(system):
                _check_incremental(system, str(name), g, str(method), rc, norm=grid_norm(cfg, system, str(name)))
            if is_openset(system):
                from fedcore.openset.evaluate import check_scores

                check_scores(method_scores(cfg, system, str(method), rc.trainer), dummy=rc.trainer == "proser")


def _check_unknown_sets(where: str, sets: Any, set_name: str, domains: Tuple[str, ...]) -> None:
    """A grid's heterogeneous-unknown scenarios: scenario -> {domain of its set: [unknown classes]}."""
    if not isinstance(sets, DictConfig):
        raise ValueError(f"{where}: unknown_sets is {sets!r}; it maps scenario names to {{domain: [classes]}}")
    for scenario, per_domain in sets.items():
        if not isinstance(per_domain, DictConfig):
            raise ValueError(
                f"{where}: unknown_sets.{scenario} is {per_domain!r}; it maps domains of set {set_name!r} "
                f"({', '.join(domains)}) to lists of unknown classes"
            )
        _check_domain_names(f"{where}: unknown_sets.{scenario}", per_domain, set_name, domains)


def _check_domain_names(what: str, names: Any, set_name: str, domains: Tuple[str, ...]) -> None:
    unknown = sorted(set(map(str, names)) - set(domains))
    if unknown:
        raise ValueError(
            f"{what} names {', '.join(unknown)}, not a domain of set {set_name!r}; its domains are: {', '.join(domains)}"
        )


KNOWN_SPLITS = ("first", "random")


def random_split(g: DictConfig, where: str = "open-set grid") -> bool:
    """Whether an open-set grid draws its known classes per seed (``known_split: random``, the FedPD++
    authors' public FedPD code's evaluation, which also reports max(AUROC, 1 − AUROC)) rather than taking the first
    ``known``."""
    split = str(g.get("known_split") or "first")
    if split not in KNOWN_SPLITS:
        raise ValueError(f"{where}: unknown known_split {split!r}; valid values are: {', '.join(KNOWN_SPLITS)}")
    if split == "random" and (
        not isinstance(g.known, int) or g.get("unknown") is not None or g.get("unknown_sets") is not None
    ):
        raise ValueError(
            f"{where}: known_split: random draws `known` classes by the seed: give known as a count (e.g. 6), "
            "with unknown: null and no unknown_sets (they name classes the draw would change)"
        )
    return split == "random"


def _check_schedule(where: str, g: DictConfig) -> None:
    if not 1 <= int(g.tasks) <= 10:
        raise ValueError(f"{where}: tasks={g.tasks}; the digits have 10 classes, so 1 <= tasks <= 10")
    if int(g.rounds_per_task) < 1 or int(g.clients) < 1:
        raise ValueError(f"{where}: rounds_per_task and clients must be >= 1, got {g.rounds_per_task}, {g.clients}")


def _check_incremental(system: str, name: str, g: DictConfig, method: str, rc: RoundConfig, *, norm: str) -> None:
    """A class-incremental grid's schedule fits its data, and its private methods can be private."""
    where = f"{system} grid {name!r}"
    if rc.trainer != "fcil":
        raise ValueError(
            f"{where}: method {method!r} uses trainer {rc.trainer!r}; class-incremental grids need "
            "trainer fcil (its dual model and exemplars)"
        )
    trainer = rc.make_trainer()
    replace = int(trainer.compress_schedule == "replace")
    if trainer.compress == "distil" and trainer.compress_rounds > int(g.rounds_per_task) - replace:
        raise ValueError(
            f"{where}: compress_rounds ({trainer.compress_rounds}) must be at most rounds_per_task "
            f"({g.rounds_per_task}), and below it with compress_schedule=replace; each task needs a training round"
        )
    if trainer.privacy != "none" and norm == "batch":
        raise ValueError(
            f"{where}: method {method!r} is private ({trainer.privacy}) but the grid's model uses "
            "BatchNorm, which mixes the samples of a batch; set the grid's norm: group"
        )
    if not str(g.model).startswith("dual-"):
        raise ValueError(f"{where}: model {g.model!r}; the fcil trainer needs a dual model (dual-lenet, dual-cnn, ...)")
    if trainer.privacy == "nbafl":
        from fedcore.privacy.nbafl import downlink_needed, exposure_epsilon, planned_uploads

        uploads = planned_uploads(rc.rounds, rc.participation)
        try:
            exposure_epsilon(trainer.epsilon, uploads)
        except ValueError as e:
            raise ValueError(f"{where}: method {method!r}: {e}") from None
        if downlink_needed(rounds=rc.rounds, exposures=uploads, clients=int(g.clients)):
            raise ValueError(
                f"{where}: method {method!r} is NbAFL with {rc.rounds} rounds, {uploads} uploads per "
                f"client and {g.clients} clients: T > L·sqrt(N), where NbAFL needs server-side noise "
                f"too, which is not built. Raise participation (F·sqrt(N) >= 1) or the clients"
            )


def domains_dir(cfg: DictConfig, system: str, grid_name: str | None = None) -> Path:
    return resolve_path(cfg.paths.domains) / system / str(cfg[system].grid if grid_name is None else grid_name)


def _group(group: str, name: str) -> DictConfig:
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        valid = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        raise ValueError(f"unknown {group} {name!r}; valid names are: {', '.join(valid)}")
    return OmegaConf.load(path)


PROJECT_ENV = "FEDCORE_PROJECT_ROOT"


def project_root() -> Path:
    """The folder relative paths of the config are resolved against: the driver's checkout.

    A Ray worker on a node without a checkout imports this module from the code Ray shipped to it
    (``runtime_env``), so its own location says nothing about where the inputs are; the driver passes
    its checkout in ``$FEDCORE_PROJECT_ROOT`` (:func:`flows.services.runtime.ray_init_kwargs`)."""
    return Path(os.environ.get(PROJECT_ENV) or ROOT)


def resolve_path(p: str | Path) -> Path:
    p = Path(p)
    return p if p.is_absolute() else project_root() / p


TRACKING_ENV = "FEDCORE_TRACKING_URI"


def tracking_uri(cfg: DictConfig) -> str:
    """Where a run is tracked: ``flow.tracking_uri``, else ``$FEDCORE_TRACKING_URI`` (a deployment's MLflow
    server, set in the worker's environment so that its runs stay what dvc.yaml records), else the
    project's SQLite file. ``MLFLOW_TRACKING_URI`` is not read: a shell that has it for another project
    must not send fedcore's runs there."""
    return cfg.flow.tracking_uri or os.environ.get(TRACKING_ENV) or f"sqlite:///{project_root() / 'mlruns.db'}"
