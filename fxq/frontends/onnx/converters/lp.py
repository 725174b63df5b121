"""``LpNormalization-1/22``, ``GlobalLpPool-1/2/22`` and ``LpPool-1/2/11/18/22``: p-norms onnx2torch 1.5.15 lacks.

The pools sum ``|x|^p`` over each window and take the p-th root (zero padding adds nothing). ``LpPool`` pads
explicitly (unequal begin/end pads, SAME and the extra end of ceil mode), then sums whole windows as an average pool
times the window size, or, with dilations, as one strided slice per kernel position; not with ``nn.LPPool*d``,
which has no pads or dilations and raises ``x`` (not ``|x|``) to the power p. torch.onnx writes either form. ``auto_pad`` SAME pads
are computed from the input's size when called, so one loaded graph serves every input size.
"""
from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.nn.functional as F
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from fxq.errors import NotSupportedError
from fxq.frontends.onnx.converters._common import result, text
from fxq.frontends.onnx.converters.auto_pad import same_pads
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxLpNormalization", "OnnxGlobalLpPool", "OnnxLpPool"]


def _pow_abs(x: torch.Tensor, p: float) -> torch.Tensor:
    """``|x|^p`` (p = 1 and 2 without ``pow``)."""
    return x.abs() if p == 1 else x * x if p == 2 else x.abs().pow(p)


def _root(x: torch.Tensor, p: float) -> torch.Tensor:
    return x if p == 1 else torch.sqrt(x) if p == 2 else x.pow(1.0 / p)


class OnnxLpNormalization(nn.Module):
    """ONNX ``LpNormalization``: ``x / ||x||_p`` along ``axis`` (p is 1 or 2); a zero norm gives zeros, as in
    onnxruntime (onnx's reference divides by it: NaN)."""

    def __init__(self, p: int, axis: int) -> None:
        super().__init__()
        self.p = p
        self.axis = axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = _root(_pow_abs(x, self.p).sum(self.axis, keepdim=True), self.p)
        return x / torch.where(norm == 0, torch.ones_like(norm), norm)

    def extra_repr(self) -> str:
        return f"p={self.p}, axis={self.axis}"


