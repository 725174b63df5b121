"""Fingerprint what fxq produces: quantized state and exported files, for proving a refactor changes nothing.

Quantizes a handful of seeded models (a CNN, MobileNetV3, ResNet-18, a transformer encoder, an LSTM tagger, and
an ONNX file of the CNN loaded back through ``fxq.load_onnx``) on every platform that has an exporter, with PTQ
algorithms switched on, exports each, and prints one line per artefact: the SHA-256 of every exported file and of
the quantized model's ``state_dict`` (tensors and quantizer configs, in key order). Run it before and after a
change and ``diff`` the outputs.

Usage::

    python bench/export_digest.py > before.txt        # about a minute on 2 cores
    python bench/export_digest.py --out DIR           # keep the exported files in DIR
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path

import torch
import torchvision
from torch import nn

import fxq

PLATFORMS = ("trt_int8", "trt_fp8", "ort_int8", "ppl_cuda_int8", "ncnn_int8", "dsp_int8", "academic_int8")


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.conv1 = nn.Conv2d(16, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, groups=4)
        self.act = nn.Hardswish()
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.stem(x))
        y = self.conv2(self.act(self.conv1(x)))
        return self.head(torch.relu(torch.cat([x, y], 1)[:, :16] + y))


class Encoder(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.out = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-2, -1) * 0.17, dim=-1)
        x = x + self.proj(attn @ v)
        return self.out(x + self.fc(x))


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.lstm(x)[0])


def models(tmp: Path) -> list[tuple[str, nn.Module, tuple[int, ...]]]:
    torch.manual_seed(0)
    cnn = SmallCNN().eval()
    torch.manual_seed(0)
    mnv3 = torchvision.models.mobilenet_v3_small(num_classes=10).eval()
    torch.manual_seed(0)
    resnet = torchvision.models.resnet18(num_classes=10).eval()
    torch.manual_seed(0)
    enc = Encoder().eval()
    torch.manual_seed(0)
    tagger = Tagger().eval()
    onnx_path = tmp / "cnn.onnx"
    torch.onnx.export(cnn, (torch.randn(1, 3, 32, 32),), str(onnx_path), opset_version=13, dynamo=False,
                      input_names=["x"], output_names=["y"])
    return [
        ("cnn", cnn, (4, 3, 32, 32)),
        ("mobilenet_v3_small", mnv3, (2, 3, 64, 64)),
        ("resnet", resnet, (2, 3, 64, 64)),
        ("encoder", enc, (2, 6, 8)),
        ("lstm", tagger, (2, 5, 8)),
        ("cnn_onnx", fxq.load_onnx(onnx_path), (4, 3, 32, 32)),
    ]


def digest_state(model: nn.Module) -> str:
    h = hashlib.sha256()
    for key, value in model.state_dict().items():
        h.update(key.encode())
        if isinstance(value, torch.Tensor):
            h.update(value.detach().cpu().contiguous().numpy().tobytes())
        else:  # a quantizer's extra state: its config (bits, state, rounding...)
            h.update(repr(value).encode())
    return h.hexdigest()[:16]


def setting_for(name: str, platform: str) -> fxq.QuantizationSetting:
    setting = fxq.QuantizationSetting()
    if name in ("cnn", "cnn_onnx") and platform in ("trt_int8", "ort_int8"):
        setting.equalization = True
        setting.bias_correct = True
    if name == "cnn" and platform == "ppl_cuda_int8":
        setting.adaround = True
        setting.adaround_setting.steps = 20
    if name == "cnn" and platform == "academic_int8":
        setting.lsq_optimization = True
        setting.lsq_optimization_setting.steps = 10
    if name == "resnet" and platform == "trt_int8":
        setting.blockwise_reconstruction = True
        setting.blockwise_reconstruction_setting.steps = 10
    if name == "encoder" and platform == "trt_int8":
        setting.ssd_equalization = True
    return setting


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="keep the exported files here (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        out = Path(args.out) if args.out else tmp / "out"
        out.mkdir(parents=True, exist_ok=True)
        for name, model, shape in models(tmp):
            g = torch.Generator().manual_seed(1)
            data = [torch.randn(*shape, generator=g) for _ in range(3)]
            for platform in PLATFORMS:
                try:
                    qmodel = fxq.quantize(model, data, platform, setting=setting_for(name, platform), progress=False)
                except fxq.FxqError as exc:
                    print(f"{name} {platform} quantize-error {type(exc).__name__}")
                    continue
                print(f"{name} {platform} state {digest_state(qmodel)}")
                variants = [("", {})]
                if platform == "trt_int8":
                    variants += [("_fp16", {"high_precision_dtype": "fp16"}), ("_legacy", {"legacy": True}),
                                 ("_dyn", {"dynamic_batch": True})]
                if platform == "ncnn_int8":
                    variants.append(("_fp32", {"fp32": True}))
                for suffix, options in variants:
                    stem = out / f"{name}_{platform}{suffix}"
                    try:
                        files = fxq.export(qmodel, platform, stem, **options)
                    except fxq.FxqError as exc:
                        print(f"{name} {platform}{suffix} export-error {type(exc).__name__}")
                        continue
                    for f in sorted(files):
                        sha = hashlib.sha256(Path(f).read_bytes()).hexdigest()[:16]
                        print(f"{name} {platform}{suffix} {Path(f).name} {sha}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
