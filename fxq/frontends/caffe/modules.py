"""``nn.Module``s for caffe layers that have no exact ``torch.nn`` twin.

Shape arithmetic that depends on the input size lives in module-level functions wrapped with ``torch.fx.wrap``,
so re-tracing a loaded model with ``torch.fx.symbolic_trace`` keeps each of them as one ``call_function`` node.
"""
from __future__ import annotations

import math

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CaffeChannelScale1d",
    "CaffeChannelScale2d",
    "CaffeChannelScale3d",
    "CaffeInterp",
    "CaffeLRNWithinChannel",
    "CaffePooling2d",
    "CaffePower",
    "CaffeScale",
    "caffe_interp",
    "caffe_pool2d",
    "caffe_pooled_size",
]

POOL_MAX = 0
POOL_AVE = 1


def caffe_pooled_size(size: int, kernel: int, stride: int, pad: int, ceil_mode: bool, clip: bool) -> int:
    """Caffe's pooled output length: ceil (or floor) rounding, then, when the layer has any padding (``clip``),
    drop a last window that would start inside the right padding."""
    span = size + 2 * pad - kernel
    out = (math.ceil(span / stride) if ceil_mode else span // stride) + 1
    if clip and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def caffe_pool2d(x: torch.Tensor, method: int, kernel: tuple[int, int], stride: tuple[int, int],
                 pad: tuple[int, int], ceil_mode: bool) -> torch.Tensor:
    """Caffe 2-D MAX/AVE pooling for any pad/stride/rounding, including what ``F.max_pool2d`` rejects.

    MAX ignores padded positions; AVE divides by the window clipped to the padded extent ``[-pad, size + pad)``
    (caffe's ``pool_size``), summing only the real positions.
    """
    sizes = (x.shape[-2], x.shape[-1])
    clip = pad[0] > 0 or pad[1] > 0
    outs = [caffe_pooled_size(sizes[d], kernel[d], stride[d], pad[d], ceil_mode, clip) for d in range(2)]
    extra = [max(0, (outs[d] - 1) * stride[d] + kernel[d] - sizes[d] - pad[d]) for d in range(2)]
    padding = (pad[1], extra[1], pad[0], extra[0])
    if method == POOL_MAX:
        padded = F.pad(x, padding, value=torch.finfo(x.dtype).min)  # caffe starts its max at -FLT_MAX
        return F.max_pool2d(padded, kernel, stride)[..., : outs[0], : outs[1]]
    padded = F.pad(x, padding)
    sums = F.avg_pool2d(padded, kernel, stride, divisor_override=1)[..., : outs[0], : outs[1]]
    counts = []
    for d in range(2):
        starts = [i * stride[d] - pad[d] for i in range(outs[d])]
        counts.append(torch.tensor([min(s + kernel[d], sizes[d] + pad[d]) - s for s in starts],
                                   dtype=x.dtype, device=x.device))
    return sums / (counts[0][:, None] * counts[1][None, :])


def caffe_interp(x: torch.Tensor, reference: torch.Tensor | None, height: int | None, width: int | None,
                 zoom_factor: int | None, shrink_factor: int | None, pad_beg: int, pad_end: int) -> torch.Tensor:
    """Caffe's ``Interp`` (DeepLab / PSPNet): crop by the non-positive pads, then bilinear with aligned corners.

    The output size comes from ``reference``'s spatial size when given, else from caffe's rules over
    ``shrink_factor`` / ``zoom_factor`` / ``height`` + ``width`` (``None`` = not set in the prototxt).
    """
    h_in, w_in = x.shape[-2], x.shape[-1]
    h_eff, w_eff = h_in + pad_beg + pad_end, w_in + pad_beg + pad_end
    x = x[..., -pad_beg: -pad_beg + h_eff, -pad_beg: -pad_beg + w_eff]
    if reference is not None:
        h_out, w_out = reference.shape[-2], reference.shape[-1]
    elif shrink_factor is not None and zoom_factor is None:
        h_out, w_out = (h_eff - 1) // shrink_factor + 1, (w_eff - 1) // shrink_factor + 1
    elif zoom_factor is not None and shrink_factor is None:
        h_out, w_out = h_eff + (h_eff - 1) * (zoom_factor - 1), w_eff + (w_eff - 1) * (zoom_factor - 1)
    elif height is not None and width is not None:
        h_out, w_out = height, width
    elif shrink_factor is not None and zoom_factor is not None:
        h_out, w_out = (h_eff - 1) // shrink_factor + 1, (w_eff - 1) // shrink_factor + 1
        h_out, w_out = h_out + (h_out - 1) * (zoom_factor - 1), w_out + (w_out - 1) * (zoom_factor - 1)
    else:
        raise ValueError("Interp needs zoom_factor, shrink_factor, height and width, or a second bottom")
    return F.interpolate(x, size=(h_out, w_out), mode="bilinear", align_corners=True)


torch.fx.wrap("caffe_pool2d")
torch.fx.wrap("caffe_interp")


class CaffePooling2d(nn.Module):
    """Caffe MAX/AVE pooling where ``nn.MaxPool2d`` / ``nn.AvgPool2d`` would differ (pad > kernel/2, or a ceil
    window that caffe keeps and torch drops)."""

    def __init__(self, method: int, kernel: tuple[int, int], stride: tuple[int, int], pad: tuple[int, int],
                 ceil_mode: bool) -> None:
        super().__init__()
        if method not in (POOL_MAX, POOL_AVE):
            raise ValueError(f"unknown pooling method {method}")
        self.method, self.kernel, self.stride, self.pad, self.ceil_mode = method, kernel, stride, pad, ceil_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return caffe_pool2d(x, self.method, self.kernel, self.stride, self.pad, self.ceil_mode)

    def extra_repr(self) -> str:
        kind = "MAX" if self.method == POOL_MAX else "AVE"
        return f"{kind}, kernel={self.kernel}, stride={self.stride}, pad={self.pad}, ceil_mode={self.ceil_mode}"


class CaffeScale(nn.Module):
    """Caffe ``Scale`` in general: multiply by a learned blob (or by a second input) broadcast from ``axis``, plus
    an optional bias (the per-channel learned case is :class:`CaffeChannelScale2d` and friends).

    ``view_shape`` is the blob's shape followed by ones up to the input's rank, so leading axes broadcast.
    """

    def __init__(self, param_shape: tuple[int, ...], view_shape: tuple[int, ...], learned_scale: bool,
                 bias: bool) -> None:
        super().__init__()
        self.view_shape = tuple(view_shape)
        self.weight = nn.Parameter(torch.ones(param_shape)) if learned_scale else None
        self.bias = nn.Parameter(torch.zeros(param_shape)) if bias else None

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        factor = self.weight if scale is None else scale
        y = x * factor.reshape(self.view_shape)
        if self.bias is not None:
            y = y + self.bias.reshape(self.view_shape)
        return y

    def extra_repr(self) -> str:
        return f"view_shape={self.view_shape}, bias={self.bias is not None}"


class _FrozenStatistics:
    """A BatchNorm that normalises with its running statistics in train mode too, and never updates them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


class CaffeChannelScale1d(_FrozenStatistics, nn.BatchNorm1d):
    """Caffe per-channel ``Scale`` (axis 1, one learned blob) on 2-D/3-D input: ``x * weight + bias``.

    Stored as a BatchNorm with mean 0, variance 1, eps 0 and frozen statistics, which is exact
    (``1 / sqrt(1 + 0) == 1``), so BatchNorm folding and every BatchNorm-aware pass or exporter handle it.
    """

    def __init__(self, channels: int) -> None:
        super().__init__(channels, eps=0.0, affine=True, track_running_stats=True)


class CaffeChannelScale2d(_FrozenStatistics, nn.BatchNorm2d):
    """:class:`CaffeChannelScale1d` for 4-D input."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels, eps=0.0, affine=True, track_running_stats=True)


class CaffeChannelScale3d(_FrozenStatistics, nn.BatchNorm3d):
    """:class:`CaffeChannelScale1d` for 5-D input."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels, eps=0.0, affine=True, track_running_stats=True)


class CaffeNormalize(nn.Module):
    """SSD's ``Normalize``: ``x / sqrt(sum(x^2) + eps) * scale``, the sum over the channels at each position
    (``across_spatial=False``) or over the whole sample; ``scale`` per channel, or one shared (a 1-element weight).

    One module (op type ``Normalize``): the platforms keep it FP32 as TensorRT's and ncnn's Normalize layers run
    it; quantizing the divisor of a decomposed form would round the norm of an all-zero position to 0 (0 / 0).
    """

    def __init__(self, scale_size: int, across_spatial: bool, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(scale_size))
        self.across_spatial = bool(across_spatial)
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = (1, 2, 3) if self.across_spatial else (1,)
        norm = torch.sqrt((x * x).sum(dims, keepdim=True) + self.eps)
        return x / norm * self.weight.reshape(1, -1, 1, 1)

    def extra_repr(self) -> str:
        return f"scale_size={self.weight.numel()}, across_spatial={self.across_spatial}, eps={self.eps}"


class CaffePower(nn.Module):
    """Caffe ``Power``: ``(shift + scale * x) ** power``."""

    def __init__(self, power: float = 1.0, scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__()
        self.power, self.scale, self.shift = float(power), float(scale), float(shift)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.scale if self.scale != 1.0 else x
        if self.shift != 0.0:
            y = y + self.shift
        if self.power != 1.0:
            y = torch.pow(y, self.power)
        return y

    def extra_repr(self) -> str:
        return f"power={self.power}, scale={self.scale}, shift={self.shift}"


class CaffeLRNWithinChannel(nn.Module):
    """Caffe ``LRN`` with ``norm_region: WITHIN_CHANNEL``: ``x * (1 + alpha * avg_{size x size}(x^2)) ** -beta``.

    The average counts padding (caffe's AVE pooling with pad ``(size - 1) / 2``); caffe ignores ``k`` here.
    """

    def __init__(self, size: int, alpha: float, beta: float) -> None:
        super().__init__()
        if size % 2 != 1:
            raise ValueError(f"LRN local_size must be odd, got {size}")
        self.size, self.alpha, self.beta = int(size), float(alpha), float(beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        avg = F.avg_pool2d(x * x, self.size, stride=1, padding=(self.size - 1) // 2, count_include_pad=True)
        return x * torch.pow(1.0 + self.alpha * avg, -self.beta)

    def extra_repr(self) -> str:
        return f"size={self.size}, alpha={self.alpha}, beta={self.beta}"


class CaffeInterp(nn.Module):
    """Caffe ``Interp``: bilinear resize with ``align_corners=True``; see :func:`caffe_interp`."""

    def __init__(self, height: int | None = None, width: int | None = None, zoom_factor: int | None = None,
                 shrink_factor: int | None = None, pad_beg: int = 0, pad_end: int = 0) -> None:
        super().__init__()
        if pad_beg > 0 or pad_end > 0:
            raise ValueError("Interp supports only non-positive pad_beg/pad_end (cropping), as caffe does")
        self.height, self.width = height, width
        self.zoom_factor, self.shrink_factor = zoom_factor, shrink_factor
        self.pad_beg, self.pad_end = int(pad_beg), int(pad_end)

    def forward(self, x: torch.Tensor, reference: torch.Tensor | None = None) -> torch.Tensor:
        return caffe_interp(x, reference, self.height, self.width, self.zoom_factor, self.shrink_factor,
                            self.pad_beg, self.pad_end)

    def extra_repr(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in ("height", "width", "zoom_factor", "shrink_factor")
                 if getattr(self, k) is not None]
        return ", ".join(parts + [f"pad_beg={self.pad_beg}", f"pad_end={self.pad_end}"])
