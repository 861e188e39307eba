"""One registry helper so every component chosen by name fails the same, helpful way."""

from __future__ import annotations

from typing import Callable, Dict, Generic, TypeVar

T = TypeVar("T")


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
            raise ValueError(
                f"unknown {self.kind} {name!r}; valid names are: {', '.join(self.names())}"
            ) from None

    def create(self, name: str, **kwargs) -> T:
        return self.get(name)(**kwargs)

    def __contains__(self, name: str) -> bool:
        return name in self._items
