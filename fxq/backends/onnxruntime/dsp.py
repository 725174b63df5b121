"""DSP / SNPE INT8: everything asymmetric uint8 per tensor, 30-bit passive bias."""
from fxq.qconfig.base import COMPUTING_OPS, Platform, _int_config, register_platform


@register_platform("dsp_int8")
class DspInt8(Platform):
    description = "DSP/SNPE: activations and weights asym per-tensor uint8 [0,255], bias 30-bit passive"
    activation = _int_config(8, False)
    weight = _int_config(8, False, per_channel=False)
    quantize_passive_constants = True  # clip bounds / pad values share their input's scale
    bias_bits = 30
    quantized_ops = frozenset(
        COMPUTING_OPS | {"MaxPool", "AveragePool", "GlobalAveragePool", "Add", "Mul", "Concat", "Resize", "Relu",
                         "Clip", "Sigmoid", "Reshape", "Transpose", "Flatten", "Slice", "Split", "Softmax",
                         "ReduceMean", "Squeeze", "Unsqueeze", "Identity", "Pad"}
    )
