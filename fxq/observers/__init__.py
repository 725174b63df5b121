"""Observers: statistics of a tensor -> quantization parameters. Extend with ``register_observer``.

Registered names (used in settings): ``minmax``, ``ema``, ``percentile``, ``kl``, ``mse``, ``isotone``,
``floating``.
"""
from fxq.observers import floating, isotone, kl, minmax, mse, percentile  # noqa: F401  (registers)
from fxq.observers.base import OBSERVERS, Observer, build_observer, channel_rows, register_observer

__all__ = ["Observer", "OBSERVERS", "register_observer", "build_observer", "channel_rows"]
