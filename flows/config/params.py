"""Regenerate params.yaml from conf/ (``make params``); ``--check`` fails if they differ."""

from __future__ import annotations

import re
import sys

import yaml
from omegaconf import DictConfig, OmegaConf

from flows.config.compose import PARAMS, ROOT, compose

HEADER = "# Generated from conf/ by `make params`: edit conf/, not this file.\n"


def check_stage_keys(cfg: DictConfig, dvc_yaml: str) -> None:
    """Refuse a stage key that DVC cannot address: every ``foreach: ${a.b}`` stage names its params
    ``a.b.<key>``, and DVC splits that path at each dot, so ``cell-c0.1`` would be read as
    ``cell-c0`` then ``1`` and the stage would fail only when run."""
    for name, stage in (yaml.safe_load(dvc_yaml).get("stages") or {}).items():
        ref = re.fullmatch(r"\$\{([\w.]+)\}", str(stage.get("foreach", "")))
        if not ref:
            continue
        bad = [str(k) for k in OmegaConf.select(cfg, ref.group(1)) or {} if "." in str(k)]
        if bad:
            raise ValueError(
                f"{ref.group(1)} has keys with a dot: {bad}; DVC reads a dot in stage {name!r}'s "
                f"params path as a separator. Rename them without dots (e.g. c0.1 -> c1e-1) in conf/"
            )


def render() -> str:
    cfg = compose([], lay_variant=False)
    check_stage_keys(cfg, (ROOT / "dvc.yaml").read_text())
    return HEADER + OmegaConf.to_yaml(cfg)


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        ok = PARAMS.is_file() and PARAMS.read_text() == text
        print("params.yaml matches conf/" if ok else "params.yaml differs from conf/: run `make params`")
        sys.exit(0 if ok else 1)
    PARAMS.write_text(text)
    print(f"wrote {PARAMS}")
