"""Min/max observers: running extremes (``minmax``) and their exponential moving average (``ema``)."""
from __future__ import annotations

import torch

from fxq.functional import qparams_from_minmax
from fxq.observers.base import Observer, channel_rows, register_observer


@register_observer("minmax")
class MinMaxObserver(Observer):
    """Scale from the extremes of everything observed (per tensor or per channel)."""

    def __init__(self, config, where: str = "") -> None:
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