@register_onnx_converter("LpNormalization", (1, 22))
def _convert_lp_normalization(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    p = int(node.attributes.get("p", 2))
    if p not in (1, 2):
        raise NotSupportedError(f"LpNormalization node {node.name!r}: p={p}; ONNX defines p = 1 or 2 only")
    return result(OnnxLpNormalization(p, int(node.attributes.get("axis", -1))), node, [node.input_values[0]])


class OnnxGlobalLpPool(nn.Module):
    """ONNX ``GlobalLpPool``: the p-norm over every spatial dim (all dims after N, C), kept as size 1."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _root(_pow_abs(x, self.p).sum(tuple(range(2, x.dim())), keepdim=True), self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def _p(node: OnnxNode) -> float:
    """``p``: a float attribute in version 1, an int from version 2; 2 when left out."""
    p = float(node.attributes.get("p", 2))
    if p <= 0:
        raise NotSupportedError(f"{node.operation_type} node {node.name!r}: p={p}; p must be positive")
    return int(p) if p.is_integer() else p


@register_onnx_converter("GlobalLpPool", (1, 2, 22))
def _convert_global_lp_pool(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return result(OnnxGlobalLpPool(_p(node)), node, [node.input_values[0]])


class OnnxLpPool(nn.Module):
    """ONNX ``LpPool``: ``(sum |x|^p)^(1/p)`` over each window of the spatial dims.

    Args:
        p: the norm's power.
        kernel: window size per spatial dim.
        strides, dilations: per spatial dim.
        pads: ONNX order (all begins, then all ends); ignored unless ``auto_pad`` is ``NOTSET``.
        auto_pad: ``NOTSET``, ``VALID``, ``SAME_UPPER`` or ``SAME_LOWER`` (SAME pads follow the input's size).
        ceil_mode: output sizes rounded up (a window must still start inside the input or its begin pad).
    """

    def __init__(self, p: float, kernel: tuple[int, ...], strides: tuple[int, ...], pads: tuple[int, ...],
                 dilations: tuple[int, ...], auto_pad: str = "NOTSET", ceil_mode: bool = False) -> None:
        super().__init__()
        self.p = p
        self.kernel = kernel
        self.strides = strides
        self.pads = pads
        self.dilations = dilations
        self.auto_pad = auto_pad
        self.ceil_mode = ceil_mode

    def _pads(self, sizes: tuple[int, ...]) -> list[tuple[int, int]]:
        """(begin, end) zero padding per spatial dim, the end one including what ceil mode adds."""
        n = len(self.kernel)
        if self.auto_pad in ("SAME_UPPER", "SAME_LOWER"):  # F.pad order (last dim first) back to (begin, end)
            flat = same_pads(list(sizes), list(self.kernel), list(self.strides), list(self.dilations),
                             self.auto_pad == "SAME_UPPER")
            return [(flat[2 * (n - 1 - i)], flat[2 * (n - 1 - i) + 1]) for i in range(n)]
        out = []
        for i, size in enumerate(sizes):
            span = self.dilations[i] * (self.kernel[i] - 1) + 1
            stride = self.strides[i]
            if self.auto_pad == "VALID":
                begin = end = 0
            else:
                begin, end = self.pads[i], self.pads[i + n]
            padded = size + begin + end
            if self.ceil_mode:
                count = -(-(padded - span) // stride) + 1
                if (count - 1) * stride >= size + begin:  # the last window would start in the end padding
                    count -= 1
                end += max(0, (count - 1) * stride + span - padded)
            out.append((begin, end))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = len(self.kernel)
        pads = self._pads(tuple(x.shape[2:]))
        y = _pow_abs(x, self.p)
        flat = [v for begin_end in reversed(pads) for v in begin_end]  # F.pad: last dim first
        if any(flat):
            y = F.pad(y, flat)
        if all(d == 1 for d in self.dilations) and n <= 3:  # every window whole: the mean times its size
            pool = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[n - 1]
            return _root(pool(y, self.kernel, self.strides) * math.prod(self.kernel), self.p)
        return _root(self._window_sum(y), self.p)

    def _window_sum(self, y: torch.Tensor) -> torch.Tensor:
        """Sum of each dilated window: one strided slice per kernel position (torch.onnx writes Slice and Add)."""
        n = len(self.kernel)
        sizes = [(y.shape[2 + i] - self.dilations[i] * (self.kernel[i] - 1) - 1) // self.strides[i] + 1
                 for i in range(n)]
        parts = []
        for offsets in itertools.product(*(range(k) for k in self.kernel)):
            index = [slice(None), slice(None)]
            for i, o in enumerate(offsets):
                start = o * self.dilations[i]
                index.append(slice(start, start + (sizes[i] - 1) * self.strides[i] + 1, self.strides[i]))
            parts.append(y[tuple(index)])
        return functools.reduce(torch.add, parts)

    def extra_repr(self) -> str:
        return (f"p={self.p}, kernel={self.kernel}, strides={self.strides}, pads={self.pads}, "
                f"dilations={self.dilations}, auto_pad={self.auto_pad}, ceil_mode={self.ceil_mode}")


def _convert_lp_pool(node: OnnxNode, graph: OnnxGraph, version: int) -> OperationConverterResult:
    a = node.attributes
    kernel = tuple(int(k) for k in a["kernel_shape"])
    n = len(kernel)
    auto_pad = text(a.get("auto_pad", "NOTSET"))
    if auto_pad not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
        raise NotSupportedError(f"LpPool node {node.name!r}: auto_pad={auto_pad!r} is not an ONNX value")
    dilations = tuple(int(d) for d in a.get("dilations", (1,) * n)) if version >= 18 else (1,) * n
    if auto_pad.startswith("SAME") and any(d != 1 for d in dilations):
        raise NotSupportedError(
            f"LpPool node {node.name!r}: auto_pad={auto_pad} with dilations {list(dilations)}: onnxruntime pads "
            "for the undilated kernel (its output is not the spec's ceil(size / stride)); write explicit pads")
    module = OnnxLpPool(
        _p(node), kernel, tuple(int(s) for s in a.get("strides", (1,) * n)),
        tuple(int(p) for p in a.get("pads", (0,) * (2 * n))), dilations, auto_pad,
        bool(a.get("ceil_mode", 0)) if version >= 18 else False,
    )
    return result(module, node, [node.input_values[0]])


@register_onnx_converter("LpPool", (1, 2, 11))
def _convert_lp_pool_11(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return _convert_lp_pool(node, graph, 11)


@register_onnx_converter("LpPool", (18, 22))
def _convert_lp_pool_18(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """18 adds ``dilations`` and ``ceil_mode``."""
    return _convert_lp_pool(node, graph, 18)
