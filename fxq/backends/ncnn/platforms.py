"""NCNN INT8: only the inputs of conv/gemm (and MatMul by a constant matrix) are quantized ([-127,127], half away
from zero)."""
from typing import Any

from torch import fx

from fxq.graph.info import computed_from_parameters
from fxq.graph.op_types import weight_shape
from fxq.qconfig.base import Capability, Platform, RoleCapability, _int_config, register_platform
from fxq.spec import RoundingPolicy, TensorQuantConfig

NCNN_OPS = frozenset({"Conv", "Gemm", "MatMul"})  # MatMul: by a constant matrix only (its op rule)


def _only_2d_int8_conv(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """2-D only: ncnn's Convolution1D / Convolution3D (and their depthwise forms) have no int8 path."""
    shape = weight_shape(node, gm)
    if shape is not None and len(shape) in (3, 5):
        return f"ncnn has no int8 {len(shape) - 2}-D convolution (Convolution{len(shape) - 2}D runs in FP32)"
    return None


def _matmul_by_matrix_only(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """by a constant 2-D matrix only (an int8 InnerProduct): ncnn's MatMul of two activations has no int8 form."""
    return None if is_matmul_by_matrix(node) else "ncnn runs a MatMul int8 only by a constant 2-D matrix"


@register_platform("ncnn_int8")
class NcnnInt8(Platform):
    exporter = "ncnn"
    description = ("NCNN INT8: inputs of Conv/Gemm/MatMul by a constant matrix sym [-127,127], weights per-channel "
                   "(6-bit for 3x3 s1 d1 convs that ncnn runs as Convolution: groups 1, and each group of a grouped "
                   "conv that is not depthwise), outputs FP32, rounding half away from zero")
    activation = _int_config(8, True, narrow=True)
    weight = _int_config(8, True, narrow=True, per_channel=True)
    quantized_ops = NCNN_OPS
    input_quantized_ops = NCNN_OPS
    quantize_outputs = False
    rounding = RoundingPolicy.HALF_FAR_FROM_ZERO
    capability = Capability(  # rounding is not a rule: ncnn's ties differ by one step at most (a warning at export)
        rule="ncnn_int8 exports ncnn int8 layers (inputs per tensor, symmetric, [-127, 127]; weights symmetric, "
             "at most 8 bits, [-qmax, qmax], per output channel; FP32 biases)",
        activation=RoleCapability(bits=frozenset({8}), symmetric=True, narrow=True, per_channel=False,
                                  formats=frozenset({"int"})),
        # axis -1: the output channels of a MatMul's (K, N) weight (the exporter checks each layer's axis)
        weight=RoleCapability(bits=frozenset(range(2, 9)), symmetric=True, narrow=True, axes=frozenset({0, -1}),
                              formats=frozenset({"int"})),
        quantized_bias=False,
        ops=NCNN_OPS,  # the inputs / weights of Convolution(DepthWise) and InnerProduct, nothing else
        op_rules={"Conv": _only_2d_int8_conv, "MatMul": _matmul_by_matrix_only},
        hint="use platform='academic_int8' / 'academic_int4' for simulation-only schemes",
    )

    def weight_config(self, op_type: str, node_name: str, weight_shape: tuple[int, ...] | None,
                      op_attrs: dict[str, Any]) -> TensorQuantConfig:
        cfg = super().weight_config(op_type, node_name, weight_shape, op_attrs)
        if op_type == "Conv" and _is_3x3_s1_d1_convolution(weight_shape, op_attrs):
            cfg = cfg.replace(num_bits=6, quant_min=-31, quant_max=31)
        return cfg


def _is_3x3_s1_d1_convolution(shape: tuple[int, ...] | None, attrs: dict[str, Any]) -> bool:
    """A 3x3 stride-1 dilation-1 conv that ncnn runs as int8 ``Convolution`` (its int8 winograd kernel): groups 1,
    or a grouped conv that is not depthwise (the exporter writes one Convolution a group; ncnn's own
    ConvolutionDepthWise runs such a conv as one Convolution a group too)."""
    if shape is None or len(shape) != 4 or tuple(shape[2:]) != (3, 3):
        return False
    ones = (1, 1)
    if pair(attrs.get("stride", 1)) != ones or pair(attrs.get("dilation", 1)) != ones:
        return False
    groups = int(attrs.get("groups", 1))
    return groups == 1 or not is_depthwise(shape, groups)


def is_depthwise(weight_shape: Any, groups: int) -> bool:
    """ncnn's depthwise case of ConvolutionDepthWise: one input and one output channel a group."""
    return int(weight_shape[0]) == groups and int(weight_shape[1]) == 1


def pair(v: Any) -> tuple[int, int]:
    """A conv's int-or-sequence attribute (stride, padding...) as two ints."""
    if isinstance(v, (list, tuple)):
        return (int(v[0]), int(v[0])) if len(v) == 1 else (int(v[0]), int(v[1]))
    return int(v), int(v)


def is_matmul_by_matrix(node: fx.Node) -> bool:
    """Whether a MatMul node multiplies a computed value by a 2-D matrix computed from parameters only
    (``x @ W``, ONNX's ``MatMul(x, W)`` of a Linear layer)."""
    if len(node.args) < 2 or not all(isinstance(a, fx.Node) for a in node.args[:2]):
        return False
    lhs, rhs = node.args[:2]
    val = rhs.meta.get("val")
    return (getattr(val, "ndim", 0) == 2 and computed_from_parameters(rhs) and not computed_from_parameters(lhs))
