"""QAT train step against the FP32 train step, eager and under ``torch.compile``, on CPU or CUDA.

    python bench/qat_step.py [--models resnet18 mobilenet_v2] [--batch-size 8] [--size 112] [--steps 10] [--repeat 3]
                             [--modes eager compiled] [--warmup 10] [--device cpu|cuda] [--allocator steady|default]

For each model: an SGD step (forward, cross-entropy, backward, update) of the torchvision FP32 model and of
``fxq.prepare_qat(model, "trt_int8")`` (LSQ scales, BN folded), each eager and compiled
(``torch.compile(fullgraph=True)``, inductor). Printed: the median step time of each over ``--steps`` steps after
10 s of warm-up steps (fxq's fused CPU kernels switch on after a few seconds of eager use), repeated ``--repeat`` times in one process (rounds interleave the four variants), the ratios QAT / FP32
(goals: eager <= 1.5x, compiled <= 1.3x) and the compile time of each (goal: QAT <= 1.5x FP32's). Run on a quiet
machine.
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import tempfile
import time
from typing import Callable

if __name__ == "__main__":  # compile times from cold caches: a fresh inductor cache, before torch reads the setting
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="fxq-bench-inductor-"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")

import torch
import torch.nn.functional as F
import torchvision
from _host import add_allocator_argument, add_device_argument, apply_allocator, device_line, synchronize

import fxq


def _step_fn(model: torch.nn.Module, compiled: bool) -> tuple[Callable[[], float], float]:
    """A closure doing one train step on fixed data, and the seconds its first call (the compile) took."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    fwd = torch.compile(model, fullgraph=True) if compiled else model
    x, y = _DATA

    def step() -> float:
        synchronize(_DEVICE)
        t0 = time.perf_counter()
        loss = F.cross_entropy(fwd(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        synchronize(_DEVICE)
        return time.perf_counter() - t0

    first = step()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < _WARMUP_S:  # recompiles for allocated grads; fxq's fused CPU kernels switch on
        step()                                   # after a few seconds of eager use: time the steady state
    return step, first


_WARMUP_S = 10.0
_DEVICE = "cpu"


_DATA: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))


def bench(name: str, batch_size: int, size: int, steps: int, repeat: int,
          modes: tuple[str, ...] = ("eager", "compiled")) -> dict:
    global _DATA
    torch.manual_seed(0)
    _DATA = (torch.randn(batch_size, 3, size, size, device=_DEVICE),
             torch.randint(0, 1000, (batch_size,), device=_DEVICE))
    fp32 = getattr(torchvision.models, name)().train().to(_DEVICE)
    qat = fxq.prepare_qat(copy.deepcopy(fp32), "trt_int8", _DATA[0])
    torch._dynamo.reset()
    variants = {}
    compile_s = {}
    for label, model, compiled in (("fp32 eager", fp32, False), ("qat eager", qat, False),
                                   ("fp32 compiled", fp32, True), ("qat compiled", qat, True)):
        if label.split()[1] in modes:
            variants[label], compile_s[label] = _step_fn(copy.deepcopy(model) if compiled else model, compiled)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeat):
        for label, step in variants.items():
            times[label].append(statistics.median(step() for _ in range(steps)))
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {"model": name, **{f"{k} s": v for k, v in med.items()},
           "rounds": {k: [round(t, 4) for t in v] for k, v in times.items()}, "compile s": compile_s}
    parts = []
    if "eager" in modes:
        row["eager ratio"] = med["qat eager"] / med["fp32 eager"]
        parts.append(f"step fp32 eager {med['fp32 eager']:.3f} s, qat eager {med['qat eager']:.3f} s "
                     f"({row['eager ratio']:.2f}x)")
    if "compiled" in modes:
        row["compiled ratio"] = med["qat compiled"] / med["fp32 compiled"]
        row["compile ratio"] = compile_s["qat compiled"] / compile_s["fp32 compiled"]
        parts.append(f"fp32 compiled {med['fp32 compiled']:.3f} s, qat compiled {med['qat compiled']:.3f} s "
                     f"({row['compiled ratio']:.2f}x); compile fp32 {compile_s['fp32 compiled']:.1f} s, "
                     f"qat {compile_s['qat compiled']:.1f} s ({row['compile ratio']:.2f}x)")
    print(f"{name:14s} " + "; ".join(parts), flush=True)
    print(f"  rounds: {row['rounds']}", flush=True)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    global _WARMUP_S, _DEVICE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    parser.add_argument("--warmup", type=float, default=_WARMUP_S, help="seconds of warm-up steps per variant")
    add_allocator_argument(parser)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    _WARMUP_S, _DEVICE = args.warmup, args.device
    allocator = apply_allocator(args.allocator)
    logging.basicConfig(level=logging.WARNING)
    print(f"{time.strftime('%Y-%m-%d')}: {device_line(args.device)}, batch {args.batch_size}x3x{args.size}x{args.size}, "
          f"{allocator}")
    return [bench(m, args.batch_size, args.size, args.steps, args.repeat, tuple(args.modes)) for m in args.models]


if __name__ == "__main__":
    main()
