"""Compose the Hydra config (conf/) and turn it into fedcore's typed settings.

Three ways in, one source of truth:
* ``python -m flows.run arrival method=tent aggregator=ugsa`` composes conf/ with Hydra overrides;
* ``dvc repro`` runs the stages on ``params.yaml``, which is conf/ composed with no overrides;
* ``dvc exp run -S method=tent`` (DVC's Hydra integration) recomposes params.yaml from conf/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from omegaconf import DictConfig, OmegaConf

from fedcore.data.corruptions import CORRUPTION_NAMES
from fedcore.engine import ArrivalConfig, ModelSpec, PretrainConfig

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"
PARAMS = ROOT / "params.yaml"


def compose(overrides: List[str] | None = None) -> DictConfig:
    """conf/config.yaml composed with Hydra ``overrides`` (e.g. ``["method=tent", "seed=1"]``)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=list(overrides or []))
    validate(cfg)
    return cfg


def load(params_file: str | Path | None = None, overrides: List[str] | None = None) -> DictConfig:
    """``params.yaml`` (what DVC tracks) plus dot-list overrides; without a file, compose conf/."""
    if params_file is None:
        return compose(overrides)
    path = Path(params_file)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; regenerate it with `make params`")
    cfg = OmegaConf.load(path)
    if overrides:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    validate(cfg)
    return cfg


def to_dict(cfg: DictConfig) -> Dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def validate(cfg: DictConfig) -> None:
    """Reject impossible values with a message that says what would be valid."""
    d = cfg.data
    if d.stream_order not in ("shuffled", "class_sorted"):
        raise ValueError(f"data.stream_order={d.stream_order!r}; valid values are: shuffled, class_sorted")
    if len(d.corruptions) > len(CORRUPTION_NAMES):
        raise ValueError(f"{len(d.corruptions)} target clients asked for, but only {len(CORRUPTION_NAMES)} "
                         f"corruption domains exist: {', '.join(CORRUPTION_NAMES)}")
    bad = [c for c in d.corruptions if c not in CORRUPTION_NAMES]
    if bad:
        raise ValueError(f"unknown corruption(s) {bad}; valid names are: {', '.join(CORRUPTION_NAMES)}")
    if not 1 <= int(d.severity) <= 5:
        raise ValueError(f"data.severity must be in 1..5, got {d.severity}")
    pretrain_config(cfg)
    arrival_config(cfg)  # checks method, aggregator, lr, gamma, beta, passes


def model_spec(cfg: DictConfig) -> ModelSpec:
    return ModelSpec(name=cfg.model.name, in_channels=int(cfg.data.in_channels),
                     num_classes=int(cfg.data.num_classes), norm=cfg.model.norm)


def pretrain_config(cfg: DictConfig) -> PretrainConfig:
    p = cfg.pretrain
    return PretrainConfig(rounds=int(p.rounds), local_epochs=int(p.local_epochs), lr=float(p.lr),
                          batch_size=int(p.batch_size), momentum=float(p.momentum),
                          weight_decay=float(p.weight_decay), augment=bool(p.augment), seed=int(cfg.seed),
                          device=str(cfg.device))


def arrival_config(cfg: DictConfig, *, method: str | None = None, aggregator: str | None = None,
                   seed: int | None = None) -> ArrivalConfig:
    """The arrival settings; ``method``/``aggregator``/``seed`` pick a sweep cell (its defaults from conf/)."""
    mcfg = cfg.method if method is None or method == cfg.method.name else _group("method", method)
    acfg = cfg.aggregator if aggregator is None or aggregator == cfg.aggregator.name else _group("aggregator", aggregator)
    a = cfg.adapt
    return ArrivalConfig(
        method=str(mcfg.name), method_params=dict(OmegaConf.to_container(mcfg.params, resolve=True)),
        aggregator=str(acfg.name), aggregator_params=dict(OmegaConf.to_container(acfg.params, resolve=True)),
        passes=int(a.passes), order=None if a.order is None else list(a.order), batch_size=int(a.batch_size),
        seed=int(cfg.seed if seed is None else seed), device=str(cfg.device),
    )


def _group(group: str, name: str) -> DictConfig:
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        valid = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        raise ValueError(f"unknown {group} {name!r}; valid names are: {', '.join(valid)}")
    return OmegaConf.load(path)


def resolve_path(p: str | Path) -> Path:
    p = Path(p)
    return p if p.is_absolute() else ROOT / p


def tracking_uri(cfg: DictConfig) -> str:
    return cfg.flow.tracking_uri or f"sqlite:///{ROOT / 'mlruns.db'}"
