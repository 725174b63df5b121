"""Observers: statistics of a tensor -> quantization parameters. Extend with ``register_observer``.

Registered names (used in settings): ``minmax``, ``ema``, ``percentile``, ``kl``, ``mse``, ``isotone``,
``floating``. Every public module of this package is imported here, so its ``@register_observer`` classes are
registered: adding an observer is adding its file.
"""

from fxq.observers.base import OBSERVERS, Observer, build_observer, channel_rows, register_observer
from fxq.registry import import_submodules

__all__ = ["Observer", "OBSERVERS", "register_observer", "build_observer", "channel_rows"]



import_submodules(__name__, __path__, exclude=("base",))  # their decorators register the observers
