"""ONNX Runtime QDQ INT8: asym uint8 activations, sym per-channel int8 weights, half-even."""
from fxq.qconfig.base import Platform, _int_config, register_platform
from fxq.qconfig.tensorrt import TRT_QUANTIZED_OPS


@register_platform("ort_int8")
class OrtInt8(Platform):
    description = "ONNX Runtime QDQ: activations asym uint8 [0,255], weights sym per-channel int8 [-127,127]"
    activation = _int_config(8, False)
    weight = _int_config(8, True, narrow=True, per_channel=True)
    quantized_ops = frozenset(TRT_QUANTIZED_OPS - {"LayerNormalization", "Softmax", "Gelu", "Silu", "HardSwish",
                                                   "HardSigmoid", "Elu", "Tanh", "PRelu"})
