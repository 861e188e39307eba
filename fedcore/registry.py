"""One registry helper so every component chosen by name fails the same, helpful way."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Generic, List, TypeVar, cast

T = TypeVar("T")


def signature_defaults(fn: Callable[..., Any]) -> Dict[str, Any]:
    """Each keyword argument of ``fn`` that has a default, with the default."""
    return {
        p.name: p.default
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is not p.empty and p.name != "self"
    }


def check_choice(what: str, value: str, choices) -> str:
    """``value`` if it is one of ``choices``; else a ValueError naming the valid ones."""
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; use one of {', '.join(choices)}")
    return value


class Registry(Generic[T]):
    """A name -> factory dict whose lookups list the valid names on a miss.

    Parameters
    ----------
    kind:
        What the registry holds ("adaptation method", "aggregator", ...), used in error messages.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: Dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def deco(fn: Callable[..., T]) -> Callable[..., T]:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = fn
            return fn

        return deco

    def names(self) -> list[str]:
        return sorted(self._items)

    def get(self, name: str) -> Callable[..., T]:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; valid names are: {', '.join(self.names())}") from None

    def _inits(self, name: str) -> List[Callable[..., Any]]:
        """What building ``name`` calls with its settings: the factory, or a class's ``__init__`` and, where it
        passes ``**kwargs`` up, its parents' (nearest first)."""
        factory = self.get(name)
        if not inspect.isclass(factory):
            return [factory]
        return [
            c.__dict__["__init__"] for c in cast(type, factory).__mro__ if "__init__" in c.__dict__ and c is not object
        ]

    def settings(self, name: str) -> List[str] | None:
        """The keyword settings ``name`` accepts; ``None`` when its factory takes any (``**kwargs``)."""
        inits = self._inits(name)
        names: set[str] = set()
        for fn in inits:
            params = list(inspect.signature(fn).parameters.values())
            names.update(
                p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"
            )
            if not any(p.kind is p.VAR_KEYWORD for p in params):
                return sorted(names)
        return None if inits else []  # every __init__ passed **kwargs on (or there is none: no settings)

    def defaults(self, name: str) -> Dict[str, Any]:
        """Each setting of ``name`` that has a default, with it (a class's own default before its parents'):
        the one place a library default is written, which the config names rather than repeats."""
        out: Dict[str, Any] = {}
        for fn in self._inits(name):
            for key, value in signature_defaults(fn).items():
                out.setdefault(key, value)
            if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()):
                break
        return out

    def create(self, name: str, **kwargs) -> T:
        """Build ``name`` with ``kwargs``; a setting it does not take is an error naming the valid ones."""
        valid = self.settings(name)
        unknown = [] if valid is None else sorted(set(kwargs) - set(valid))
        if unknown:
            raise ValueError(
                f"{self.kind} {name!r} has no setting {', '.join(map(repr, unknown))}; valid settings "
                f"are: {', '.join(valid) if valid else '(none)'}"
            )
        return self.get(name)(**kwargs)

    def __contains__(self, name: str) -> bool:
        return name in self._items
