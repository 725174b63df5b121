"""Observer protocol and registry.

An observer watches one tensor during calibration and turns what it saw into ``(scale, offset)`` for
its :class:`~fxq.spec.TensorQuantConfig`. Observers that need a histogram range first declare
``passes = 2``: :func:`fxq.calibrate` then runs the data twice and calls :meth:`Observer.next_pass`
in between. Statistics stay on the tensor's device; nothing syncs with the host until
:meth:`compute_qparams`.
"""
from __future__ import annotations

import torch

from fxq.errors import ObserverError
from fxq.registry import Registry
from fxq.spec import TensorQuantConfig

__all__ = ["Observer", "OBSERVERS", "register_observer", "build_observer", "channel_rows"]

OBSERVERS: Registry[type["Observer"]] = Registry("observer")


def register_observer(name: str, *, override: bool = False):
    """Class decorator: make an :class:`Observer` subclass available under ``name`` in settings."""

    def deco(cls: type[Observer]) -> type[Observer]:
        cls.name = name
        OBSERVERS.register(name, cls, override=override)
        return cls

    return deco


def build_observer(config: TensorQuantConfig, where: str = "") -> "Observer":
    """Instantiate the observer named by ``config.observer``."""
    return OBSERVERS.get(config.observer)(config, where=where)


def channel_rows(x: torch.Tensor, config: TensorQuantConfig) -> torch.Tensor:
    """``x`` as a 2-D ``[channels, values]`` view for per-channel configs, ``[1, values]`` otherwise."""
    x = x.detach()
    if not config.per_channel:
        return x.reshape(1, -1)
    axis = config.channel_axis % x.dim()
    return x.movedim(axis, 0).reshape(x.shape[axis], -1)


class Observer:
    """Base class; subclasses implement :meth:`observe` and :meth:`compute_qparams`.

    Args:
        config: the config whose parameters this observer computes (read-only here).
        where: a label for error messages (the quantizer's name in the graph).
    """

    name = "observer"
    passes = 1
    nonnegative = False
    """Set by calibration when the op producing the observed tensor cannot output a negative value (a ReLU, a clip
    at 0, a sigmoid): observers may skip the lower tail, since :func:`fxq.functional.qparams_from_minmax` takes
    ``min(low, 0)``, 0 for such a tensor whatever its statistics say."""
    bounded = False
    """Set by calibration when the op producing the observed tensor bounds its output (a softmax or sigmoid in
    [0, 1], a tanh, a clip at both ends): no outlier can inflate its range, and its extremes are the signal (an
    attention's peak probabilities), so observers that clip tails (percentile) take each batch's extremes instead
    of ranking its tails (averaged over batches as the percentiles are)."""
    keeps_max = False
    """Set by calibration when the observed tensor is read only by softmaxes, argmaxes or maxes (logits, an
    attention's scores): each row's largest values decide them (the winning class, the attended key), and they are
    a tiny share of the tensor, so observers that clip tails (percentile) keep each batch's maximum instead of
    ranking the upper tail."""

    def __init__(self, config: TensorQuantConfig, where: str = "") -> None:
        self.config = config
        self.where = where
        self.pass_index = 0
        self.num_observed = 0

    def observe(self, x: torch.Tensor) -> None:
        """Record statistics of one batch (no grad, stays on device)."""
        raise NotImplementedError

    def next_pass(self) -> None:
        """Called by calibration between passes over the data."""
        self.pass_index += 1

    def compute_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(scale, offset)`` as 1-D float32 tensors."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget everything observed; options given at construction (``self.options``) are kept."""
        self.__init__(self.config, self.where, **getattr(self, "options", {}))

    # helpers for subclasses -----------------------------------------------------------
    def _label(self) -> str:
        return f"observer {self.name!r}" + (f" at {self.where!r}" if self.where else "")

    def _require_data(self) -> None:
        if self.num_observed == 0:
            raise ObserverError(
                f"{self._label()} saw no data; run calibration batches through the model before "
                f"computing parameters"
            )

    def _require_finite(self, *stats: torch.Tensor) -> None:
        for t in stats:
            if not bool(torch.isfinite(t).all()):
                raise ObserverError(
                    f"{self._label()} saw NaN or Inf values; check the calibration data and the layers "
                    f"before this tensor"
                )
