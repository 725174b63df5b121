"""``ConvTranspose-1/11`` (and 22 through :mod:`versions`) with ``output_shape``, ``auto_pad`` and unequal pads.

onnx2torch 1.5.15 ignores ``output_shape`` (a ``[1, 3, 11, 11]`` result where the node asks for ``[10, 10]``), and
refuses ``SAME_UPPER`` / ``SAME_LOWER`` and pads that differ at the two ends of a dim. ONNX's pads for these follow
from the input size (shape inference must know it):
``total = stride * (in - 1) + output_padding + (kernel - 1) * dilation + 1 - out``, split in half with the odd
element at the end for ``SAME_UPPER`` and at the start otherwise. ``nn.ConvTranspose`` pads both ends alike and
adds ``output_padding`` at the end only, so begin-pad ``b`` and end-pad ``e`` are ``padding=b`` and
``output_padding + b - e``, which torch takes while that stays in ``[0, max(stride, dilation))``; other pads (e.g.
SAME_UPPER with kernel 3, stride 2: ``(0, 1)``) run the full transposed conv and crop its output (an ``OnnxPad`` with
negative pads). SAME's pads do not depend on the input size (``total = output_padding + (kernel - 1) * dilation + 1
- stride``), so they hold at every input size.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from fxq.frontends.onnx.converters._common import dim_of, result
from fxq.frontends.onnx.converters.pad import OnnxPad
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxConvTransposeToShape"]

_CLASSES = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


def _pads(node: OnnxNode, graph: OnnxGraph, kernel: list[int], stride: list[int], dilation: list[int],
          out_pad: list[int]) -> list[tuple[int, int]] | None:
    """(begin, end) pad of each spatial dim, from ``pads``, ``auto_pad`` or ``output_shape``; None for an
    ``output_shape`` whose pads depend on an input size shape inference does not know."""
    a = node.attributes
    n = len(kernel)
    auto_pad = a.get("auto_pad", "NOTSET")  # onnx2torch decodes string attributes
    output_shape = a.get("output_shape")
    if output_shape is None and auto_pad in ("NOTSET", "VALID"):
        pads = list(a.get("pads", [0] * 2 * n)) if auto_pad == "NOTSET" else [0] * 2 * n
        return [(int(pads[i]), int(pads[n + i])) for i in range(n)]
    sizes = [dim_of(graph, node.input_values[0], 2 + i) for i in range(n)]
    if output_shape is None:  # SAME: out = in * stride, and the input size cancels out of the total
        sizes = [1] * n
    if any(s is None for s in sizes):
        return None  # output_shape on an input of unknown size: cropped when the module runs
    out = list(output_shape)[-n:] if output_shape is not None else [s * st for s, st in zip(sizes, stride)]
    return [_split(stride[i] * (sizes[i] - 1) + out_pad[i] + (kernel[i] - 1) * dilation[i] + 1 - int(out[i]),
                   auto_pad == "SAME_UPPER") for i in range(n)]


def _split(total: Any, upper: bool) -> tuple[Any, Any]:
    """(begin, end) of ONNX's ``total`` pad: the odd element at the end for SAME_UPPER, else at the start."""
    small = total // 2
    large = total - small
    return (small, large) if upper else (large, small)


class OnnxConvTransposeToShape(nn.Module):
    """``ConvTranspose`` with ``output_shape`` on an input whose size only the run knows: ``conv`` (no padding,
    the node's ``output_padding``) gives the full output, cropped to ``output_shape`` by pads computed from the
    input's size at each call, as ONNX computes them. Where an input is so small that ``output_shape`` exceeds the
    full output (negative pads), the extra positions are zeros here and the bias in onnxruntime. Inlined at load
    (:func:`~fxq.frontends.onnx.converters.auto_pad.inline_wrappers`), so the conv's weight is quantized and
    exports write the crop as shape arithmetic."""

    fxq_inline = True

    def __init__(self, conv: nn.Module, output_shape: list[int], upper: bool) -> None:
        super().__init__()
        self.conv = conv
        self.output_shape, self.upper = [int(v) for v in output_shape], upper

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        crop: list[Any] = []
        for i in reversed(range(len(self.output_shape))):  # F.pad order: last spatial dim first
            size = y.shape[2 + i]  # = stride * (in - 1) + output_padding + (kernel - 1) * dilation + 1
            begin, end = _split(size - self.output_shape[i], self.upper)
            crop += [-begin, -end]
        return F.pad(y, crop)

    def extra_repr(self) -> str:
        return f"output_shape={self.output_shape}, {'SAME_UPPER' if self.upper else 'SAME_LOWER'}"


