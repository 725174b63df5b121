"""ONNX Runtime QDQ INT8: asym uint8 activations, sym per-channel int8 weights, int32 passive bias, half-even.

The bias is int32 on the grid s_in * s_w because that is what onnxruntime runs: with graph optimizations on (its
default) DQ -> Conv/Gemm -> Q groups become QLinearConv / QGemm, which add an int32 bias to the integer
accumulator and quantize an FP32 bias themselves when the model has one. Simulating an FP32 bias instead left
~2 codes in 10^4 one LSB off on BatchNorm-folded models; with the int32 bias the runtime's codes are the
simulation's (tests/test_export_onnx.py).
"""
from fxq.backends.tensorrt.platforms import TRT_QUANTIZED_OPS
from fxq.qconfig.base import Capability, Platform, RoleCapability, _int_config, register_platform
from fxq.spec import RoundingPolicy


@register_platform("ort_int8")
class OrtInt8(Platform):
    description = ("ONNX Runtime QDQ: activations asym uint8 [0,255], weights sym per-channel int8 [-127,127], "
                   "bias int32 (s_in * s_w)")
    activation = _int_config(8, False)
    weight = _int_config(8, True, narrow=True, per_channel=True)
    quantized_ops = frozenset(TRT_QUANTIZED_OPS - {"LayerNormalization", "Softmax", "Gelu", "Silu", "HardSwish",
                                                   "HardSigmoid", "Elu", "Tanh", "PRelu"})
    bias_bits = 32
    integer_softmax_reciprocal = True  # a default session runs DQ -> Softmax -> Q as QLinearSoftmax
    capability = Capability(  # 2..8 bits as (u)int8 with a clip, 4 / 16 bits as (u)int4 / (u)int16 at opset 21, FP8
        rule="ort_int8 exports ONNX QDQ, whose QuantizeLinear rounds activations half to even",
        activation=RoleCapability(rounding=frozenset({RoundingPolicy.HALF_EVEN})),
    )


@register_platform("ort_int8_reduce_range")
class OrtInt8ReduceRange(OrtInt8):
    description = ("ONNX Runtime QDQ for x86 CPUs without VNNI: ort_int8 with 7-bit weights [-63, 63] (onnxruntime's "
                   "reduce_range), which its int8 kernels cannot saturate")
    weight = _int_config(7, True, narrow=True, per_channel=True)
