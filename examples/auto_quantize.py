"""Accuracy-budgeted quantization: the fewest layers off INT8 (and the smallest file) that keep the accuracy.

    python examples/auto_quantize.py [--fast]

Trains a small CNN on scikit-learn's digits (``pip install scikit-learn``), then asks :func:`fxq.auto_quantize` for
an ONNX Runtime model whose test accuracy stays within 1 pt of FP32 and whose weights take at most 20 % of the FP32
bytes (so some layers go to 4 bits), and for a TensorRT model whose output SNR is at most half the all-INT8 one.
The ONNX Runtime file is exported and its accuracy checked in onnxruntime when it is installed.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import fxq


class DigitsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1)
        self.c3 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.c2(F.relu(self.c1(x)))), 2)
        x = F.relu(self.c3(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def main(argv: list[str] | None = None) -> tuple[dict[str, fxq.AutoQuantReport], float | None]:
    """Returns the reports per platform and the ort_int8 model's accuracy in onnxruntime (None without it)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fast", action="store_true")
    args = parser.parse_args(argv)
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = (x - x.mean()) / x.std()
    y = torch.tensor(d.target)
    x_train, y_train, x_test, y_test = x[:1200], y[:1200], x[1200:], y[1200:]
    torch.manual_seed(0)
    model = DigitsNet()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(10 if args.fast else 20):
        perm = torch.randperm(len(x_train))
        for i in range(0, len(x_train), 64):
            j = perm[i:i + 64]
            loss = F.cross_entropy(model(x_train[j]), y_train[j])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    calib = [x_train[i:i + 64] for i in range(0, 512, 64)]

    def accuracy(m: nn.Module) -> float:  # the user's own validation metric: higher is better
        return float((m(x_test).argmax(1) == y_test).float().mean())

    fp32_acc = accuracy(model)
    reports = {}
    # 1. ONNX Runtime: accuracy within 1 pt of FP32, weights at most 20 % of FP32's (4-bit layers where harmless)
    budget = fxq.Budget(metric=accuracy, target=fp32_acc - 0.01, size=0.2)
    ort_model, reports["ort_int8"] = fxq.auto_quantize(model, calib, "ort_int8", budget, low_bits=4)
    print(reports["ort_int8"])

    # 2. TensorRT: output SNR at most half of what plain INT8 gives, the layers taken off INT8 run in FP16
    int8 = fxq.quantize(model, calib, "trt_int8", progress=False)
    snr = fxq.graphwise_error_analyse(int8, calib).outputs[0].value
    _, reports["trt_int8"] = fxq.auto_quantize(model, calib, "trt_int8", fxq.Budget(snr=snr / 2), fallback="fp16")
    print(reports["trt_int8"])

    try:
        import onnxruntime as ort
    except ImportError:
        return reports, None
    with tempfile.TemporaryDirectory() as tmp:
        (path,) = fxq.export(ort_model, "ort_int8", Path(tmp) / "digits", dynamic_batch=True)
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        logits = sess.run(None, {sess.get_inputs()[0].name: x_test.numpy()})[0]
    deployed = float((torch.from_numpy(logits).argmax(1) == y_test).float().mean())
    print(f"accuracy: FP32 {fp32_acc:.2%}, fxq simulation {accuracy(ort_model):.2%}, onnxruntime {deployed:.2%}")
    return reports, deployed


if __name__ == "__main__":
    main()
