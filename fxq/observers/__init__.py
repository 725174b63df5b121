"""Observers: statistics of a tensor -> quantization parameters. Extend with ``register_observer``."""
from fxq.observers import minmax  # noqa: F401  (registers)
from fxq.observers.base import OBSERVERS, Observer, build_observer, channel_rows, register_observer

__all__ = ["Observer", "OBSERVERS", "register_observer", "build_observer", "channel_rows"]
