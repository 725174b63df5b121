"""The one registry type behind every extension point (platform, observer, exporter, op converter)."""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from fxq.errors import RegistryError

T = TypeVar("T")

__all__ = ["Registry"]


class Registry(Generic[T]):
    """A name -> object table, extended by decorator.

    Names are case-insensitive. Registering a taken name raises unless ``override=True``;
    a failed lookup lists what is registered.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    @staticmethod
    def _key(name: str) -> str:
        return str(name).lower()

    def register(self, name: str, obj: T | None = None, *, override: bool = False):
        """Register ``obj`` under ``name``; without ``obj``, return a decorator that does."""

        def add(item: T) -> T:
            key = self._key(name)
            if key in self._items and not override:
                raise RegistryError(
                    f"{self.kind} {name!r} is already registered; pass override=True to replace it"
                )
            self._items[key] = item
            return item

        if obj is not None:
            return add(obj)
        return add

    def get(self, name: str) -> T:
        try:
            return self._items[self._key(name)]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "(none)"
            raise RegistryError(f"unknown {self.kind} {name!r}; registered: {known}") from None

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._key(name) in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def names(self) -> list[str]:
        return sorted(self._items)

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._items.items())

    def decorator(self) -> Callable[..., Callable[[T], T]]:
        def deco(name: str, *, override: bool = False) -> Callable[[T], T]:
            return self.register(name, override=override)

        return deco
