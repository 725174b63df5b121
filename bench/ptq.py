"""PTQ wall time relative to one FP32 forward pass over the same calibration data.

    python bench/ptq.py [--models resnet18 mobilenet_v2] [--sources native onnx] [--batches 8] [--batch-size 8]
                        [--repeat 2] [--device cpu|cuda]

For each model and source: time one FP32 pass of the torchvision model over the batches (the floor), then the
PTQ with the default TRT_INT8 setting on the same batches, then the FP32 pass again; report PTQ / mean(FP32).
``native``: ``fxq.quantize(model, ...)``; ``onnx``: ``fxq.load_onnx(file)`` + ``fxq.quantize`` of a file the
model was exported to beforehand (torch.onnx, opset 13, dynamic batch; the export is not timed). Ratios are
measured in one process, back to back — run on a quiet machine. Goal: <= 1.2x, the limit being ~1x (one observed
pass). PPQ 0.6.6 on the same 2-core CPU: 4.5-4.7x on ResNet-18, 6.2-6.8x on MobileNetV2.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time

import torch
import torchvision
from _host import add_allocator_argument, add_device_argument, apply_allocator, device_line, synchronize

import fxq


def fp32_pass(model: torch.nn.Module, data: list[torch.Tensor]) -> float:
    device = data[0].device.type
    synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        for x in data:
            model(x)
    synchronize(device)
    return time.perf_counter() - start


def bench(name: str, source: str, batches: int, batch_size: int, repeat: int, device: str = "cpu") -> dict:
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().eval().to(device)
    data = [torch.randn(batch_size, 3, 224, 224, device=device) for _ in range(batches)]
    fp32_pass(model, data[:1])  # warm-up
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.onnx")
        if source == "onnx":
            torch.onnx.export(model, (data[0][:1],), path, dynamo=False, opset_version=13, input_names=["x"],
                              dynamic_axes={"x": {0: "n"}})
        ratios = []
        for _ in range(repeat):
            before = fp32_pass(model, data)
            start = time.perf_counter()
            subject = fxq.load_onnx(path).to(device) if source == "onnx" else model
            loaded = time.perf_counter() - start
            fxq.quantize(subject, data, "trt_int8", progress=False)
            synchronize(device)
            quant = time.perf_counter() - start
            after = fp32_pass(model, data)
            floor = (before + after) / 2
            ratios.append(quant / floor)
            load = f" (load_onnx {loaded:5.2f} s)" if source == "onnx" else ""
            print(f"{name:14s} {source:6s} fp32 pass {floor:6.2f} s   PTQ {quant:6.2f} s{load}   "
                  f"ratio {quant / floor:4.2f}x", flush=True)
    return {"model": name, "source": source, "median_ratio": statistics.median(ratios), "ratios": ratios}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--sources", nargs="+", choices=["native", "onnx"], default=["native", "onnx"])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    add_allocator_argument(parser)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    allocator = apply_allocator(args.allocator)
    logging.basicConfig(level=logging.WARNING)
    print(f"{device_line(args.device)}, {allocator}")
    results = [bench(m, s, args.batches, args.batch_size, args.repeat, args.device)
               for m in args.models for s in args.sources]
    for r in results:
        print(f"{r['model']:14s} {r['source']:6s} PTQ / FP32 forward: median {r['median_ratio']:.2f}x, "
              f"range {min(r['ratios']):.2f}-{max(r['ratios']):.2f}x over {len(r['ratios'])} runs (goal <= 1.2x)")
    return results


if __name__ == "__main__":
    main()
