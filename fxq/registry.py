"""The one registry type behind every extension point (platform, observer, exporter, op converter, algorithm)."""
from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import Callable, Generic, Iterable, Iterator, TypeVar

from fxq.errors import ConfigError, RegistryError

T = TypeVar("T")

__all__ = ["Registry", "close_names", "import_submodules"]


def import_submodules(package: str, path: Iterable[str], *, packages_only: bool = False,
                      exclude: Iterable[str] = ()) -> None:
    """Import every public module (or only subpackage) of ``package`` found in ``path``, sorted by name: their
    decorators register what they define, so adding a built-in extension is adding its file."""
    skip = set(exclude)
    for info in sorted(pkgutil.iter_modules(list(path)), key=lambda m: m.name):
        if not info.name.startswith("_") and info.name not in skip and (info.ispkg or not packages_only):
            importlib.import_module(f"{package}.{info.name}")


def close_names(name: str, known: Iterable[str]) -> str:
    """``" (did you mean 'a', 'b'?)"`` for the known names closest to ``name``, or ``""``: every "unknown name"
    message in fxq ends with the same hint."""
    near = difflib.get_close_matches(str(name), list(known), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(repr(n) for n in near)}?)" if near else ""


class Registry(Generic[T]):
    """A name -> object table, extended by decorator.

    Names are case-insensitive. Registering a taken name raises unless ``override=True``;
    a failed lookup names the closest registered names and lists them all.
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

    def unregister(self, name: str) -> T:
        """Remove and return what ``name`` holds (a test's or a plugin's temporary entry); a miss raises
        :class:`~fxq.errors.RegistryError`."""
        item = self.get(name)
        del self._items[self._key(name)]
        return item

    def unknown(self, name: str, where: str | None = None) -> str:
        """The message for a name that is not registered: ``where`` (e.g. ``setting.dispatcher``) names who asked."""
        shown = repr(name) if isinstance(name, str) else f"a {type(name).__name__} (a name was expected)"
        shown = shown if len(shown) <= 120 else shown[:117] + "..."
        head = f"{where}={shown} is not a registered {self.kind}" if where else f"unknown {self.kind} {shown}"
        known = ", ".join(self.names()) or "(none)"
        hint = close_names(name, self.names()) if isinstance(name, str) else ""
        return f"{head}{hint}; registered: {known}"

    def get(self, name: str) -> T:
        """The object registered under ``name``; a miss raises :class:`~fxq.errors.RegistryError` with the closest
        names."""
        try:
            return self._items[self._key(name)]
        except KeyError:
            raise RegistryError(self.unknown(name)) from None

    def require(self, name: str, where: str) -> T:
        """:meth:`get` for a name a user wrote in a setting: a miss is a :class:`~fxq.errors.ConfigError` naming
        ``where``."""
        if name not in self:
            raise ConfigError(self.unknown(name, where))
        return self._items[self._key(name)]

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
