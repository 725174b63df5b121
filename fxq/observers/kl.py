"""Entropy (KL-divergence) calibration as TensorRT describes it publicly (Migacz, GTC 2017).

Pass 1 finds ``absmax``; pass 2 builds a histogram of ``|x|`` over ``[0, absmax]`` (4096 bins). For every
candidate ``i`` (``levels <= i <= bins`` kept bins):

* ``P`` = the first ``i`` bins, with the mass of all bins beyond added to bin ``i - 1`` (clipping), normalised;
* ``Q`` = the first ``i`` bins merged into ``levels`` groups of ``i // levels`` bins (the last group takes
  the remainder), each group's count spread evenly over its non-empty bins, normalised;
* the threshold is the upper edge ``i * bin_width`` of the ``i`` minimising ``KL(P || Q)``.

``levels`` is the number of non-negative grid points: 128 for int8 ``[-128, 127]``, 256 for uint8.
The published description leaves one case open: when bin ``i - 1`` is empty but clipped mass is added to
it, ``Q`` is 0 where ``P`` is not and the divergence is infinite; such candidates are skipped.
All candidates are evaluated at once from prefix sums (no Python loop over thresholds).
"""
from __future__ import annotations

import logging

import torch

from fxq.errors import ObserverError
from fxq.functional import qparams_from_minmax
from fxq.observers.base import register_observer
from fxq.observers.histogram import HistogramObserver
from fxq.spec import TensorQuantConfig

__all__ = ["KLObserver", "kl_threshold_bins"]

logger = logging.getLogger(__name__)


