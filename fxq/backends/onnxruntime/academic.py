"""Academic settings for paper reproduction: only inputs of computing ops are quantized.

ACADEMIC_INT8: asym uint8 activations, sym per-tensor int8 weights, 30-bit passive bias.
ACADEMIC_INT4: the same at 4 bits. ACADEMIC_MIX: W4A8 (int4 weights, uint8 activations).
"""
from fxq.qconfig.base import COMPUTING_OPS, Platform, _int_config, register_platform

ACADEMIC_OPS = frozenset({"Conv", "Gemm", "ConvTranspose", "MatMul"})


@register_platform("academic_int8")
class AcademicInt8(Platform):
    description = "academic W8A8: activations asym uint8 (inputs of computing ops), weights sym per-tensor int8"
    activation = _int_config(8, False)
    weight = _int_config(8, True, per_channel=False)
    bias_bits = 30
    quantized_ops = ACADEMIC_OPS
    input_quantized_ops = ACADEMIC_OPS
    quantize_outputs = False


@register_platform("academic_int4")
class AcademicInt4(AcademicInt8):
    description = "academic W4A4: activations asym uint4, weights sym per-tensor int4"
    activation = _int_config(4, False)
    weight = _int_config(4, True, per_channel=False)


@register_platform("academic_mix")
class AcademicMix(AcademicInt8):
    description = "academic W4A8 mix: activations asym uint8, weights sym per-tensor int4"
    weight = _int_config(4, True, per_channel=False)


__all__ = ["AcademicInt8", "AcademicInt4", "AcademicMix", "COMPUTING_OPS"]
