"""TensorRT: INT8 explicit quantization (sym per-tensor activations, per-channel weights) and FP8 E4M3."""
from fxq.qconfig.base import ACTIVATION_OPS, COMPUTING_OPS, ELEMENTWISE_OPS, PASSIVE_OPS, Platform, register_platform
from fxq.spec import FloatFormat, RoundingPolicy, TensorQuantConfig

TRT_QUANTIZED_OPS = (
    COMPUTING_OPS | ELEMENTWISE_OPS | ACTIVATION_OPS | PASSIVE_OPS
    | {"MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Concat", "Resize", "Softmax",
       "LayerNormalization", "ReduceMean"}
)


@register_platform("trt_int8")
class TensorRTInt8(Platform):
    exporter = "tensorrt"
    description = "TensorRT INT8 explicit Q/DQ: activations sym int8 [-128,127], weights sym per-channel [-127,127]"
    quantized_ops = frozenset(TRT_QUANTIZED_OPS)
    rounding = RoundingPolicy.HALF_EVEN


@register_platform("trt_fp8")
class TensorRTFp8(Platform):
    exporter = "tensorrt"
    description = "TensorRT FP8 E4M3: per-tensor activations, per-channel weights, inputs of GEMM-like ops"
    activation = TensorQuantConfig(num_bits=8, fp_format=FloatFormat.E4M3)
    weight = TensorQuantConfig(num_bits=8, fp_format=FloatFormat.E4M3, per_channel=True)
    activation_observer = "floating"
    quantize_outputs = False
    input_quantized_ops = COMPUTING_OPS
    quantized_ops = COMPUTING_OPS
