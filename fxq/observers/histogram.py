"""Two-pass histogram observers: pass 1 finds each row's range, pass 2 fills a fixed-range histogram.

Shared by the ``kl`` and ``mse`` observers. The histogram lives on the tensor's device; the only host
sync is one check of the pass-1 range in :meth:`HistogramObserver.next_pass`. NaN values seen in pass 2
are counted in a spare bin and reported at :meth:`HistogramObserver.compute_qparams` time.
"""
from __future__ import annotations

import torch

from fxq.errors import ConfigError, ObserverError
from fxq.observers.base import Observer, channel_rows
from fxq.spec import TensorQuantConfig

__all__ = ["HistogramObserver", "histogram_rows", "count_indices"]


_HISTC_EXACT = 2 ** 24
"""``histc`` counts in float32: a bin past 2**24 values (a large ReLU map's zeros) rounds, and the NaN count read
off the total went wrong. Larger batches are counted exactly in int64."""


def histogram_rows(rows: torch.Tensor, start: torch.Tensor, width: torch.Tensor, bins: int) -> torch.Tensor:
    """Count ``rows`` ([C, n]) into ``bins`` equal bins per row starting at ``start`` ([C]), of ``width`` ([C]).

    Values below the first bin land in it, values beyond the last in the last one. Returns int64
    ``[C, bins + 1]``; the extra column counts NaNs.
    """
    c = rows.shape[0]
    pos = (rows - start[:, None]) / width[:, None]
    pos = torch.nan_to_num_(pos.clamp_(0, bins - 1), nan=float(bins))
    index = pos.to(torch.int64)  # pos >= 0, so truncation is floor
    if c > 1:
        index += torch.arange(c, device=rows.device)[:, None] * (bins + 1)
    return count_indices(index.reshape(-1), c * (bins + 1), sync_free=rows.device.type != "cpu").reshape(c, bins + 1)


def count_indices(index: torch.Tensor, size: int, sync_free: bool) -> torch.Tensor:
    """``bincount(index, minlength=size)`` for indices known to be below ``size``.

    ``torch.bincount`` sizes its output from the largest index, a host sync on accelerators; with
    ``sync_free`` the counts are accumulated into a preallocated tensor instead (slower on CPU).
    """
    if not sync_free:
        return torch.bincount(index, minlength=size)
    counts = torch.zeros(size, dtype=torch.int64, device=index.device)
    one = torch.ones((), dtype=torch.int64, device=index.device)
    return counts.index_put_((index,), one.expand(index.numel()), accumulate=True)


class HistogramObserver(Observer):
    """Base of two-pass observers: ``_hist_range`` picks each row's histogram range from pass 1's
    signed min/max, ``_hist_values`` maps a batch to the values to count, ``_search`` turns the
    histogram into the clip range ``(lo, hi)`` passed to :func:`fxq.functional.qparams_from_minmax`.
    """

    passes = 2

    def __init__(self, config: TensorQuantConfig, where: str = "", bins: int = 2048) -> None:
        super().__init__(config, where)
        if int(bins) < 2:
            raise ConfigError(f"{self._label()}: bins={bins} must be at least 2")
        self.bins = int(bins)
        self.min_val: torch.Tensor | None = None  # pass 1, per row
        self.max_val: torch.Tensor | None = None
        self.hist: torch.Tensor | None = None  # pass 2, [C, bins + 1] (last column: NaN count)
        self._start: torch.Tensor | None = None
        self._width: torch.Tensor | None = None
        self._bounds: tuple[float, float] | None = None  # host copy of a single row's range
        self._range_ok = True
        self._pass2_batches = 0

    # ------------------------------------------------------------------ hooks
    def _hist_range(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Histogram range per row from the signed extremes; default ``[min(lo, 0), max(hi, 0)]``."""
        return torch.clamp(lo, max=0.0), torch.clamp(hi, min=0.0)

    def _hist_values(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def _search(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    # ------------------------------------------------------------------ protocol
    @torch.no_grad()
    def observe(self, x: torch.Tensor) -> None:
        rows = channel_rows(x, self.config).float()
        if self.pass_index == 0:
            lo, hi = torch.aminmax(rows, dim=1)
            if self.min_val is None:
                self.min_val, self.max_val = lo, hi
            else:
                self.min_val = torch.minimum(self.min_val, lo)
                self.max_val = torch.maximum(self.max_val, hi)
            self.num_observed += 1
            return
        if self._start is None or not self._range_ok:
            return  # nothing seen in pass 1, or a non-finite range: reported by compute_qparams
        values = self._hist_values(rows)
        if self._bounds is not None and values.numel() < _HISTC_EXACT:  # one row: histc is several times faster
            lo, hi = self._bounds
            h = torch.histc(values.clamp(lo, hi), bins=self.bins, min=lo, max=hi)
            nan = values.numel() - h.sum()  # histc skips NaN
            counts = torch.cat([h, nan.reshape(1)]).to(torch.int64).reshape(1, -1)
        else:
            counts = histogram_rows(values, self._start, self._width, self.bins)
        self.hist = counts if self.hist is None else self.hist + counts
        self._pass2_batches += 1

    def next_pass(self) -> None:
        super().next_pass()
        if self.pass_index != 1 or self.min_val is None:
            return
        start, end = self._hist_range(self.min_val, self.max_val)
        self._range_ok = bool(torch.isfinite(start).all() and torch.isfinite(end).all())  # one sync per observer
        width = (end - start) / self.bins
        self._start = start
        self._width = torch.where(width > 0, width, torch.ones_like(width))  # zero range: all in bin 0
        if self._range_ok and start.numel() == 1:
            lo = float(start)
            self._bounds = (lo, lo + float(self._width) * self.bins)

    def compute_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._require_data()
        self._require_finite(self.min_val, self.max_val)
        if self._pass2_batches == 0:
            raise ObserverError(
                f"{self._label()} needs two passes over the calibration data: call next_pass() after the "
                f"first and run the data again (fxq.calibrate does this for observers with passes=2)"
            )
        if bool(self.hist[:, -1].any()):  # NaN counted in pass 2 (pass 1 saw none: the data changed)
            raise ObserverError(
                f"{self._label()} saw NaN or Inf values in its second pass; check the calibration data and "
                f"the layers before this tensor"
            )
        return self._search()

    # ------------------------------------------------------------------ helpers
    def _histogram(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(counts [C, bins] float64, start [C] float64, width [C] float64)`` of pass 2."""
        return self.hist[:, :-1].double(), self._start.double(), self._width.double()
