"""NCNN INT8: only the inputs of conv/gemm are quantized ([-127,127], half away from zero)."""
from typing import Any

from fxq.qconfig.base import Capability, Platform, RoleCapability, _int_config, register_platform
from fxq.spec import RoundingPolicy, TensorQuantConfig

NCNN_OPS = frozenset({"Conv", "Gemm"})


@register_platform("ncnn_int8")
class NcnnInt8(Platform):
    exporter = "ncnn"
    description = ("NCNN INT8: inputs of Conv/Gemm sym [-127,127], weights per-channel (6-bit for 3x3 s1 d1 g1 "
                   "convs; per-tensor for grouped convs with several channels a group), outputs FP32, rounding half "
                   "away from zero")
    activation = _int_config(8, True, narrow=True)
    weight = _int_config(8, True, narrow=True, per_channel=True)
    quantized_ops = NCNN_OPS
    input_quantized_ops = NCNN_OPS
    quantize_outputs = False
    rounding = RoundingPolicy.HALF_FAR_FROM_ZERO
    capability = Capability(  # rounding is not a rule: ncnn's ties differ by one step at most (a warning at export)
        rule="ncnn_int8 exports ncnn int8 layers (inputs per tensor, symmetric, [-127, 127]; weights symmetric, "
             "at most 8 bits, [-qmax, qmax]; FP32 biases)",
        activation=RoleCapability(bits=frozenset({8}), symmetric=True, narrow=True, per_channel=False,
                                  formats=frozenset({"int"})),
        weight=RoleCapability(bits=frozenset(range(2, 9)), symmetric=True, narrow=True, formats=frozenset({"int"})),
        quantized_bias=False,
        hint="use platform='academic_int8' / 'academic_int4' for simulation-only schemes",
    )

    def weight_config(self, op_type: str, node_name: str, weight_shape: tuple[int, ...] | None,
                      op_attrs: dict[str, Any]) -> TensorQuantConfig:
        cfg = super().weight_config(op_type, node_name, weight_shape, op_attrs)
        if op_type == "Conv" and _is_3x3_s1_d1_g1(weight_shape, op_attrs):
            cfg = cfg.replace(num_bits=6, quant_min=-31, quant_max=31)
        groups = int(op_attrs.get("groups", 1))
        if op_type == "Conv" and groups > 1 and weight_shape and weight_shape[0] != groups and cfg.per_channel:
            # ncnn's int8 ConvolutionDepthWise takes one weight scale per group; a group of several output
            # channels (RegNet, ResNeXt) gets one scale for the whole conv, which ncnn can express
            cfg = cfg.replace(per_channel=False)
        return cfg


def _is_3x3_s1_d1_g1(shape: tuple[int, ...] | None, attrs: dict[str, Any]) -> bool:
    if shape is None or len(shape) != 4 or tuple(shape[2:]) != (3, 3):
        return False
    ones = (1, 1)
    return (_pair(attrs.get("stride", 1)) == ones and _pair(attrs.get("dilation", 1)) == ones
            and int(attrs.get("groups", 1)) == 1)


def _pair(v: Any) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    return (v[0], v[0]) if len(v) == 1 else (v[0], v[1])
