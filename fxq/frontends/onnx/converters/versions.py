"""Newer schema versions of ops onnx2torch already converts at an older version.

Two kinds, each checked against the ONNX schema history (inputs, outputs, attributes and op docs compared):

- **type-only bumps**: the newer version only widens the allowed types (bfloat16, float8, int4, ...), so the older
  converter is right as is. The converter is looked up when a model is converted, never copied.
- **bumps with new options**: the older converter is right when the new options keep their defaults
  (``AveragePool-19`` dilations); other values raise ``NotImplementedError`` naming the option, which the loader
  reports with the node. (``ScatterND``, every version, has a converter of its own: :mod:`.scatter`.)
"""
from __future__ import annotations

from typing import Callable

from onnx2torch.node_converters.registry import get_converter
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult

from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["TYPE_ONLY_BUMPS"]

# op type -> (version onnx2torch converts, newer since_versions that only add types)
TYPE_ONLY_BUMPS: dict[str, tuple[int, tuple[int, ...]]] = {
    "Acos": (7, (22,)),
    "Asin": (7, (22,)),
    "Atan": (7, (22,)),
    "Cos": (7, (22,)),
    "Sin": (7, (22,)),
    "Tan": (7, (22,)),
    "Celu": (12, (28,)),
    "Constant": (13, (19, 21, 23, 24, 25)),
    "ConstantOfShape": (9, (20, 21, 23, 24, 25)),
    "Conv": (11, (22,)),
    "ConvTranspose": (11, (22,)),
    "DepthToSpace": (13, (28,)),
    "Einsum": (12, (28,)),
    "Elu": (6, (22,)),
    "Equal": (13, (19,)),
    "EyeLike": (9, (22,)),
    "Flatten": (13, (21, 23, 24, 25)),
    "GlobalAveragePool": (1, (22,)),
    "GreaterOrEqual": (12, (16,)),
    "LessOrEqual": (12, (16,)),
    "HardSigmoid": (6, (22,)),
    "HardSwish": (14, (22,)),
    "Identity": (16, (19, 21, 23, 24, 25)),
    "InstanceNormalization": (6, (22,)),
    "IsInf": (10, (20,)),
    "IsNaN": (13, (20,)),
    "MaxPool": (12, (22,)),
    "Range": (11, (27,)),
    "RoiAlign": (16, (22,)),
    "Round": (11, (22,)),
    "Selu": (6, (22,)),
    "Shape": (15, (19, 21, 23, 24, 25)),
    "Softplus": (1, (22,)),
    "Softsign": (1, (22,)),
    "Squeeze": (21, (23, 24, 25)),
    "TopK": (11, (24,)),
    "Transpose": (13, (21, 23, 24, 25)),
    "Unsqueeze": (13, (21, 23, 24, 25)),
    # Cast-19+ adds saturate/round_mode, which only affect float8/float4 targets that onnx2torch cannot cast to
    "Cast": (13, (19, 21, 23, 24, 25, 28)),
}

Converter = Callable[[OnnxNode, OnnxGraph], OperationConverterResult]


def _delegate(op_type: str, version: int, check: Callable[[OnnxNode], None] | None = None) -> Converter:
    """A converter that runs ``check`` and then onnx2torch's ``op_type`` converter at ``version``."""

    def convert(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
        if check is not None:
            check(node)
        return get_converter(operation_type=op_type, version=version)(node, graph)

    convert.__name__ = f"delegate_{op_type}_{version}"
    return convert


def _check_average_pool(node: OnnxNode) -> None:
    dilations = node.attributes.get("dilations")
    if dilations and any(int(d) != 1 for d in dilations):
        raise NotImplementedError(f"AveragePool: dilations={list(dilations)} (torch's avg_pool has no dilation)")


for _op, (_old, _new) in TYPE_ONLY_BUMPS.items():
    register_onnx_converter(_op, _new)(_delegate(_op, _old))

register_onnx_converter("AveragePool", (19, 22))(_delegate("AveragePool", 11, _check_average_pool))
