"""Quantize an ONNX model for TensorRT INT8, following the seeds' usage flow step by step.

load -> setting + dispatching table -> quantize (calibrate) -> graphwise / layerwise analysis -> export.
The ONNX file is made here: a torchvision model with seeded random weights, exported by torch (no download).

    python examples/quantize_onnx_model.py [--fast] [--model resnet18|mobilenet_v2] [--out DIR]

Files written under ``--out``: ``<model>.onnx`` (the FP32 input), ``<model>_trt_int8.onnx`` (Q/DQ model for
TensorRT) and ``<model>_trt_int8.fxq`` (fxq's own save, reloadable with ``fxq.load``).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import warnings
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

import fxq

# The ONNX node of each model's classifier, as torch's TorchScript exporter names it.
CLASSIFIER = {"resnet18": "/fc/Gemm", "mobilenet_v2": "/classifier/classifier.1/Gemm"}


def build_model(name: str, size: int) -> nn.Module:
    """A torchvision model with seeded random weights and BatchNorm statistics measured on random images
    (a random-init network's activations otherwise shrink layer after layer)."""
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=10)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.momentum = None  # cumulative average over the batches below
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, size, size))
    return model.eval()


def export_onnx(model: nn.Module, path: Path, size: int) -> None:
    """torch -> ONNX (TorchScript exporter, opset 13, dynamic batch), as a user's model file would be made."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(1, 3, size, size),), str(path), dynamo=False, opset_version=13,
                          input_names=["image"], output_names=["logits"],
                          dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="32x32 inputs, few batches (for tests)")
    parser.add_argument("--model", default="resnet18", choices=sorted(CLASSIFIER))
    parser.add_argument("--out", default="fxq_out/onnx_example", help="output folder (created if missing)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size, batch, batches = (32, 4, 2) if args.fast else (224, 16, 16)

    # 1. the model file
    onnx_path = out / f"{args.model}.onnx"
    export_onnx(build_model(args.model, size), onnx_path, size)

    # 2. load it: a torch.fx GraphModule whose nodes remember their ONNX names
    graph = fxq.load_onnx(onnx_path)
    input_name = graph.meta["onnx"]["inputs"][0]

    # 3. calibration data: anything iterable; dicts name the graph inputs (random here, real images in practice)
    g = torch.Generator().manual_seed(1)
    calib = [{input_name: torch.randn(batch, 3, size, size, generator=g)} for _ in range(batches)]

    # 4. platform, setting and dispatching table (keys: ONNX node names, fx node names or regexes)
    platform = "trt_int8"
    setting = fxq.QuantizationSettingFactory.trt_setting()
    setting.dispatching_table = {CLASSIFIER[args.model]: "fp32"}  # keep the classifier in FP32

    # 5. quantize: dispatch, insert quantizers, calibrate, convert
    qmodel = fxq.quantize(graph, calib, platform=platform, setting=setting, progress=not args.fast)
    print(fxq.summary(qmodel))

    # 6. inference simulation: quantized, and FP32 through the same module
    x = calib[0][input_name]
    with torch.no_grad():
        out_q = qmodel(x)
        with fxq.fp32_mode(qmodel):
            out_fp = qmodel(x)
    noise = float((out_q - out_fp).pow(2).sum() / out_fp.pow(2).sum())
    print(f"network output noise/signal power: {noise:.4%}")

    # 7. where the error comes from: accumulated (graphwise) and each layer alone (layerwise)
    graphwise = fxq.graphwise_error_analyse(qmodel, calib, method="snr", steps=batches)
    print(graphwise.table(limit=5))
    layerwise = fxq.layerwise_error_analyse(qmodel, calib, method="snr", steps=1 if args.fast else 4)
    print(layerwise.table(limit=5))

    # 8. deploy: Q/DQ ONNX for TensorRT, plus fxq's own file
    files = fxq.export(qmodel, platform, out / f"{args.model}_{platform}.onnx", dynamic_batch=True)
    files.append(fxq.save(qmodel, out / f"{args.model}_{platform}.fxq"))
    for f in files:
        print(f"wrote {f}")
    return {"model": qmodel, "noise": noise, "graphwise": graphwise, "layerwise": layerwise, "files": files,
            "table": setting.dispatching_table}


if __name__ == "__main__":
    main()
