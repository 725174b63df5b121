"""Min/max observers: running extremes (``minmax``) and their exponential moving average (``ema``)."""
from __future__ import annotations

import torch

from fxq.errors import ConfigError
from fxq.functional import qparams_from_minmax
from fxq.observers.base import Observer, channel_rows, register_observer
from fxq.spec import TensorQuantConfig


@register_observer("minmax")
class MinMaxObserver(Observer):
    """Scale from the extremes of everything observed (per tensor or per channel)."""

    def __init__(self, config: TensorQuantConfig, where: str = "") -> None:
        super().__init__(config, where)
        self.min_val: torch.Tensor | None = None
        self.max_val: torch.Tensor | None = None

    @torch.no_grad()
    def observe(self, x: torch.Tensor) -> None:
        lo, hi = torch.aminmax(channel_rows(x, self.config).float(), dim=1)
        self._update(lo, hi)
        self.num_observed += 1

    def _update(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        if self.min_val is None:
            self.min_val, self.max_val = lo, hi
        else:
            self.min_val = torch.minimum(self.min_val, lo)
            self.max_val = torch.maximum(self.max_val, hi)

    def compute_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._require_data()
        self._require_finite(self.min_val, self.max_val)
        return qparams_from_minmax(self.min_val.cpu(), self.max_val.cpu(), self.config)


@register_observer("ema")
class EMAMinMaxObserver(MinMaxObserver):
    """Exponential moving average of per-batch min/max (per tensor or per channel), for QAT.

    ``m <- momentum * m + (1 - momentum) * batch``; the first batch sets ``m``. A NaN/Inf batch poisons the
    average, so it is reported at :meth:`compute_qparams` without a host sync per batch.

    Args:
        config: the config whose parameters this observer computes.
        where: label for error messages.
        momentum: weight of the history, in ``[0, 1)`` (0 = last batch only).

    Raises:
        ConfigError: for a momentum outside ``[0, 1)``.

    Example:
        >>> obs = EMAMinMaxObserver(TensorQuantConfig(), momentum=0.99)
        >>> obs.observe(torch.randn(64)); scale, offset = obs.compute_qparams()
    """

    def __init__(self, config: TensorQuantConfig, where: str = "", momentum: float = 0.9) -> None:
        super().__init__(config, where)
        momentum = float(momentum)
        if not 0.0 <= momentum < 1.0:
            raise ConfigError(f"ema observer: momentum={momentum} must be in [0, 1); 0.9..0.99 is typical")
        self.momentum = momentum
        self.options = {"momentum": momentum}

    def _update(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        if self.min_val is None:
            self.min_val, self.max_val = lo, hi
        else:
            self.min_val = torch.lerp(lo, self.min_val, self.momentum)
            self.max_val = torch.lerp(hi, self.max_val, self.momentum)
