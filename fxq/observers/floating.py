"""Floating (FP8) observer: the power-of-2 scale with the lowest quantization MSE for the config's format.

Pass 1 finds each row's ``absmax``; the largest useful scale is ``2^e0``, the power of two at or above
``absmax / quant_max`` (nothing clipped). A larger scale only pushes values into subnormals, so the
candidates are ``2^(e0 - k)`` for ``k = 0 .. candidates - 1``: smaller scales trade clipping of the top
values for precision at the bottom of the format's range. Pass 2 fake-quantizes every batch (a strided
subset of at most ``max_samples`` values per row) with each candidate, through fxq's own FP8 function and
the config's rounding, and sums the squared errors on the device. Ties go to the larger scale.
Zero rows get the scale :func:`fxq.functional.qparams_from_minmax` gives them (``MIN_SCALE``).
"""
from __future__ import annotations

import logging

import torch

from fxq.errors import ConfigError, ObserverError
from fxq.functional import float_fake_quantize_reference, qparams_from_minmax, round_scale_to_power_of_2
from fxq.observers.base import Observer, channel_rows, register_observer
from fxq.spec import MIN_SCALE, TensorQuantConfig

__all__ = ["FloatingObserver"]

logger = logging.getLogger(__name__)


@register_observer("floating")
class FloatingObserver(Observer):
    """Lowest-MSE power-of-2 scale for FP8 (E4M3 / E5M2) configs, per tensor or per channel (two passes).

    Args:
        config: a floating config (``fp_format`` set).
        where: label for error messages.
        candidates: how many powers of two to try, from the no-clipping one downwards.
        max_samples: values per row and batch used to measure the error (a strided subset beyond).

    Raises:
        ConfigError: for ``candidates < 1`` or ``max_samples < 1``.
        ObserverError: for integer configs (at construction); nothing observed, only one pass, or NaN/Inf
            in the data (at :meth:`compute_qparams`).

    Example:
        >>> obs = FloatingObserver(TensorQuantConfig(fp_format="e4m3"))
        >>> x = torch.randn(4096)
        >>> obs.observe(x); obs.next_pass(); obs.observe(x)
        >>> scale, _ = obs.compute_qparams()  # a power of two
    """

    passes = 2

    def __init__(
        self, config: TensorQuantConfig, where: str = "", candidates: int = 4, max_samples: int = 1 << 18
    ) -> None:
        super().__init__(config, where)
        if not config.is_floating:
            raise ObserverError(
                f"{self._label()} needs a floating config (fp_format='e4m3' or 'e5m2'); use 'minmax', 'mse' "
                f"or 'percentile' for integer grids"
            )
        if candidates < 1 or max_samples < 1:
            raise ConfigError(f"{self._label()}: need candidates >= 1 and max_samples >= 1")
        self.candidates, self.max_samples = int(candidates), int(max_samples)
        self.options = {"candidates": self.candidates, "max_samples": self.max_samples}
        self.absmax: torch.Tensor | None = None  # pass 1, per row
        self.scales: torch.Tensor | None = None  # [C, candidates]
        self.errors: torch.Tensor | None = None  # [C, candidates], float64
        self._range_ok = True

    @torch.no_grad()
    def observe(self, x: torch.Tensor) -> None:
        rows = channel_rows(x, self.config).float()
        if self.pass_index == 0:
            lo, hi = torch.aminmax(rows, dim=1)
            m = torch.maximum(-lo, hi)
            self.absmax = m if self.absmax is None else torch.maximum(self.absmax, m)
            self.num_observed += 1
            return
        if self.scales is None or not self._range_ok:
            return
        if rows.shape[1] > self.max_samples:
            rows = rows[:, :: -(-rows.shape[1] // self.max_samples)].contiguous()
        fmt, cfg = self.config.fp_format, self.config
        errs = []
        for k in range(self.candidates):
            y = float_fake_quantize_reference(
                rows, self.scales[:, k], 0, fmt.mantissa_bits, fmt.min_exponent, float(cfg.quant_max), int(cfg.rounding)
            )
            errs.append((y - rows).square_().sum(1, dtype=torch.float64))
        e = torch.stack(errs, dim=1)
        self.errors = e if self.errors is None else self.errors + e

    def next_pass(self) -> None:
        super().next_pass()
        if self.pass_index != 1 or self.absmax is None:
            return
        self._range_ok = bool(torch.isfinite(self.absmax).all())  # the one host sync of this observer
        top = torch.clamp(self.absmax.double() / float(self.config.quant_max), min=MIN_SCALE)
        top = torch.nan_to_num(top, nan=1.0, posinf=1.0)
        top = round_scale_to_power_of_2(top)  # 2^ceil(log2(absmax / fp_max))
        steps = torch.pow(2.0, -torch.arange(self.candidates, dtype=torch.float64, device=top.device))
        self.scales = (top[:, None] * steps).float()

    def compute_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._require_data()
        self._require_finite(self.absmax)
        if self.errors is None:
            raise ObserverError(
                f"{self._label()} needs two passes over the calibration data: call next_pass() after the "
                f"first and run the data again (fxq.calibrate does this for observers with passes=2)"
            )
        self._require_finite(self.errors)
        best = torch.argmin(self.errors, dim=1)  # first minimum: the largest scale among the best
        scale = self.scales[torch.arange(best.numel(), device=best.device), best].cpu()
        zero = (self.absmax == 0).cpu()
        if bool(zero.any()):
            zero_scale, _ = qparams_from_minmax(torch.zeros(1), torch.zeros(1), self.config)
            scale = torch.where(zero, zero_scale, scale)
        logger.debug("%s: power-of-2 scale %s (candidate %s)", self._label(), scale, best.cpu())
        return scale.float(), torch.zeros_like(scale, dtype=torch.float32)
