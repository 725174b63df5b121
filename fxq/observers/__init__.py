"""Observers: statistics of a tensor -> quantization parameters. Extend with ``register_observer``.

Registered names (used in settings): ``minmax``, ``ema``, ``percentile``, ``kl``, ``mse``, ``isotone``,
``floating``. Every public module of this package is imported here, so its ``@register_observer`` classes are
registered: adding an observer is adding its file.
"""
import importlib
import pkgutil

from fxq.observers.base import OBSERVERS, Observer, build_observer, channel_rows, register_observer

__all__ = ["Observer", "OBSERVERS", "register_observer", "build_observer", "channel_rows"]



def _import_observer_modules() -> None:
    """Import every public module of this package (alphabetically): their decorators register the observers."""
    for name in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        if not name.startswith("_") and name != "base":
            importlib.import_module(f"{__name__}.{name}")


_import_observer_modules()
