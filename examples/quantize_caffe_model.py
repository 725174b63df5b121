"""Quantize a caffe model for NCNN (or OpenPPL CUDA) INT8, following the seeds' usage flow step by step.

load -> setting + dispatching table -> quantize (calibrate) -> graphwise / layerwise analysis -> export.
The caffe files are made here: a small ResNet-style deploy prototxt (Convolution + BatchNorm + Scale, Eltwise
shortcuts) and a caffemodel with seeded random weights, written with fxq's caffe schema (no caffe needed).
Calibration batches are stored as ``.npy`` files in a folder, as the tutorial prepares them.

    python examples/quantize_caffe_model.py [--fast] [--platform ncnn_int8|ppl_cuda_int8] [--out DIR]

Files written under ``--out``: ``resnet_mini.prototxt`` / ``.caffemodel`` (the FP32 input), ``calib/``, and
for NCNN ``resnet_mini_ncnn.param`` / ``.bin`` / ``.table`` (+ the FP32 ``.fp32.param`` / ``.fp32.bin``), for
OpenPPL ``resnet_mini_ppl.onnx`` + ``resnet_mini_ppl.json``.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch
from google.protobuf import text_format

import fxq
from fxq.frontends.caffe import proto

EXPORT_NAME = {"ncnn_int8": "resnet_mini_ncnn", "ppl_cuda_int8": "resnet_mini_ppl.onnx"}


def conv_bn(name: str, bottom: str, channels: int, kernel: int, stride: int = 1, relu: bool = True) -> str:
    """Prototxt of Convolution (no bias) + BatchNorm + Scale (+ ReLU), all in place on the top blob ``name``."""
    text = f"""
layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}"
  convolution_param {{ num_output: {channels} kernel_size: {kernel} pad: {kernel // 2} stride: {stride}
                      bias_term: false }} }}
layer {{ name: "bn_{name}" type: "BatchNorm" bottom: "{name}" top: "{name}" batch_norm_param {{ use_global_stats: true }} }}
layer {{ name: "scale_{name}" type: "Scale" bottom: "{name}" top: "{name}" scale_param {{ bias_term: true }} }}
"""
    if relu:
        text += f'layer {{ name: "{name}_relu" type: "ReLU" bottom: "{name}" top: "{name}" }}\n'
    return text


def basic_block(name: str, bottom: str, channels: int, stride: int) -> str:
    """ResNet basic block: two 3x3 convs, a 1x1 projection when the shape changes, Eltwise SUM, ReLU."""
    text = conv_bn(f"res{name}_branch2a", bottom, channels, 3, stride)
    text += conv_bn(f"res{name}_branch2b", f"res{name}_branch2a", channels, 3, relu=False)
    shortcut = bottom
    if stride != 1:
        text += conv_bn(f"res{name}_branch1", bottom, channels, 1, stride, relu=False)
        shortcut = f"res{name}_branch1"
    text += f"""
layer {{ name: "res{name}" type: "Eltwise" bottom: "{shortcut}" bottom: "res{name}_branch2b" top: "res{name}" }}
layer {{ name: "res{name}_relu" type: "ReLU" bottom: "res{name}" top: "res{name}" }}
"""
    return text


def resnet_mini_prototxt(size: int) -> str:
    """A deploy prototxt: stem, three basic blocks, global average pooling, classifier, softmax."""
    text = f"""name: "resnet_mini"
layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: 1 dim: 3 dim: {size} dim: {size} }} }} }}
"""
    text += conv_bn("conv1", "data", 16, 3)
    text += ('layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" '
             'pooling_param { pool: MAX kernel_size: 3 stride: 2 } }\n')
    text += basic_block("2a", "pool1", 16, 1) + basic_block("3a", "res2a", 32, 2) + basic_block("4a", "res3a", 64, 2)
    text += """