def _group_terms(stats: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For bin groups ``[start, end)``: ``sum_j h_j log(h_j / avg)`` over non-empty bins, and ``avg``.

    ``stats`` holds prefix sums ``[3, B + 1]`` of ``h``, ``h > 0`` and ``h log h``; ``avg`` is the group's
    mass spread over its non-empty bins (Q's unnormalised value there).
    """
    mass, count, hlogh = stats[:, end] - stats[:, start]
    avg = mass / count.clamp(min=1)
    term = torch.where(mass > 0, hlogh - mass * torch.log(avg.clamp(min=1e-300)), 0.0)
    return term, avg


CLIPPED_WARNING = 0.05
"""A threshold that clips more than this share of the calibration values is warned about: entropy calibration is
meant to cut a tail, and cutting more says the histogram misled it."""


def kl_threshold_bins(hist: torch.Tensor, levels: int) -> int:
    """Number of kept bins ``i`` minimising ``KL(P_i || Q_i)`` for a 1-D histogram (see module doc).

    Candidates sharing ``i // levels`` share every group but the last, so the search costs
    ``O(bins)`` rather than ``O(bins * levels)``.
    """
    h = hist.detach().double().reshape(-1)
    n_bins = h.numel()
    total = h.sum()
    if levels >= n_bins or not bool(total > 0):
        return n_bins
    zero = h.new_zeros(3, 1)
    per_bin = torch.stack([h, (h > 0).double(), torch.special.xlogy(h, h)])
    stats = torch.cat([zero, per_bin.cumsum(1)], dim=1)  # stats[:, k] = sums over h[:k]

    # groups 0 .. levels-2 depend only on the group width m = i // levels
    widths = torch.arange(1, n_bins // levels + 1, device=h.device)
    group = torch.arange(levels - 1, device=h.device)
    starts = group[None, :] * widths[:, None]
    head, _ = _group_terms(stats, starts, starts + widths[:, None])
    head = head.sum(1)

    i = torch.arange(levels, n_bins + 1, device=h.device)  # candidates
    m = i // levels
    last_term, last_avg = _group_terms(stats, (levels - 1) * m, i)
    kept = stats[0, i]
    log_total = torch.log(total)
    kl = (head[m - 1] + last_term + torch.special.xlogy(kept, kept) - kept * log_total) / total

    # clipping: bin i-1 of P also carries everything beyond it
    tail = total - kept
    last = h[i - 1]
    log_q = torch.log(last_avg.clamp(min=1e-300)) - torch.log(kept.clamp(min=1e-300))
    p_new = (last + tail) / total
    p_old = last / total
    fix = torch.special.xlogy(p_new, p_new) - p_new * log_q - (torch.special.xlogy(p_old, p_old) - p_old * log_q)
    kl = torch.where(tail > 0, torch.where(last > 0, kl + fix, torch.inf), kl)
    kl = torch.where(kept > 0, kl, torch.inf)
    return int(i[torch.argmin(kl)])


def magnitude_levels(config: TensorQuantConfig) -> int:
    """Grid points on one side of zero: ``qmax + 1`` for unsigned ranges, half the range otherwise."""
    qmin, qmax = int(config.quant_min), int(config.quant_max)
    if config.symmetric and qmin >= 0:
        return qmax + 1
    return max(1, (qmax - qmin + 1) // 2)


@register_observer("kl")
class KLObserver(HistogramObserver):
    """TensorRT-style entropy calibration: the ``|x|`` threshold minimising ``KL(P || Q)`` (symmetric).

    Two passes (``passes = 2``). Per-tensor integer configs only. For an asymmetric config the clip range
    is the observed range cut to ``[-t, t]``; for an unsigned symmetric one (``quant_min >= 0``) the
    histogram covers ``max(x, 0)``.

    Args:
        config: the config whose parameters this observer computes.
        where: label for error messages.
        bins: histogram bins (TensorRT's published description uses 2048; fxq uses 4096 by default).

    Raises:
        ConfigError: for ``bins < 2``.
        ObserverError: for per-channel or floating configs (at construction); nothing observed, only
            one pass, or NaN/Inf in the data (at :meth:`compute_qparams`).

    Example:
        >>> obs = KLObserver(TensorQuantConfig())
        >>> data = [torch.randn(1000) for _ in range(4)]
        >>> for x in data: obs.observe(x)
        >>> obs.next_pass()
        >>> for x in data: obs.observe(x)
        >>> scale, offset = obs.compute_qparams()
    """

    def __init__(self, config: TensorQuantConfig, where: str = "", bins: int = 4096) -> None:
        super().__init__(config, where, bins=bins)
        if config.per_channel:
            raise ObserverError(
                f"{self._label()} supports per-tensor configs only (entropy calibration is per tensor); "
                f"use 'mse', 'percentile' or 'minmax' for per-channel configs"
            )
        if config.is_floating:
            raise ObserverError(f"{self._label()} needs an integer grid; use the 'floating' observer for FP8")
        self.options = {"bins": self.bins}
        self._unsigned = config.symmetric and config.quant_min >= 0

    def _hist_range(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top = torch.clamp(hi, min=0.0) if self._unsigned else torch.maximum(lo.abs(), hi.abs())
        return torch.zeros_like(top), top

    def _hist_values(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.clamp(min=0.0) if self._unsigned else rows.abs()

    def _search(self) -> tuple[torch.Tensor, torch.Tensor]:
        counts, _, width = self._histogram()
        kept = kl_threshold_bins(counts[0], magnitude_levels(self.config))
        t = (width * kept).float().cpu()
        lo = torch.maximum(self.min_val.cpu(), -t)
        hi = torch.minimum(self.max_val.cpu(), t)
        logger.debug("%s: threshold %s (%d of %d bins)", self._label(), t, kept, self.bins)
        # of the values off the first bin: a ReLU's zeros (an unsigned grid's negatives) would dilute the share
        clipped = float(counts[0, kept:].sum() / counts[0, 1:].sum().clamp(min=1))
        if clipped > CLIPPED_WARNING:
            logger.warning(
                "%s: the entropy threshold %.4g clips %.1f %% of the calibration values, more than a tail of "
                "outliers: a spiky histogram (few distinct values, as flat or synthetic images give) misleads the "
                "divergence search. Calibrate on varied data, or use the 'percentile' or 'mse' observer for it",
                self._label(), float(t.max()), 100 * clipped)
        return qparams_from_minmax(lo, hi, self.config)
