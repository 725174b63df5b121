"""MSE observer: the clip range whose expected quantization error over a histogram is smallest.

Pass 1 finds each row's range, pass 2 builds a histogram over it. The data are modelled as uniform inside
each bin, so the expected squared error of a candidate grid is exact for that model: inside the grid's
range it is the integral of the rounding sawtooth (``s^2/12`` per unit of a smooth density, 0 at grid
points), outside it the squared distance to the clip edge. Candidates:

* symmetric configs: ``[-t, t]`` for ``t = absmax * k / K``, ``k = 1..K``;
* asymmetric configs: a common shrink ``k / K`` of both ends, then the upper end alone, then the lower
  end alone (coordinate search, each step keeping the best so far).

Every candidate's ``(scale, offset)`` comes from :func:`fxq.functional.qparams_from_minmax`, so
power-of-2, unsigned and asymmetric grids are searched exactly as they will be used. Ties prefer the
wider range. Works per tensor and per channel (rows are searched independently, in chunks).
"""
from __future__ import annotations

import logging

import torch

from fxq.errors import ConfigError, ObserverError
from fxq.functional import qparams_from_minmax
from fxq.observers.base import register_observer
from fxq.observers.histogram import HistogramObserver
from fxq.spec import RoundingPolicy, TensorQuantConfig

__all__ = ["MSEObserver", "expected_sq_error"]

logger = logging.getLogger(__name__)

_CHUNK_ELEMENTS = 1 << 22
"""Rows x candidates x edges evaluated at once (float64), to bound memory for per-channel configs."""


def _sawtooth_integral(v: torch.Tensor, policy: RoundingPolicy) -> torch.Tensor:
    """An antiderivative of ``(t - round(t))^2`` in ``t`` (rounding under ``policy``; ties do not matter)."""
    if policy in (RoundingPolicy.UP, RoundingPolicy.DOWN):
        f = torch.floor(v)
        u = v - f
        part = (1 - (1 - u) ** 3) if policy is RoundingPolicy.UP else u**3
        return f / 3 + part / 3
    n = torch.round(v)
    return n / 12 + (v - n) ** 3 / 3


def expected_sq_error(
    counts: torch.Tensor,
    start: torch.Tensor,
    width: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    quant_min: float,
    quant_max: float,
    rounding: RoundingPolicy = RoundingPolicy.HALF_EVEN,
) -> torch.Tensor:
    """Total expected squared error of linear grids on histograms, data uniform within each bin.

    Args:
        counts: ``[C, B]`` bin counts; bin ``j`` of row ``c`` is ``start[c] + width[c] * [j, j + 1)``.
        start, width: ``[C]``.
        scale, offset: ``[C, K]`` candidate grids (offsets are integers).
        quant_min, quant_max: the integer range.
        rounding: rounding policy (nearest for every half-* policy; UP and DOWN differ).

    Returns:
        ``[C, K]`` float64: sum over bins of ``count * mean squared error in the bin``.
    """
    counts, start, width = counts.double(), start.double(), width.double()
    s, o = scale.double()[:, :, None], offset.double()[:, :, None]
    n_bins = counts.shape[1]
    edges = start[:, None] + width[:, None] * torch.arange(n_bins + 1, dtype=torch.float64, device=counts.device)
    x = edges[:, None, :]  # [C, 1, B+1]
    lo_q, hi_q = quant_min - o, quant_max - o  # grid limits in units of s
    lower, upper = lo_q * s, hi_q * s
    g_lo = _sawtooth_integral(lo_q, rounding)
    inside = s**3 * (_sawtooth_integral(torch.clamp(x / s, lo_q, hi_q), rounding) - g_lo)
    below = torch.clamp(x - lower, max=0.0) ** 3 / 3
    above = torch.clamp(x - upper, min=0.0) ** 3 / 3
    antiderivative = inside + below + above  # continuous in x
    per_bin = torch.diff(antiderivative, dim=2) / width[:, None, None]
    return (per_bin * counts[:, None, :]).sum(2)