layer { name: "pool5" type: "Pooling" bottom: "res4a" top: "pool5" pooling_param { pool: AVE global_pooling: true } }
layer { name: "fc10" type: "InnerProduct" bottom: "pool5" top: "fc10" inner_product_param { num_output: 10 } }
layer { name: "prob" type: "Softmax" bottom: "fc10" top: "prob" }
"""
    return text


def random_blobs(net: Any, rng: np.random.Generator) -> None:
    """Fill every learned layer of ``net`` (a parsed NetParameter) with seeded random blobs, in place."""
    channels = {"data": 3}
    for layer in net.layer:
        if not layer.bottom:
            continue
        c = channels[layer.bottom[0]]
        arrays: list[np.ndarray] = []
        if layer.type == "Convolution":
            p = layer.convolution_param
            k, out = p.kernel_size[0], p.num_output
            arrays = [rng.standard_normal((out, c, k, k)) * np.sqrt(2.0 / (c * k * k))]
            c = out
        elif layer.type == "BatchNorm":  # mean, variance, moving-average factor
            arrays = [rng.standard_normal(c) * 0.1, rng.uniform(0.5, 2.0, c), np.ones(1)]
        elif layer.type == "Scale":
            arrays = [rng.uniform(0.5, 1.5, c), rng.standard_normal(c) * 0.1]
        elif layer.type == "InnerProduct":
            out = layer.inner_product_param.num_output
            arrays = [rng.standard_normal((out, c)) / np.sqrt(c), np.zeros(out)]
            c = out
        for array in arrays:
            blob = layer.blobs.add()
            blob.shape.dim.extend(array.shape)
            blob.data.extend(array.astype(np.float32).ravel().tolist())
        for top in layer.top:
            channels[top] = c


def write_caffe_model(out: Path, size: int) -> tuple[Path, Path]:
    """Write the deploy prototxt and a caffemodel holding its layers with random blobs."""
    text = resnet_mini_prototxt(size)
    net = proto.NetParameter()
    text_format.Parse(text, net)
    random_blobs(net, np.random.default_rng(0))
    prototxt, caffemodel = out / "resnet_mini.prototxt", out / "resnet_mini.caffemodel"
    prototxt.write_text(text)
    caffemodel.write_bytes(net.SerializeToString())
    return prototxt, caffemodel


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="32x32 inputs, few batches (for tests)")
    parser.add_argument("--platform", default="ncnn_int8", choices=sorted(EXPORT_NAME))
    parser.add_argument("--out", default="fxq_out/caffe_example", help="output folder (created if missing)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size, batch, batches = (32, 4, 2) if args.fast else (224, 16, 16)

    # 1. the model files
    prototxt, caffemodel = write_caffe_model(out, size)

    # 2. load them: a torch.fx GraphModule whose nodes remember their caffe layer names
    graph = fxq.load_caffe(prototxt, caffemodel)

    # 3. calibration data as the tutorial prepares it: one .npy batch per file (random here)
    calib_dir = out / "calib"
    calib_dir.mkdir(exist_ok=True)
    rng = np.random.default_rng(1)
    for i in range(batches):
        np.save(calib_dir / f"batch{i:03d}.npy", rng.standard_normal((batch, 3, size, size)).astype(np.float32))
    calib = fxq.load_calibration_folder(calib_dir, input_shape=[batch, 3, size, size])

    # 4. setting and dispatching table (keys: caffe layer names, fx node names or regexes)
    if args.platform == "ncnn_int8":
        setting = fxq.QuantizationSettingFactory.ncnn_setting()
    else:
        setting = fxq.QuantizationSettingFactory.pplcuda_setting()
    setting.dispatching_table = {"conv1": "fp32"}  # the stem sees raw pixels: keep it in FP32

    # 5. quantize: fold BatchNorm + Scale, dispatch, insert quantizers, calibrate, convert
    qmodel = fxq.quantize(graph, calib, platform=args.platform, setting=setting, progress=not args.fast)
    print(fxq.summary(qmodel))

    # 6. inference simulation: quantized, and FP32 through the same module (outputs are softmax probabilities)
    x = calib[0]
    with torch.no_grad():
        out_q = qmodel(x)
        with fxq.fp32_mode(qmodel):
            out_fp = qmodel(x)
    noise = float((out_q - out_fp).pow(2).sum() / out_fp.pow(2).sum())
    print(f"network output noise/signal power: {noise:.4%}")

    # 7. where the error comes from: accumulated (graphwise) and each layer alone (layerwise)
    graphwise = fxq.graphwise_error_analyse(qmodel, calib, method="snr", steps=batches)
    print(graphwise.table(limit=5))
    layerwise = fxq.layerwise_error_analyse(qmodel, calib, method="cosine", steps=1 if args.fast else 4)
    print(layerwise.table(limit=5))

    # 8. deploy: ncnn param/bin + calibration table, or ppl.nn ONNX + quantization json
    files = fxq.export(qmodel, args.platform, out / EXPORT_NAME[args.platform])
    for f in files:
        print(f"wrote {f}")
    return {"model": qmodel, "noise": noise, "graphwise": graphwise, "layerwise": layerwise, "files": files}


if __name__ == "__main__":
    main()
