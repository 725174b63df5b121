"""Percentile observer: clip the extreme ``1 - p`` of each tail, per batch, averaged over batches."""
from __future__ import annotations

import logging
import math

import torch

from fxq.errors import ConfigError
from fxq.functional import qparams_from_minmax
from fxq.observers.base import Observer, channel_rows, register_observer
from fxq.spec import TensorQuantConfig

__all__ = ["PercentileObserver"]

logger = logging.getLogger(__name__)

_TOPK_LIMIT = 4096
"""Up to this many values per tail, ranked by :func:`_tails` (it gives the extremes too); beyond, ``kthvalue``."""

_BLOCK = 64
"""Values per block in :func:`_tails`' first pass (longer blocks: fewer candidates to rank, more to gather)."""


def _tails(rows: torch.Tensor, k: int, lower: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``k`` largest (descending) and ``k`` smallest (ascending) values of every row, exactly (the smallest only
    when ``lower``, else None).

    ``topk`` over a long row is slow (single-threaded partial sort: ~170 ms for 9.6 M values at k = 964).
    Instead, cut each row into blocks, take every block's max (min), and rank only the ``k`` blocks with
    the largest maxima (smallest minima). This is exact: those ``k`` blocks hold ``k`` distinct values
    ``>= t`` (``t``, the k-th largest block max), so the k-th largest value of the row is ``>= t``, while a
    block left out has all its values ``<= t``; ties at ``t`` are equal values, whichever block they come
    from. Cost: two reductions over the row plus ``topk`` over ``n / 64`` maxima and ``64 k`` candidates.
    """
    c, n = rows.shape
    block = min(_BLOCK, n // (8 * k))
    if block < 8:  # short rows: ranking everything is as cheap
        return (torch.topk(rows, k, dim=1, largest=True, sorted=True).values,
                torch.topk(rows, k, dim=1, largest=False, sorted=True).values if lower else None)
    r = n // block
    blocks = rows[:, : r * block].view(c, r, block)
    rest = rows[:, r * block :]
    tails = []
    # amax and amin separately: one fused aminmax over a short inner dimension is ~3x slower on CPU.
    for reduce, largest in ((torch.amax, True), (torch.amin, False))[:2 if lower else 1]:
        chosen = torch.topk(reduce(blocks, dim=2), k, dim=1, largest=largest, sorted=False).indices
        candidates = torch.gather(blocks, 1, chosen.unsqueeze(-1).expand(c, k, block)).reshape(c, k * block)
        candidates = torch.cat([candidates, rest], dim=1)
        tails.append(torch.topk(candidates, k, dim=1, largest=largest, sorted=True).values)
    return tails[0], tails[1] if lower else None


@register_observer("percentile")
class PercentileObserver(Observer):
    """Range ``[P_(1-p), P_p]`` of each batch (nearest-rank percentiles), averaged over batches.

    For every batch and every row (the whole tensor, or one channel), the upper bound is the
    ``ceil(p * n)``-th smallest value and the lower bound its mirror from the top; the bounds of all
    batches are averaged and turned into ``(scale, offset)`` by :func:`fxq.functional.qparams_from_minmax`
    (symmetric configs use the larger magnitude of the two). Statistics stay on the tensor's device.

    Args:
        config: the config whose parameters this observer computes.
        where: label for error messages.
        percentile: ``p`` in ``(0.5, 1]``; PPQ's default 0.9999.

    Raises:
        ConfigError: for ``p`` outside ``(0.5, 1]``.
        ObserverError: (at :meth:`compute_qparams`) nothing observed, or NaN/Inf in the data.

    Example:
        >>> obs = PercentileObserver(TensorQuantConfig(), percentile=0.999)
        >>> obs.observe(torch.randn(10000)); scale, offset = obs.compute_qparams()
    """

    def __init__(self, config: TensorQuantConfig, where: str = "", percentile: float = 0.9999) -> None:
        super().__init__(config, where)
        p = float(percentile)
        if not 0.5 < p <= 1.0:
            raise ConfigError(f"percentile observer: percentile={percentile} must be in (0.5, 1], e.g. 0.9999")
        self.percentile = p
        self.options = {"percentile": p}
        self._sum_lo: torch.Tensor | None = None
        self._sum_hi: torch.Tensor | None = None
        self._min: torch.Tensor | None = None  # extremes: only to detect NaN/Inf lazily
        self._max: torch.Tensor | None = None

    def _tail_count(self, n: int) -> int:
        """How many values from the top the upper percentile sits (1 = the maximum)."""
        rank = math.ceil(self.percentile * n - 1e-9)  # nearest rank of P_p, 1-based
        return max(1, min(n, n - rank + 1))

    @torch.no_grad()
    def observe(self, x: torch.Tensor) -> None:
        rows = channel_rows(x, self.config).float()
        n = rows.shape[1]
        if n == 0:
            return
        k = self._tail_count(n)
        if self.bounded:  # a softmax's, a sigmoid's output: its extremes are the signal, not outliers (no ranking)
            mn, mx = (None, rows.amax(dim=1)) if self.nonnegative else torch.aminmax(rows, dim=1)
            lo, hi = mn, mx
        elif k <= _TOPK_LIMIT:
            top, bottom = _tails(rows, k, lower=not self.nonnegative)
            hi, mx = top[:, -1], top[:, 0]
            lo, mn = (bottom[:, -1], bottom[:, 0]) if bottom is not None else (None, None)
        else:
            hi = torch.kthvalue(rows, n - k + 1, dim=1).values
            lo = None if self.nonnegative else torch.kthvalue(rows, k, dim=1).values
            mn, mx = (None, rows.amax(dim=1)) if self.nonnegative else torch.aminmax(rows, dim=1)
        if self.keeps_max:  # a softmax's or an argmax's input: its peaks decide it
            hi = mx
        if lo is None:  # a ReLU's output and the like: the range starts at 0 whatever the lower tail holds
            lo = mn = torch.zeros_like(hi)
        if self._sum_lo is None:
            self._sum_lo, self._sum_hi, self._min, self._max = lo, hi, mn, mx
        else:
            self._sum_lo = self._sum_lo + lo
            self._sum_hi = self._sum_hi + hi
            self._min = torch.minimum(self._min, mn)
            self._max = torch.maximum(self._max, mx)
        self.num_observed += 1

    def compute_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._require_data()
        self._require_finite(self._min, self._max)
        lo = (self._sum_lo / self.num_observed).cpu()
        hi = (self._sum_hi / self.num_observed).cpu()
        logger.debug("%s: range [%s, %s] over %d batches", self._label(), lo, hi, self.num_observed)
        return qparams_from_minmax(lo, hi, self.config)
