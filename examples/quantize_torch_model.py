"""Quantize a torchvision model for TensorRT INT8 in one call and compare it with FP32.

    python examples/quantize_torch_model.py [--fast]
"""
from __future__ import annotations

import argparse

import torch
import torchvision

import fxq


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fast", action="store_true", help="small inputs and few batches (for tests)")
    parser.add_argument("--platform", default="trt_int8")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()  # seeded random weights, no download
    size, batches = (64, 2) if args.fast else (224, 8)
    calib = [torch.randn(8, 3, size, size) for _ in range(batches)]

    setting = fxq.QuantizationSetting()  # PPQ's defaults: conservative dispatch, fusion, alignment
    qmodel = fxq.quantize(model, calib, platform=args.platform, setting=setting)
    print(fxq.summary(qmodel))

    x = calib[0]
    with torch.no_grad():
        ref, out = model(x), qmodel(x)
    noise = float((out - ref).pow(2).sum() / ref.pow(2).sum())
    print(f"output noise/signal power: {noise:.4%}")
    return noise


if __name__ == "__main__":
    main()
