"""The systems on the platform, each declared once (:class:`~flows.systems.base.System`).

Every module in this package declares one system as ``SYSTEM``; they are registered when the
package is imported. A system that lives elsewhere (a plug-in, a test) calls :func:`register`.

    >>> from flows import systems
    >>> systems.get("fedpad").evaluation
    'domains'
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Dict, List

from flows.systems.base import ENGINES, System

_SYSTEMS: Dict[str, System] = {}


def register(system: System, *, replace: bool = False) -> System:
    """Add ``system`` to the platform; a second system under one name is refused unless ``replace``."""
    if not replace and system.name in _SYSTEMS and _SYSTEMS[system.name] is not system:
        raise ValueError(
            f"a system named {system.name!r} is already registered ({_SYSTEMS[system.name].title}); choose another name"
        )
    _SYSTEMS[system.name] = system
    return system


def unregister(name: str) -> None:
    """Remove a system: the registry holds a plug-in's system for the life of the process otherwise."""
    _SYSTEMS.pop(name, None)


def get(name: str) -> System:
    """The system called ``name``; an unknown name lists the valid ones."""
    if name not in _SYSTEMS:
        raise ValueError(f"unknown system {name!r}; valid names are: {', '.join(sorted(_SYSTEMS))}")
    return _SYSTEMS[name]


def names(engine: str | None = None) -> List[str]:
    """Every registered system's name (those of one ``engine`` if given), sorted."""
    if engine is not None and engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; valid names are: {', '.join(ENGINES)}")
    return sorted(n for n, s in _SYSTEMS.items() if engine is None or s.engine == engine)


def all_systems() -> List[System]:
    return [_SYSTEMS[n] for n in names()]


def load_plugins(modules) -> None:
    """Import each of ``modules`` (the config's ``plugins``): a plug-in registers its systems, strategies,
    trainers or evaluations when it is imported. Importing one twice does nothing more."""
    if isinstance(modules, str):  # plugins=mypkg.mysystem, without brackets
        modules = [modules]
    for name in modules or ():
        try:
            importlib.import_module(str(name))
        except ImportError as exc:
            raise ValueError(
                f"plugins: cannot import {name!r} ({exc}); list modules importable from the "
                "repository root (e.g. plugins=[mypackage.mysystem])"
            ) from exc


def configured_plugins(overrides=()) -> List[str]:
    """The plug-ins a run names before its config is composed: ``plugins=[...]`` among ``overrides``, and
    ``plugins`` in conf/config.yaml; each is imported (:func:`load_plugins`)."""
    import yaml

    found: List[str] = []
    root = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf" / "config.yaml").read_text()) or {}
    values = [root.get("plugins") or []]
    values += [yaml.safe_load(o.split("=", 1)[1]) for o in overrides if o.split("=", 1)[0].lstrip("+") == "plugins"]
    for value in values:
        value = [value] if isinstance(value, str) else list(value or [])
        load_plugins(value)
        found += [str(v) for v in value if str(v) not in found]
    return found


def _discover() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.name != "base":
            module = importlib.import_module(f"{__name__}.{info.name}")
            register(module.SYSTEM)


_discover()

__all__ = ["System", "register", "unregister", "get", "names", "all_systems", "load_plugins"]
