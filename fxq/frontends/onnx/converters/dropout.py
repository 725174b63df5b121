"""``Dropout`` with its optional ``mask`` output (every schema version).

onnx2torch 1.5.15 converts ``Dropout-10`` to ``nn.Dropout`` but maps both of the node's outputs onto it, so a file
that names the mask (onnx-caffe2's AlexNet, VGG, SqueezeNet and GoogLeNet do) got ``x[0]`` and ``x[1]`` for the
output and the mask: the batch dim was gone; versions 1-7 had no converter. In inference, Dropout passes its input
through. The mask is all ones from version 12 on (the spec's "kept" mask). Before 12 the spec leaves the inference
mask undefined and onnxruntime, where such files run, returns all zeros (onnx's reference evaluator: ones): fxq
follows onnxruntime. The mask is bool from version 10 on, the input's type before. In training mode the module
drops as ``F.dropout`` does and returns the mask it drew. A mask nothing reads is dropped from the node before
conversion (:func:`fxq.frontends.onnx.cleanup.drop_unread_optional_outputs`): the node is then an ``nn.Dropout``,
which preparation removes.
"""
from __future__ import annotations

from typing import Callable

import torch
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OnnxMapping, OperationConverterResult
from torch import nn

from fxq.frontends.onnx.converters._common import const_input, result
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxDropoutWithMask"]


class OnnxDropoutWithMask(nn.Module):
    """Dropout returning ``(output, mask)``.

    Args:
        p: the drop probability (used in training mode only).
        bool_mask: the mask is ``bool`` (Dropout-10 and later) rather than the input's dtype.
        inference_mask: the mask's value in inference, ``True`` everywhere (Dropout-12 and later) or ``False``
            (onnxruntime's for earlier versions).
    """

    def __init__(self, p: float = 0.5, bool_mask: bool = True, inference_mask: bool = True) -> None:
        super().__init__()
        self.p = float(p)
        self.bool_mask = bool(bool_mask)
        self.inference_mask = bool(inference_mask)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.training and self.p > 0:
            keep = torch.rand_like(x) >= self.p
            out = x * keep / (1.0 - self.p)
        else:
            keep = torch.full_like(x, self.inference_mask, dtype=torch.bool)
            out = x
        return out, keep if self.bool_mask else keep.to(x.dtype)

    def extra_repr(self) -> str:
        return f"p={self.p}, bool_mask={self.bool_mask}, inference_mask={self.inference_mask}"


def _converter(version: int) -> Callable[[OnnxNode, OnnxGraph], OperationConverterResult]:
    def convert(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
        if version >= 12:  # ratio is an input
            ratio_t = const_input(node, graph, 1, "ratio")
            ratio = float(ratio_t.reshape(-1)[0]) if ratio_t is not None else 0.5
        else:
            ratio = float(node.attributes.get("ratio", 0.5))
        data = node.input_values[0]
        if len([o for o in node.output_values if o]) < 2:  # the loader's clean-up drops a mask nobody reads
            return OperationConverterResult(
                torch_module=nn.Dropout(ratio), onnx_mapping=OnnxMapping(inputs=(data,), outputs=(node.output_values[0],)))
        return result(OnnxDropoutWithMask(ratio, bool_mask=version >= 10, inference_mask=version >= 12), node, [data])

    return convert


for _version in (1, 6, 7, 10, 12, 13, 22):
    register_onnx_converter("Dropout", _version, override=True)(_converter(_version))
