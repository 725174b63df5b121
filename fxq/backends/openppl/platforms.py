"""OpenPPL CUDA INT8: sym per-tensor activations, per-channel weights, int32 passive bias."""
from fxq.qconfig.base import COMPUTING_OPS, Capability, Platform, RoleCapability, register_platform
from fxq.spec import RoundingPolicy


@register_platform("ppl_cuda_int8")
class PPLCudaInt8(Platform):
    exporter = "openppl"
    description = "OpenPPL CUDA INT8: activations sym int8, weights sym per-channel, bias int32 (s_in * s_w)"
    quantized_ops = frozenset(
        COMPUTING_OPS
        | {"MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Add", "Mul", "Concat", "Resize",
           "Relu", "Clip", "PRelu", "Sigmoid", "Split", "Slice", "Reshape", "Transpose", "Flatten", "ReduceMean",
           "Squeeze", "Unsqueeze", "Identity"}
    )
    quantize_passive_constants = True  # clip bounds / pad values share their input's scale
    bias_bits = 32
    rounding = RoundingPolicy.HALF_EVEN
    capability = Capability(
        rule="ppl_cuda_int8 exports an FP32 ONNX plus ppl.nn quantization json (integer grids, activations rounded "
             "half to even)",
        activation=RoleCapability(formats=frozenset({"int"}), rounding=frozenset({RoundingPolicy.HALF_EVEN})),
        weight=RoleCapability(formats=frozenset({"int"})),
        hint="use 'trt_fp8' for FP8",
    )
