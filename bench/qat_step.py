"""QAT train step against the FP32 train step, eager and under ``torch.compile``, on CPU or CUDA.

    python bench/qat_step.py [--models resnet18 mobilenet_v2] [--batch-size 8] [--size 112] [--steps 10] [--repeat 3]
                             [--modes eager compiled] [--warmup 10] [--device cpu|cuda] [--allocator steady|default]

For each model: an SGD step (forward, cross-entropy, backward, update) of the torchvision FP32 model and of
``fxq.prepare_qat(model, "trt_int8")`` (LSQ scales, BN folded), each eager and compiled
(``torch.compile(fullgraph=True)``, inductor). Printed: the median step time of each over ``--steps`` steps after
10 s of warm-up steps (fxq's fused CPU kernels switch on after a few seconds of eager use), repeated ``--repeat`` times in one process (rounds interleave the four variants), the ratios QAT / FP32
(goals: eager <= 1.5x, compiled <= 1.3x) and the compile time of each (goal: QAT <= 1.5x FP32's). Run on a quiet
machine.

Compile times (``--compile-runs N``, default 3) are the first compiled train step of each model in a fresh process
of its own, FP32 and QAT alternately, N times each (medians), each process with an empty inductor cache and after
one small compile that takes the process's one-time costs (a user compiles one model in a process; measured inside
this one, the second compile ran with the first's caches, memory and garbage-collector state, and the ratio moved
by 0.3 between runs of the same code). ``--compile-runs 0``: the first step of the rounds above instead.
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import subprocess
import sys
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


def _fp32_model(name: str, batch_size: int, size: int) -> torch.nn.Module:
    """The seeded torchvision model ``name`` in train mode, with the bench's data (:data:`_DATA`) made for it."""
    global _DATA
    torch.manual_seed(0)
    _DATA = (torch.randn(batch_size, 3, size, size, device=_DEVICE),
             torch.randint(0, 1000, (batch_size,), device=_DEVICE))
    return getattr(torchvision.models, name)().train().to(_DEVICE)


def bench(name: str, batch_size: int, size: int, steps: int, repeat: int,
          modes: tuple[str, ...] = ("eager", "compiled")) -> dict:
    fp32 = _fp32_model(name, batch_size, size)
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
                     f"qat {compile_s['qat compiled']:.1f} s ({row['compile ratio']:.2f}x, in one process)")
    print(f"{name:14s} " + "; ".join(parts), flush=True)
    print(f"  rounds: {row['rounds']}", flush=True)
    return row


def _compile_probe(name: str, variant: str, batch_size: int, size: int) -> float:
    """Seconds of the first compiled train step of ``name`` (``fp32`` or ``qat``), in this process (a fresh one)."""
    tiny = torch.compile(lambda a: (a * 2).relu().sum())  # the process's one-time compile costs, counted for neither
    tiny(torch.randn(64, device=_DEVICE, requires_grad=True)).backward()
    torch._dynamo.reset()
    model = _fp32_model(name, batch_size, size)
    if variant == "qat":
        model = fxq.prepare_qat(model, "trt_int8", _DATA[0])
    global _WARMUP_S
    _WARMUP_S = 0.0  # the first step is all this process times
    return _step_fn(model, compiled=True)[1]


def compile_times(name: str, batch_size: int, size: int, runs: int, allocator: str) -> dict[str, list[float]]:
    """``runs`` compile times of each variant, each in a fresh process (:func:`_compile_probe`), alternately."""
    times: dict[str, list[float]] = {"fp32": [], "qat": []}
    for _ in range(runs):
        for variant in times:
            with tempfile.TemporaryDirectory(prefix="fxq-bench-inductor-") as cache:
                proc = subprocess.run([sys.executable, __file__, "--compile-probe", variant, "--models", name,
                                       "--batch-size", str(batch_size), "--size", str(size), "--device", _DEVICE,
                                       "--allocator", allocator],
                                      env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache), capture_output=True,
                                      text=True)
            if proc.returncode:
                raise RuntimeError(f"compile probe {name} {variant} failed:\n{proc.stderr[-3000:]}")
            times[variant].append(float(proc.stdout.strip().splitlines()[-1]))
    ratio = statistics.median(times["qat"]) / statistics.median(times["fp32"])
    print(f"{name:14s} compile (fresh processes, medians of {runs}): fp32 {statistics.median(times['fp32']):.1f} s, "
          f"qat {statistics.median(times['qat']):.1f} s ({ratio:.2f}x); runs {times}", flush=True)
    return times


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
    parser.add_argument("--compile-runs", type=int, default=3,
                        help="fresh processes per variant for the compile times (0: the in-process first step)")
    parser.add_argument("--compile-probe", choices=["fp32", "qat"], help=argparse.SUPPRESS)
    add_allocator_argument(parser)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    _WARMUP_S, _DEVICE = args.warmup, args.device
    allocator = apply_allocator(args.allocator)
    logging.basicConfig(level=logging.WARNING)
    if args.compile_probe:
        print(_compile_probe(args.models[0], args.compile_probe, args.batch_size, args.size))
        return []
    print(f"{time.strftime('%Y-%m-%d')}: {device_line(args.device)}, batch {args.batch_size}x3x{args.size}x{args.size}, "
          f"{allocator}")
    rows = []
    for name in args.models:
        row = bench(name, args.batch_size, args.size, args.steps, args.repeat, tuple(args.modes))
        if "compiled" in args.modes and args.compile_runs > 0:
            times = compile_times(name, args.batch_size, args.size, args.compile_runs, args.allocator)
            row["compile ratio (in one process)"] = row.pop("compile ratio")
            row["compile runs s"] = times
            row["compile ratio"] = statistics.median(times["qat"]) / statistics.median(times["fp32"])
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