@register_onnx_converter("ConvTranspose", (1, 11), override=True)
def _convert_conv_transpose(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    a = node.attributes
    weight = graph.initializers[node.input_values[1]].to_torch()
    has_bias = len(node.input_values) > 2 and node.input_values[2] != ""
    n = weight.dim() - 2
    if n not in _CLASSES:
        raise NotImplementedError(f"ConvTranspose with {n} spatial dims")
    groups = int(a.get("group", 1))
    kernel = [int(k) for k in a.get("kernel_shape", weight.shape[2:])]
    stride = [int(s) for s in a.get("strides", [1] * n)]
    dilation = [int(d) for d in a.get("dilations", [1] * n)]
    out_pad = [int(p) for p in a.get("output_padding", [0] * n)]
    pads = _pads(node, graph, kernel, stride, dilation, out_pad)
    if pads is None:  # the crop follows the input's size at run time
        if any(p >= max(st, d) for p, st, d in zip(out_pad, stride, dilation)):
            raise NotImplementedError(f"ConvTranspose: output_padding {out_pad} reaches stride {stride} / "
                                      f"dilation {dilation}: no nn.ConvTranspose form")
        conv = _conv(node, graph, weight, groups, kernel, stride, dilation, [0] * n, out_pad, has_bias)
        upper = a.get("auto_pad", "NOTSET") == "SAME_UPPER"
        return result(OnnxConvTransposeToShape(conv, list(a["output_shape"])[-n:], upper), node,
                      [node.input_values[0]])
    extras = [out_pad[i] + b - e for i, (b, e) in enumerate(pads)]
    crop = None
    if any(b < 0 or not 0 <= x < max(st, d) for (b, e), x, st, d in zip(pads, extras, stride, dilation)):
        bad = [i for i, ((b, e), p, st, d) in enumerate(zip(pads, out_pad, stride, dilation))
               if b < 0 or e < 0 or p >= max(st, d)]
        if bad:
            i = bad[0]
            raise NotImplementedError(f"ConvTranspose: pads {pads[i]} with output_padding {out_pad[i]} on spatial "
                                      f"dim {i} (stride {stride[i]}) have no nn.ConvTranspose form")
        crop = [-v for b, e in reversed(pads) for v in (b, e)]  # F.pad order, negative: crop the full output
        pads, extras = [(0, 0)] * n, out_pad
    module = _conv(node, graph, weight, groups, kernel, stride, dilation, [b for b, _ in pads], extras, has_bias)
    if crop is not None:
        module = nn.Sequential(module, OnnxPad(crop, "constant", rank=n + 2))
        module.fxq_inline = True  # the load inlines it: the conv stays visible to quantizers
    return result(module, node, [node.input_values[0]])


def _conv(node: OnnxNode, graph: OnnxGraph, weight: torch.Tensor, groups: int, kernel: list[int], stride: list[int],
          dilation: list[int], padding: list[int], output_padding: list[int], has_bias: bool) -> nn.Module:
    n = len(kernel)
    module = _CLASSES[n](weight.shape[0], weight.shape[1] * groups, kernel, stride=stride, padding=padding,
                         output_padding=output_padding, groups=groups, bias=has_bias, dilation=dilation)
    module.weight.data = weight
    if has_bias:
        module.bias.data = graph.initializers[node.input_values[2]].to_torch()
    return module