@register_observer("mse")
class MSEObserver(HistogramObserver):
    """Clip range minimising the expected quantization MSE over a histogram (two passes).

    Args:
        config: the config whose parameters this observer computes (integer grids; per tensor or channel).
        where: label for error messages.
        bins: histogram bins per row (default 2048 per tensor, 256 per channel).
        candidates: clip candidates per search step (``K``; default 100).

    Raises:
        ConfigError: for ``bins < 2`` or ``candidates < 1``.
        ObserverError: for floating configs (at construction); nothing observed, only one pass, or
            NaN/Inf in the data (at :meth:`compute_qparams`).

    Example:
        >>> obs = MSEObserver(TensorQuantConfig(per_channel=True))
        >>> w = torch.randn(8, 16)
        >>> obs.observe(w); obs.next_pass(); obs.observe(w)
        >>> scale, offset = obs.compute_qparams()  # 8 scales
    """

    def __init__(
        self, config: TensorQuantConfig, where: str = "", bins: int | None = None, candidates: int = 100
    ) -> None:
        bins = (256 if config.per_channel else 2048) if bins is None else int(bins)
        super().__init__(config, where, bins=bins)
        if config.is_floating:
            raise ObserverError(f"{self._label()} searches integer grids; use the 'floating' observer for FP8")
        if int(candidates) < 1:
            raise ConfigError(f"{self._label()}: candidates={candidates} must be at least 1")
        self.candidates = int(candidates)
        self.options = {"bins": bins, "candidates": self.candidates}

    def _errors(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """Expected error ``[C, K]`` of the clip ranges ``[lo, hi]`` (each ``[C, K]``)."""
        counts, start, width = self._histogram()
        c, k = lo.shape
        cfg = self.config
        scale, offset = qparams_from_minmax(lo.reshape(-1), hi.reshape(-1), cfg)
        scale, offset = scale.to(counts.device).reshape(c, k), offset.to(counts.device).reshape(c, k)
        rows_per_chunk = max(1, _CHUNK_ELEMENTS // (k * (self.bins + 1)))
        out = []
        for r in range(0, c, rows_per_chunk):
            sl = slice(r, r + rows_per_chunk)
            out.append(
                expected_sq_error(
                    counts[sl], start[sl], width[sl], scale[sl], offset[sl],
                    float(cfg.quant_min), float(cfg.quant_max), cfg.rounding,
                )
            )
        return torch.cat(out)

    @staticmethod
    def _best(errors: torch.Tensor) -> torch.Tensor:
        """Index of the smallest error per row; ties go to the highest index (the widest range)."""
        k = errors.shape[1]
        return (k - 1) - torch.argmin(errors.flip(1), dim=1)

    def _search(self) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.hist.device
        lo0 = torch.clamp(self.min_val.double(), max=0.0).to(device)
        hi0 = torch.clamp(self.max_val.double(), min=0.0).to(device)
        frac = torch.arange(1, self.candidates + 1, dtype=torch.float64, device=device) / self.candidates
        rows = torch.arange(lo0.numel(), device=device)
        if self.config.symmetric:
            absmax = torch.maximum(-lo0, hi0)[:, None] * frac
            best = self._best(self._errors(-absmax, absmax))
            t = absmax[rows, best]
            lo, hi = -t, t
        else:
            best = self._best(self._errors(lo0[:, None] * frac, hi0[:, None] * frac))
            lo, hi = lo0 * frac[best], hi0 * frac[best]
            best = self._best(self._errors(lo[:, None].expand(-1, frac.numel()), hi0[:, None] * frac))
            hi = hi0 * frac[best]
            best = self._best(self._errors(lo0[:, None] * frac, hi[:, None].expand(-1, frac.numel())))
            lo = lo0 * frac[best]
        logger.debug("%s: clip range [%s, %s]", self._label(), lo, hi)
        return qparams_from_minmax(lo.float().cpu(), hi.float().cpu(), self.config)
