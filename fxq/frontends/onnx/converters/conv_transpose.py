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

from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from fxq.frontends.onnx.converters._common import dim_of, result
from fxq.frontends.onnx.converters.pad import OnnxPad
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__: list[str] = []

_CLASSES = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


def _pads(node: OnnxNode, graph: OnnxGraph, kernel: list[int], stride: list[int], dilation: list[int],
          out_pad: list[int]) -> list[tuple[int, int]]:
    """(begin, end) pad of each spatial dim, from ``pads``, ``auto_pad`` or ``output_shape``."""
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
        raise NotImplementedError("ConvTranspose: output_shape / auto_pad need the input's spatial size, which shape "
                                  "inference does not know (pass input_shapes to load_onnx)")
    out = list(output_shape)[-n:] if output_shape is not None else [s * st for s, st in zip(sizes, stride)]
    result_pads = []
    for i in range(n):
        total = stride[i] * (sizes[i] - 1) + out_pad[i] + (kernel[i] - 1) * dilation[i] + 1 - int(out[i])
        small, large = total // 2, total - total // 2
        result_pads.append((small, large) if auto_pad == "SAME_UPPER" else (large, small))
    return result_pads


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
    module: nn.Module = _CLASSES[n](weight.shape[0], weight.shape[1] * groups, kernel, stride=stride,
                                    padding=[b for b, _ in pads], output_padding=extras, groups=groups, bias=has_bias,
                                    dilation=dilation)
    module.weight.data = weight
    if has_bias:
        module.bias.data = graph.initializers[node.input_values[2]].to_torch()
    if crop is not None:
        module = nn.Sequential(module, OnnxPad(crop, "constant", rank=n + 2))
        module.fxq_inline = True  # the load inlines it: the conv stays visible to quantizers
    return result(module, node, [node.input_values[0]])
