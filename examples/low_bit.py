"""Low-bit quantization (seed 002): override bit width, symmetry and per-channel per call and per layer.

    python examples/low_bit.py [--fast]
"""
from __future__ import annotations

import argparse

import torch
import torchvision

import fxq


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fast", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    size = 64 if args.fast else 224
    calib = [torch.randn(4, 3, size, size) for _ in range(2 if args.fast else 8)]
    x = calib[0]
    with torch.no_grad():
        ref = model(x)

    # ONNX Runtime's QDQ format carries any bit width (as a narrowed int8/int4 grid); TensorRT's INT8 Q/DQ cannot,
    # so fxq refuses bit_width=4 on trt_int8 at prepare (academic_int4 simulates int4 without an exporter)
    results = {}
    for bits in (8, 6, 4):
        # per call: every quantizer of the platform at `bits`, symmetric, per-channel weights
        q = fxq.quantize(model, calib, platform="ort_int8", bit_width=bits, symmetrical=True, per_channel=True,
                         progress=False)
        with torch.no_grad():
            results[f"W{bits}A{bits}"] = float((q(x) - ref).pow(2).sum() / ref.pow(2).sum())

    # per layer: 4-bit everywhere but the first conv and the classifier, which stay at 8 bits
    setting = fxq.QuantizationSetting(dispatching_table={r"layer\d.*": {"bit_width": 4}})
    q = fxq.quantize(model, calib, platform="ort_int8", setting=setting, progress=False)
    with torch.no_grad():
        results["mixed 4/8"] = float((q(x) - ref).pow(2).sum() / ref.pow(2).sum())

    for name, noise in results.items():
        print(f"{name:>10}: output noise/signal {noise:.3%}")
    return results


if __name__ == "__main__":
    main()
