"""``${default:<kind>}`` in conf/: a setting whose value is the library's default, written once, on the class.

A config group file lists every setting of its component, so that each can be set on the command line
(``trainer.params.beta=2``) and each has its comment, but it writes a value only where the experiment
chooses one; every other setting names the library's default::

    name: proser
    params:
      beta: ${default:trainer}   # the default of ProserTrainer's ``beta``
      importance: dpi            # a choice: FedPD++'s masks (the trainer's own default is plain PROSER)

``<kind>`` is ``trainer``, ``strategy``, ``aggregator`` or ``method``, whose component is the group's
``name`` beside ``params`` (or a second argument, ``${default:trainer,sgd}``), or ``privacy`` (the
fields of :class:`fedcore.privacy.PrivacyConfig`). The interpolations are resolved as soon as conf/ is
composed, so ``params.yaml``, MLflow and the flows see plain values.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict

from omegaconf import Node, OmegaConf


def _privacy_defaults(_: str | None) -> Dict[str, Any]:
    from fedcore.privacy import PrivacyConfig

    return {f.name: f.default for f in dataclasses.fields(PrivacyConfig) if f.default is not dataclasses.MISSING}


def _method_defaults(name: str | None) -> Dict[str, Any]:
    from fedcore.adapt import method_settings

    return {k: p.default for k, p in method_settings(str(name)).items() if p.default is not p.empty}


def _registry_defaults(kind: str) -> Callable[[str | None], Dict[str, Any]]:
    def defaults(name: str | None) -> Dict[str, Any]:
        if kind == "trainer":
            import fedcore.train  # noqa: F401 - registers the trainers
            from fedcore.train.base import TRAINERS as registry
        elif kind == "strategy":
            import fedcore.aggregate  # noqa: F401 - registers the strategies
            from fedcore.aggregate.base import STRATEGIES as registry
        else:
            from fedcore.aggregate import AGGREGATORS as registry
        return registry.defaults(str(name))

    return defaults


KINDS: Dict[str, Callable[[str | None], Dict[str, Any]]] = {
    "trainer": _registry_defaults("trainer"),
    "strategy": _registry_defaults("strategy"),
    "aggregator": _registry_defaults("aggregator"),
    "method": _method_defaults,
    "privacy": _privacy_defaults,
}


def library_default(kind: str, name: str | None = None, *, _node_: Node, _parent_: Node) -> Any:
    """The resolver behind ``${default:<kind>[,<name>]}``: the default of the setting this node is."""
    if kind not in KINDS:
        raise ValueError(f"${{default:{kind}}}: unknown kind {kind!r}; valid kinds are: {', '.join(KINDS)}")
    key = str(_node_._key())
    if name is None and kind != "privacy":
        group = _parent_._get_parent()  # the group's node: its `name` beside the `params` this key is in
        name = None if group is None else OmegaConf.select(group, "name")  # type: ignore[arg-type]
        if name is None:
            raise ValueError(
                f"${{default:{kind}}} at {_node_._get_full_key(None)}: no `name` beside its params says which "
                f"{kind}; name it: ${{default:{kind},<name>}}"
            )
    defaults = KINDS[kind](name)
    if key not in defaults:
        raise ValueError(
            f"{_node_._get_full_key(None)}: {kind} {name or ''} has no default for {key!r}; write a value. Its "
            f"defaults are: {', '.join(sorted(defaults)) or '(none)'}"
        )
    return defaults[key]


def register() -> None:
    """Make ``${default:...}`` known to OmegaConf (idempotent)."""
    if not OmegaConf.has_resolver("default"):
        OmegaConf.register_new_resolver("default", library_default)
