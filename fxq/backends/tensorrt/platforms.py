"""TensorRT: INT8 explicit quantization (sym per-tensor activations, per-channel weights) and FP8 E4M3."""
from fxq.qconfig.base import (
    ACTIVATION_OPS,
    COMPUTING_OPS,
    ELEMENTWISE_OPS,
    PASSIVE_OPS,
    RECURRENT_OPS,
    Capability,
    Platform,
    RoleCapability,
    register_platform,
)
from fxq.spec import FloatFormat, RoundingPolicy, TensorQuantConfig

TRT_QUANTIZED_OPS = (
    COMPUTING_OPS | ELEMENTWISE_OPS | ACTIVATION_OPS | PASSIVE_OPS
    | {"MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Concat", "Resize", "Softmax",
       "LayerNormalization", "ReduceMean"}
    | RECURRENT_OPS  # Q/DQ on X and on the W / R weight inputs (per direction, gate and channel)
)


@register_platform("trt_int8")
class TensorRTInt8(Platform):
    exporter = "tensorrt"
    description = "TensorRT INT8 explicit Q/DQ: activations sym int8 [-128,127], weights sym per-channel [-127,127]"
    quantized_ops = frozenset(TRT_QUANTIZED_OPS)
    rounding = RoundingPolicy.HALF_EVEN
    capability = Capability(
        rule="trt_int8 exports TensorRT INT8 Q/DQ (symmetric int8, per-tensor activations in [-128, 127] rounded "
             "half to even)",
        activation=RoleCapability(bits=frozenset({8}), symmetric=True, narrow=False, per_channel=False,
                                  formats=frozenset({"int"}), rounding=frozenset({RoundingPolicy.HALF_EVEN})),
        weight=RoleCapability(bits=frozenset({8}), symmetric=True, formats=frozenset({"int"})),
        hint="use platform='academic_int4' / 'academic_mix' for simulation-only low-bit or asymmetric schemes, or "
             "'ort_int8' for ones exported as ONNX Runtime QDQ",
    )


@register_platform("trt_fp8")
class TensorRTFp8(Platform):
    exporter = "tensorrt"
    description = "TensorRT FP8 E4M3: per-tensor activations, per-channel weights, inputs of GEMM-like ops"
    activation = TensorQuantConfig(num_bits=8, fp_format=FloatFormat.E4M3)
    weight = TensorQuantConfig(num_bits=8, fp_format=FloatFormat.E4M3, per_channel=True)
    activation_observer = "floating"
    capability = Capability(
        rule="trt_fp8 exports TensorRT FP8 E4M3 Q/DQ (symmetric, per-tensor activations rounded half to even)",
        activation=RoleCapability(bits=frozenset({8}), symmetric=True, per_channel=False, formats=frozenset({"e4m3"}),
                                  rounding=frozenset({RoundingPolicy.HALF_EVEN})),
        weight=RoleCapability(bits=frozenset({8}), symmetric=True, formats=frozenset({"e4m3"})),
        hint="drop the bit_width / symmetrical override, or use 'trt_int8' for integer quantization",
    )
    quantize_outputs = False
    input_quantized_ops = COMPUTING_OPS
    quantized_ops = COMPUTING_OPS
