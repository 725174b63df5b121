"""Forward of the quantized model against the FP32 model, eager and under ``torch.compile``, CPU or CUDA.

    python bench/inference.py [--models resnet18 mobilenet_v2 encoder] [--size 224] [--steps 5] [--repeat 2]
                              [--modes eager compiled] [--warmup 10] [--device cpu|cuda]
                              [--compile-mode default|reduce-overhead|max-autotune] [--freezing]

For each model and batch size (1 and 8): the median forward time of the torchvision FP32 model (eval, no grad) and
of ``fxq.quantize(model, calib, "trt_int8")``, each eager and compiled (``torch.compile(fullgraph=True)``), rounds
interleaved in one process, each after 10 s of warm-up calls (compiles; fxq's fused CPU kernels switch on
after a few seconds of eager use). Printed: quantized / FP32 ratios (goals: eager <= 1.2x, compiled <= 1.1x). ``encoder``
is a 4-layer ``nn.TransformerEncoder`` (d=256, 8 heads, 197 tokens) that fxq decomposes. Run on a quiet machine.
"""
from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time
from typing import Callable

import torch
import torchvision
from _host import add_allocator_argument, add_device_argument, apply_allocator, device_line, synchronize
from torch import nn

import fxq
from fxq import fused_cpu


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(256, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


def _model(name: str) -> tuple[nn.Module, Callable[[int], torch.Tensor]]:
    if name == "encoder":
        return Encoder().eval().to(_DEVICE), lambda b: torch.randn(b, 197, 256, device=_DEVICE)
    return getattr(torchvision.models, name)().eval().to(_DEVICE), lambda b: torch.randn(b, 3, _SIZE, _SIZE,
                                                                                         device=_DEVICE)


_SIZE = 224
_WARMUP_S = 10.0
_WARMUP_MAX_S = 120.0
_DEVICE = "cpu"
_COMPILE_MODE: str | None = None  # torch.compile's mode: None (default), "reduce-overhead" (CUDA graphs), ...


def _timer(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, steps: int) -> Callable[[], float]:
    """A closure timing ``steps`` forwards; first ``_WARMUP_S`` seconds of calls (compiles), and on until fxq's
    fused CPU kernels have switched on (after a few seconds of eager fake-quant time in the process, which a
    batch-1 model may take longer than that to spend; at most ``_WARMUP_MAX_S``), so the steady state of a long
    evaluation is what gets timed."""
    warmup = fused_cpu.FusedCpuSettings().resolved()[2] if _DEVICE == "cpu" else 0.0
    with torch.no_grad():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < _WARMUP_S or (
                fused_cpu.fused_cpu_stats()["eager_seconds"] < warmup and time.perf_counter() - t0 < _WARMUP_MAX_S):
            fn(x)

    def run() -> float:
        times = []
        with torch.no_grad():
            for _ in range(steps):
                synchronize(_DEVICE)
                t0 = time.perf_counter()
                fn(x)
                synchronize(_DEVICE)
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return run


def bench(name: str, steps: int, repeat: int, modes: tuple[str, ...] = ("eager", "compiled")) -> list[dict]:
    torch.manual_seed(0)
    model, make = _model(name)
    calib = [make(8) for _ in range(2)]
    qmodel = fxq.quantize(model, calib, "trt_int8", progress=False)
    rows = []
    for batch in (1, 8):
        x = make(batch)
        torch._dynamo.reset()
        variants = {}
        if "eager" in modes:
            variants.update({"fp32 eager": _timer(model, x, steps), "fxq eager": _timer(qmodel, x, steps)})
        if "compiled" in modes:
            variants.update({
                "fp32 compiled": _timer(torch.compile(copy.deepcopy(model), fullgraph=True, mode=_COMPILE_MODE), x,
                                        steps),
                "fxq compiled": _timer(torch.compile(copy.deepcopy(qmodel), fullgraph=True, mode=_COMPILE_MODE), x,
                                       steps)})
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(repeat):
            for label, run in variants.items():
                times[label].append(run())
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"model": name, "batch": batch, **med}
        parts = []
        for mode in modes:
            row[f"{mode} ratio"] = med[f"fxq {mode}"] / med[f"fp32 {mode}"]
            parts.append(f"{mode} fp32 {med[f'fp32 {mode}'] * 1e3:.2f} ms, fxq {med[f'fxq {mode}'] * 1e3:.2f} ms "
                         f"({row[f'{mode} ratio']:.2f}x)")
        print(f"{name:12s} batch {batch}: " + "; ".join(parts), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    global _SIZE, _WARMUP_S, _DEVICE, _COMPILE_MODE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2", "encoder"])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    parser.add_argument("--warmup", type=float, default=_WARMUP_S, help="seconds of warm-up calls per variant")
    parser.add_argument("--compile-mode", default=None, choices=["default", "reduce-overhead", "max-autotune"],
                        help="torch.compile mode of the compiled rows (reduce-overhead: CUDA graphs on a GPU)")
    parser.add_argument("--freezing", action="store_true",
                        help="inductor's freezing for the compiled rows: parameters become constants, and what is "
                             "computed from them alone (a weight's fake-quant) is folded at compile time")
    add_allocator_argument(parser)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    if args.freezing:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True
    allocator = apply_allocator(args.allocator)
    _SIZE, _WARMUP_S, _DEVICE, _COMPILE_MODE = args.size, args.warmup, args.device, args.compile_mode
    logging.basicConfig(level=logging.WARNING)
    print(f"{time.strftime('%Y-%m-%d')}: {device_line(args.device)}, images {args.size}x{args.size}, {allocator}"
          f"{', compile mode ' + args.compile_mode if args.compile_mode else ''}{', freezing' if args.freezing else ''}")
    return [row for m in args.models for row in bench(m, args.steps, args.repeat, tuple(args.modes))]


if __name__ == "__main__":
    main()
