"""Add your own platform (seed 001): subclass ``fxq.Platform``, set its schemes, register it.

The academic-style platform below quantizes only the inputs of computing ops: activations
asymmetric uint8 with a percentile observer, weights symmetric per-tensor int8, biases 30-bit passive.

    python examples/custom_platform.py [--fast]
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
import torchvision

import fxq
from fxq.spec import TensorQuantConfig


@fxq.register_platform("my_academic_int8", override=True)
class MyAcademicInt8(fxq.Platform):
    description = "inputs of Conv/Gemm/ConvTranspose: uint8 activations, int8 per-tensor weights"
    activation = TensorQuantConfig(num_bits=8, symmetric=False)  # [0, 255]
    weight = TensorQuantConfig(num_bits=8, symmetric=True, quant_min=-128, quant_max=127)
    bias_bits = 30
    quantized_ops = frozenset({"Conv", "Gemm", "ConvTranspose"})
    input_quantized_ops = quantized_ops
    quantize_outputs = False  # outputs of quantized ops stay FP32
    activation_observer = "percentile"
    weight_observer = "minmax"
    rounding = fxq.RoundingPolicy.HALF_EVEN

    def weight_config(self, op_type: str, node_name: str, weight_shape: Any, op_attrs: dict) -> TensorQuantConfig:
        cfg = super().weight_config(op_type, node_name, weight_shape, op_attrs)
        if node_name == "fc":  # a per-layer rule: the classifier gets per-channel weights
            cfg = cfg.replace(per_channel=True, channel_axis=0)
        return cfg


def main(argv: list[str] | None = None) -> fxq.QuantSummary:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fast", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    size = 64 if args.fast else 224
    calib = [torch.randn(4, 3, size, size) for _ in range(2 if args.fast else 8)]
    qmodel = fxq.quantize(model, calib, platform="my_academic_int8")
    report = fxq.summary(qmodel)
    print(report)
    return report


if __name__ == "__main__":
    main()
