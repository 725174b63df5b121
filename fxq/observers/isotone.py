"""Isotone observer: the scale that best keeps the arg-max along the last axis (softmax-like outputs).

Criterion. Along the last axis each row has a top-1 value ``a`` and a runner-up ``b <= a``. Quantization
keeps that row's arg-max when the integer code of ``a`` stays strictly above the code of ``b`` (a tie in
codes makes the arg-max ambiguous; clipping both to ``quant_max`` is such a tie). Only ``(a, b)`` matters,
so the observer keeps the top-2 of every row (a strided subset of at most ``max_rows`` rows per batch).
Candidates shrink the observed range ``[min, max]`` by ``2^(-j / steps)`` (``j = 0 .. octaves * steps``);
each gets its ``(scale, offset)`` from :func:`fxq.functional.qparams_from_minmax` and its codes from
fxq's rounding, exactly as it will be quantized. The observer returns the candidate keeping the most
rows, and among equally good ones the widest range (the least clipping).

A finer scale separates close runners-up; a range cut below ``b`` merges them again: the count balances
both. Use it where only the ordering matters downstream (a classifier's final softmax): values above the
chosen range are clipped. Rows with exact ties ``a == b`` cannot be kept by any scale and do not matter.
"""
from __future__ import annotations

import logging

import torch

from fxq.errors import ConfigError, ObserverError
from fxq.functional import qparams_from_minmax, round_with_policy
from fxq.observers.base import Observer, register_observer
from fxq.spec import TensorQuantConfig

__all__ = ["IsotoneObserver"]

logger = logging.getLogger(__name__)

_CHUNK_ELEMENTS = 1 << 23


@register_observer("isotone")
class IsotoneObserver(Observer):
    """Scale keeping the most last-axis arg-maxes (see the module docstring for the criterion).

    Args:
        config: a per-tensor integer config.
        where: label for error messages.
        octaves: how far below the observed range candidates go (``2^-octaves``).
        steps: candidates per octave.
        max_rows: rows kept per batch (a strided subset beyond this).

    Raises:
        ConfigError: for ``octaves < 0``, ``steps < 1`` or ``max_rows < 1``.
        ObserverError: for per-channel or floating configs (at construction); nothing observed or
            NaN/Inf in the data (at :meth:`compute_qparams`).

    Example:
        >>> obs = IsotoneObserver(TensorQuantConfig(symmetric=False))
        >>> obs.observe(torch.softmax(torch.randn(32, 10), dim=-1))
        >>> scale, offset = obs.compute_qparams()
    """

    def __init__(
        self, config: TensorQuantConfig, where: str = "", octaves: int = 8, steps: int = 8, max_rows: int = 16384
    ) -> None:
        super().__init__(config, where)
        if config.per_channel or config.is_floating:
            raise ObserverError(
                f"{self._label()} supports per-tensor integer configs only (it ranks values along the last "
                f"axis); use 'minmax' or 'percentile' here"
            )
        if octaves < 0 or steps < 1 or max_rows < 1:
            raise ConfigError(f"{self._label()}: need octaves >= 0, steps >= 1, max_rows >= 1")
        self.octaves, self.steps, self.max_rows = int(octaves), int(steps), int(max_rows)
        self.options = {"octaves": self.octaves, "steps": self.steps, "max_rows": self.max_rows}
        self.min_val: torch.Tensor | None = None
        self.max_val: torch.Tensor | None = None
        self.pairs: list[torch.Tensor] = []  # [rows, 2]: top-1 and runner-up per row

    @torch.no_grad()
    def observe(self, x: torch.Tensor) -> None:
        x = x.detach()
        rows = x.reshape(1, 1) if x.dim() == 0 else x.reshape(-1, x.shape[-1])
        rows = rows.float()
        if rows.numel() == 0:
            return
        lo, hi = torch.aminmax(rows)
        if self.min_val is None:
            self.min_val, self.max_val = lo, hi
        else:
            self.min_val, self.max_val = torch.minimum(self.min_val, lo), torch.maximum(self.max_val, hi)
        self.num_observed += 1
        if rows.shape[1] < 2:
            return  # one value per row: any scale keeps the arg-max
        if rows.shape[0] > self.max_rows:
            rows = rows[:: -(-rows.shape[0] // self.max_rows)]
        self.pairs.append(torch.topk(rows, 2, dim=1).values)

    def compute_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._require_data()
        self._require_finite(self.min_val, self.max_val)
        lo, hi = self.min_val.double().cpu().reshape(1), self.max_val.double().cpu().reshape(1)
        if not self.pairs:
            return qparams_from_minmax(lo, hi, self.config)
        pairs = torch.cat(self.pairs)  # float32, like the quantizer's own arithmetic
        shrink = torch.pow(2.0, -torch.arange(self.octaves * self.steps + 1, dtype=torch.float64) / self.steps)
        scale, offset = qparams_from_minmax(lo * shrink, hi * shrink, self.config)
        kept = self._kept_rows(pairs, scale.to(pairs.device), offset.to(pairs.device))
        best = int(torch.argmax(kept))  # first maximum: the widest range among the best
        logger.debug(
            "%s: scale %.6g keeps the arg-max of %d of %d rows (full range: %d)",
            self._label(), float(scale[best]), int(kept[best]), pairs.shape[0], int(kept[0]),
        )
        return scale[best : best + 1], offset[best : best + 1]

    def _kept_rows(self, pairs: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """For each candidate ``(scale[k], offset[k])``: rows whose top-1 code exceeds the runner-up's."""
        cfg = self.config
        per_chunk = max(1, _CHUNK_ELEMENTS // (2 * pairs.shape[0]))
        out = []
        for k in range(0, scale.numel(), per_chunk):
            s = scale[k : k + per_chunk, None, None]
            o = offset[k : k + per_chunk, None, None]
            codes = torch.clamp(round_with_policy(pairs[None] / s, cfg.rounding) + o, cfg.quant_min, cfg.quant_max)
            out.append((codes[..., 0] > codes[..., 1]).sum(1))
        return torch.cat(out).cpu()
