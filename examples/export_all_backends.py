"""Quantize one model for each backend fxq can export to, and export it.

For every registered exporter (TensorRT, ONNX Runtime, OpenPPL, and NCNN when its exporter is registered)
the model is quantized for that backend's platform and written with ``fxq.export``; the Q/DQ models are
then run once in onnxruntime (when installed) next to fxq's simulation.

Usage::

    python examples/export_all_backends.py            # torchvision ResNet-18, 224x224 (seeded random weights)
    python examples/export_all_backends.py --fast     # a small CNN, 32x32: a few seconds
    python examples/export_all_backends.py --out DIR  # where the files go (default: fxq_out/export_all)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

import fxq
from fxq.backends import EXPORTERS

PLATFORM_OF = {"tensorrt": "trt_int8", "onnxruntime": "ort_int8", "openppl": "ppl_cuda_int8", "ncnn": "ncnn_int8"}


class SmallCNN(nn.Module):
    """Conv-BN-ReLU stem, a residual block, global pooling and a classifier."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.conv1 = nn.Conv2d(16, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.relu = nn.ReLU()
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.stem(x))
        y = self.conv2(self.relu(self.conv1(x)))
        return self.head(self.relu(x + y))


def build(fast: bool) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    if fast:
        model, shape, batches = SmallCNN(), (4, 3, 32, 32), 2
    else:
        import torchvision

        model, shape, batches = torchvision.models.resnet18(), (8, 3, 224, 224), 8
    return model.eval(), [torch.randn(*shape) for _ in range(batches)]


def check_with_onnxruntime(path: Path, qmodel: nn.Module, x: torch.Tensor) -> str:
    try:
        import onnxruntime as ort
    except ImportError:
        return "onnxruntime not installed"
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    with torch.no_grad():
        ref = qmodel(x)
    cos = torch.nn.functional.cosine_similarity(got.flatten().double(), ref.flatten().double(), dim=0)
    return f"onnxruntime vs fxq: max |diff| {float((got - ref).abs().max()):.3g}, cosine {float(cos):.6f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="small CNN at 32x32 instead of ResNet-18 at 224x224")
    parser.add_argument("--out", default="fxq_out/export_all", help="output folder (created if missing)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, data = build(args.fast)
    setting = fxq.QuantizationSetting()
    setting.quantize_activation_setting.calib_algorithm = "minmax"
    failures = 0
    for backend, platform in PLATFORM_OF.items():
        if backend not in EXPORTERS:
            print(f"[{backend}] no exporter registered: skipped")
            continue
        qmodel = fxq.quantize(model, data, platform, setting=setting, progress=False)
        try:
            files = fxq.export(qmodel, platform, out / f"model_{backend}")
        except fxq.FxqError as exc:
            print(f"[{backend}] export failed: {exc}")
            failures += 1
            continue
        print(f"[{backend}] {platform}: " + ", ".join(str(f) for f in files))
        if backend in ("tensorrt", "onnxruntime"):
            print(f"[{backend}] " + check_with_onnxruntime(files[0], qmodel, data[0]))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
