"""Accuracy of fxq's PTQ algorithms and QAT on a small CNN trained here on scikit-learn's digits.

    python bench/accuracy.py [--fast] [--seeds 3] [--size 16] [--threads N]

Trains a 3-conv CNN on the 8x8 digits upsampled to ``size`` x ``size`` (half of the 1797 images train,
half test), then reports test accuracy for FP32 and for the academic platforms (activations asymmetric
per-tensor at the inputs of Conv/Linear, weights symmetric per-tensor, 30-bit passive biases):

* W8A8 ``academic_int8``: minmax;
* W4A8 ``academic_mix``: minmax, AdaRound, block-wise LSQ;
* W4A4 ``academic_int4``: minmax, BRECQ, QDrop, QAT (LSQ).

Every PTQ row uses minmax observers (the "plain minmax" baseline) and the same calibration batches. The
whole table is repeated for ``--seeds`` FP32 models (data split, init and calibration batches per seed) and
averaged: one test image is 0.11 pt, so single runs differ by noise. For each row: accuracy, the difference
to FP32, the share of test images with FP32's top-1 class, the SNR of the test logits against FP32's,
wall time, the process's peak RSS while the row ran (Linux:
VmHWM, reset before each row) and the largest block cache the algorithm held. Goals (checked at the end):
W8A8 within 0.5 pt of FP32, W4A8 AdaRound or LSQ within 1 pt, W4A4 QAT within 2 pt, no algorithm below
minmax at the same bits. Needs ``pip install scikit-learn``.
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import resource
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import fxq


# --------------------------------------------------------------------------- data and model
def load_digits(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): digits upsampled to ``size`` x ``size``, standardized."""
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    digits = sk_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    y = torch.tensor(digits.target, dtype=torch.long)
    idx_train, idx_test = train_test_split(range(len(y)), test_size=0.5, random_state=seed, stratify=digits.target)
    x_train, x_test = x[idx_train], x[idx_test]
    mean, std = x_train.mean(), x_train.std()
    return (x_train - mean) / std, y[idx_train], (x_test - mean) / std, y[idx_test]


class DigitsCNN(nn.Module):
    """conv-bn-relu x3 (two max-pools), then a 2-layer classifier."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * (size // 4) ** 2, 64), nn.ReLU(),
                                        nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float, batch: int = 64,
          seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs * ((len(x) + batch - 1) // batch))
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), batch):
            j = perm[i:i + batch]
            loss = F.cross_entropy(model(x[j]), y[j])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return model.eval()


@torch.no_grad()
def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    return torch.cat([model(x[i:i + 256]) for i in range(0, len(x), 256)])


def snr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-noise ratio of ``out`` against ``ref`` in dB (higher is better; inf when equal)."""
    noise = float((out - ref).pow(2).sum())
    return float("inf") if noise == 0 else 10 * torch.log10(ref.pow(2).sum() / noise).item()


# --------------------------------------------------------------------------- measurement
def _reset_peak_rss() -> bool:
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # whole-process peak, KiB on Linux


def _setting(**switches: Any) -> fxq.QuantizationSetting:
    s = fxq.QuantizationSetting()
    s.quantize_activation_setting.calib_algorithm = "minmax"
    s.quantize_parameter_setting.calib_algorithm = "minmax"
    for key, value in switches.items():
        if isinstance(value, dict):
            sub = getattr(s, key)
            for k, v in value.items():
                setattr(sub, k, v)
        else:
            setattr(s, key, value)
    return s


# --------------------------------------------------------------------------- rows
def build_rows(model: nn.Module, calib: list[torch.Tensor], x_train: torch.Tensor, y_train: torch.Tensor,
               fast: bool, seed: int) -> list[tuple[str, str, Callable[[], nn.Module]]]:
    steps = 100 if fast else 500
    qat_epochs = 1 if fast else 6

    def ptq(platform_name: str, **switches: Any) -> Callable[[], nn.Module]:
        return lambda: fxq.quantize(model, calib, platform_name, setting=_setting(**switches), progress=False)

    def qat() -> nn.Module:
        q = fxq.prepare_qat(model, "academic_int4", calib_data=calib, method="lsq",
                            setting=_setting())
        train(q, x_train, y_train, epochs=qat_epochs, lr=2e-4, seed=seed)
        return fxq.convert(q.eval())

    return [
        ("FP32", "-", lambda: model),
        ("W8A8", "minmax", ptq("academic_int8")),
        ("W4A8", "minmax", ptq("academic_mix")),
        ("W4A8", "AdaRound", ptq("academic_mix", adaround=True,
                                 adaround_setting={"steps": steps, "lr": 1e-2})),
        ("W4A8", "LSQ", ptq("academic_mix", lsq_optimization=True,
                            lsq_optimization_setting={"steps": steps, "lr": 1e-4, "block_size": 2})),
        ("W4A4", "minmax", ptq("academic_int4")),
        ("W4A4", "BRECQ", ptq("academic_int4", blockwise_reconstruction=True,
                              blockwise_reconstruction_setting={"steps": steps, "lr": 1e-2, "block_size": 2,
                                                                "drop_prob": 0.0, "is_scale_trainable": True})),
        ("W4A4", "QDrop", ptq("academic_int4", blockwise_reconstruction=True,
                              blockwise_reconstruction_setting={"steps": steps, "lr": 1e-2, "block_size": 2,
                                                                "drop_prob": 0.5, "is_scale_trainable": True})),
        ("W4A4", "QAT (LSQ)", qat),
    ]


