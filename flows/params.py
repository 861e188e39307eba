"""Regenerate params.yaml from conf/ (``make params``); ``--check`` fails if they differ."""

from __future__ import annotations

import sys

from omegaconf import OmegaConf

from flows.config import PARAMS, compose

HEADER = "# Generated from conf/ by `make params`: edit conf/, not this file.\n"


def render() -> str:
    return HEADER + OmegaConf.to_yaml(compose([], lay_variant=False))


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        ok = PARAMS.is_file() and PARAMS.read_text() == text
        print("params.yaml matches conf/" if ok else "params.yaml differs from conf/: run `make params`")
        sys.exit(0 if ok else 1)
    PARAMS.write_text(text)
    print(f"wrote {PARAMS}")
