"""Error metrics between a reference (FP32) and a quantized tensor, accumulated over batches.

* ``snr``: noise power / signal power, ``Σ(q − f)² / Σf²`` over every batch (lower is better; PPQ's
  convention, shown as a percentage);
* ``mse``: mean squared error ``Σ(q − f)² / N``;
* ``cosine``: cosine similarity per sample (dim 0 is the batch), averaged (higher is better).

Accumulators keep running sums only (as float64 tensors on the data's device, no host syncs per batch).
"""
from __future__ import annotations

import math

import torch

from fxq import fused_cpu
from fxq.errors import ConfigError

__all__ = ["METRICS", "MetricAccumulator", "Scratch", "check_metric", "higher_is_better", "format_value"]

METRICS = ("snr", "cosine", "mse")


def check_metric(method: str) -> str:
    """Normalise a metric name.

    Raises:
        ConfigError: unknown metric.
    """
    m = str(method).lower()
    if m not in METRICS:
        raise ConfigError(f"unknown error metric {method!r}; use one of {list(METRICS)}")
    return m


def higher_is_better(method: str) -> bool:
    return check_metric(method) == "cosine"


def format_value(method: str, value: float) -> str:
    if math.isnan(value):
        return "nan"
    if method == "snr":
        return f"{value * 100:.4f}%"
    if method == "cosine":
        return f"{value:.6f}"
    return f"{value:.4e}"


class Scratch:
    """One reusable buffer for ``q - f``: large fresh allocations cost page faults on every batch."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def diff(self, q: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """``q - f`` (float32) written into the buffer; valid until the next call."""
        n = q.numel()
        buf = self._buf
        if buf is None or buf.device != q.device or buf.numel() < n:
            buf = self._buf = torch.empty(n, dtype=torch.float32, device=q.device)
        out = buf[:n].view(q.shape)
        if q.dtype == torch.float32 and f.dtype == torch.float32:
            return torch.sub(q, f, out=out)
        return torch.sub(q.float(), f.float(), out=out)


class MetricAccumulator:
    """Running sums for one compared tensor.

    Call :meth:`reference` with the FP32 value, then :meth:`compare` with the quantized value of the
    same batch; :attr:`value` is the metric over everything seen. Accumulators that share a
    :class:`Scratch` must compare one at a time (they do: values arrive node by node).
    """

    __slots__ = ("method", "_ref", "_noise", "_signal", "_count", "_scratch")

    def __init__(self, method: str, scratch: Scratch | None = None) -> None:
        self.method = check_metric(method)
        self._scratch = scratch
        self._ref: torch.Tensor | None = None
        self._noise: torch.Tensor | float = 0.0
        self._signal: torch.Tensor | float = 0.0
        self._count = 0

    def reference(self, fp32: torch.Tensor) -> None:
        """Hold the FP32 value of this batch until :meth:`compare`."""
        f = fp32.detach()
        if f.is_floating_point():
            self._ref = f

    def compare(self, quant: torch.Tensor) -> None:
        """Add the error of the quantized value against the held reference, then drop the reference."""
        f, self._ref = self._ref, None
        if f is None:
            return
        q = quant.detach()
        if q.shape != f.shape:
            raise ConfigError(f"quantized value has shape {tuple(q.shape)}, FP32 value {tuple(f.shape)}")
        if self.method == "cosine":
            if f.dim() < 2:
                qf, ff = q.reshape(1, -1).float(), f.reshape(1, -1).float()
            else:
                qf, ff = q.reshape(q.shape[0], -1).float(), f.reshape(f.shape[0], -1).float()
            dot = (qf * ff).sum(1, dtype=torch.float64)
            norms = torch.linalg.vector_norm(qf, dim=1).double() * torch.linalg.vector_norm(ff, dim=1).double()
            both_zero = norms == 0
            cos = torch.where(both_zero, torch.ones_like(dot), dot / norms.clamp_min(1e-30))
            self._noise = self._noise + cos.sum()
            self._count += int(cos.numel())
            return
        self._count += f.numel()
        if not q.is_contiguous() and q.stride() == f.stride():  # both permuted alike (channels-last): memory order
            order = fused_cpu.stride_order(q)
            q, f = q.permute(order), f.permute(order)
        sums = fused_cpu.squared_error_sums(q, f)  # one pass over both on large CPU tensors
        if sums is not None:
            self._noise = self._noise + sums[0].double()
            if self.method == "snr":
                self._signal = self._signal + sums[1].double()
            return
        if self.method == "snr":
            self._signal = self._signal + torch.linalg.vector_norm(f, dtype=torch.float32).double() ** 2
        diff = self._scratch.diff(q, f) if self._scratch is not None else q.float() - f.float()
        self._noise = self._noise + torch.linalg.vector_norm(diff).double() ** 2

    @property
    def count(self) -> int:
        return self._count

    @property
    def value(self) -> float:
        if self._count == 0:
            return float("nan")
        noise = float(self._noise)
        if self.method in ("cosine", "mse"):  # running sum of per-sample cosines / squared errors: a mean
            return noise / self._count
        signal = float(self._signal)
        if signal == 0.0:
            return 0.0 if noise == 0.0 else float("inf")
        return noise / signal