def run_seed(seed: int, args: argparse.Namespace) -> list[dict]:
    """Train the FP32 model for ``seed`` (split, init, calibration batches) and measure every row."""
    torch.manual_seed(seed)
    x_train, y_train, x_test, y_test = load_digits(args.size, seed)
    start = time.perf_counter()
    model = train(DigitsCNN(args.size), x_train, y_train, epochs=3 if args.fast else 30, lr=3e-3, seed=seed)
    print(f"seed {seed}: digits {args.size}x{args.size}, {len(x_train)} train / {len(x_test)} test, "
          f"FP32 training {time.perf_counter() - start:.1f} s", flush=True)
    perm = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(seed))
    calib = [x_train[perm[i:i + 32]] for i in range(0, 256, 32)]
    rows, ref = [], None
    for bits, method, make in build_rows(model, calib, x_train, y_train, args.fast, seed):
        torch.manual_seed(seed)
        exact_peak = _reset_peak_rss()
        t0 = time.perf_counter()
        qmodel = make()
        elapsed = time.perf_counter() - t0
        out = logits(qmodel, x_test)
        ref = out if ref is None else ref
        stats = getattr(qmodel, "meta", {}).get("fxq_algorithm_stats", {}) if qmodel is not model else {}
        rows.append({
            "seed": seed, "bits": bits, "method": method,
            "accuracy": 100.0 * float((out.argmax(1) == y_test).float().mean()),
            "agreement": 100.0 * float((out.argmax(1) == ref.argmax(1)).float().mean()),
            "logit_snr_db": snr_db(out, ref), "time_s": elapsed, "peak_rss_mb": _peak_rss_mb(),
            "peak_rss_exact": exact_peak,
            "block_cache_mb": max((v.get("peak_cache_bytes", 0) for v in stats.values()), default=0) / 2**20,
        })
        r = rows[-1]
        print(f"  {bits:4} {method:9} acc {r['accuracy']:6.2f}  agree {r['agreement']:6.2f}  "
              f"snr {r['logit_snr_db']:5.1f} dB  {elapsed:6.1f} s", flush=True)
        del qmodel
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fast", action="store_true", help="few steps and epochs, one seed (smoke test)")
    parser.add_argument("--size", type=int, default=16, help="input side after upsampling (multiple of 4)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seeds", type=int, default=3, help="FP32 models (split + init) to average over")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    seeds = range(1 if args.fast else args.seeds)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {platform.machine()}", flush=True)
    results = [row for seed in seeds for row in run_seed(seed, args)]

    keys = list(dict.fromkeys((r["bits"], r["method"]) for r in results))
    mean: dict[tuple[str, str], dict] = {}
    for key in keys:
        rs = [r for r in results if (r["bits"], r["method"]) == key]
        mean[key] = {f: sum(r[f] for r in rs) / len(rs)
                     for f in ("accuracy", "agreement", "logit_snr_db", "time_s", "block_cache_mb")}
        mean[key]["peak_rss_mb"] = max(r["peak_rss_mb"] for r in rs)
    fp32 = mean["FP32", "-"]["accuracy"]
    print(f"\nmean over {len(seeds)} seed(s); agreement = same top-1 as FP32; SNR of test logits vs FP32")
    print(f"| {'bits':4} | {'method':9} | {'accuracy %':>10} | {'vs FP32':>7} | {'agree %':>7} | {'logit SNR dB':>12} | "
          f"{'time s':>6} | {'peak RSS MB':>11} | {'block cache MB':>14} |")
    print(f"|{'-' * 6}|{'-' * 11}|{'-' * 11}:|{'-' * 8}:|{'-' * 8}:|{'-' * 13}:|{'-' * 7}:|{'-' * 12}:|{'-' * 15}:|")
    for (bits, method), m in mean.items():
        snr = "inf" if m["logit_snr_db"] == float("inf") else f"{m['logit_snr_db']:.1f}"
        print(f"| {bits:4} | {method:9} | {m['accuracy']:10.2f} | {m['accuracy'] - fp32:+7.2f} | "
              f"{m['agreement']:7.2f} | {snr:>12} | {m['time_s']:6.1f} | {m['peak_rss_mb']:11.0f} | "
              f"{m['block_cache_mb']:14.2f} |")

    acc = {k: m["accuracy"] for k, m in mean.items()}
    goals = [
        ("W8A8 minmax within 0.5 pt of FP32", fp32 - acc["W8A8", "minmax"] <= 0.5),
        ("W4A8 AdaRound or LSQ within 1 pt of FP32", fp32 - max(acc["W4A8", "AdaRound"], acc["W4A8", "LSQ"]) <= 1.0),
        ("W4A4 QAT within 2 pt of FP32", fp32 - acc["W4A4", "QAT (LSQ)"] <= 2.0),
        ("no algorithm below minmax at the same bits (accuracy)",
         all(a >= acc[k[0], "minmax"] for k, a in acc.items() if k[1] not in ("-", "minmax"))),
        ("no PTQ algorithm below minmax at the same bits (logit SNR)",
         all(m["logit_snr_db"] >= mean[k[0], "minmax"]["logit_snr_db"] for k, m in mean.items()
             if k[1] not in ("-", "minmax", "QAT (LSQ)"))),
    ]
    for text, ok in goals:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    return results


if __name__ == "__main__":
    main()
