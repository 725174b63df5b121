"""Graphwise analysis cost on ResNet-18, as a multiple of one FP32 pass over the same data.

Measured in one process. These machines are shared and noisy, so each round times the floor, then the
analysis, then the floor again, and the ratio of that round is analysis / mean of its two floors; the
median over rounds is reported (with min / max), for wall time and for this process's CPU time.

* floor: the float torchvision model, one forward pass over the batches;
* two passes (reference): the quantized model over the batches once inside ``fxq.fp32_mode`` and once
  quantized — what any graphwise analysis must at least run;
* ``fxq.graphwise_error_analyse`` (computing ops, SNR: the default); ``--all-ops`` also times
  ``ops="quantized"``; its first call in the process (before the fused path has warmed up) is reported
  separately.

The fused CPU fake-quant path (``FXQ_CPU_FUSED``, compiled by inductor after some eager use) is warmed
up by untimed quantized passes and analyses over the data until nothing new compiles, so that no compile
lands in a timed section; ``--no-fused`` measures the eager fake-quant instead.

Usage: ``python bench/analysis.py [--batches 8] [--batch-size 8] [--size 224] [--rounds 5] [--no-fused]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process)."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--all-ops", action="store_true", help="also time the analysis of every quantized op")
    ap.add_argument("--no-fused", action="store_true", help="eager fake-quant (FXQ_CPU_FUSED=0)")
    args = ap.parse_args()
    if args.no_fused:
        os.environ["FXQ_CPU_FUSED"] = "0"

    import torch
    import torchvision

    import fxq
    from fxq.fused_cpu import fused_cpu_stats

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(args.batch_size, 3, args.size, args.size, generator=gen) for _ in range(args.batches)]

    t0 = time.perf_counter()
    gm = fxq.quantize(model, data, platform="trt_int8", progress=False)
    t_quant = time.perf_counter() - t0

    @torch.no_grad()
    def float_pass() -> None:
        for x in data:
            model(x)

    @torch.no_grad()
    def two_passes() -> None:
        with fxq.fp32_mode(gm):
            for x in data:
                gm(x)
        for x in data:
            gm(x)

    def graphwise() -> None:
        fxq.graphwise_error_analyse(gm, data, steps=args.batches)

    def graphwise_all() -> None:
        fxq.graphwise_error_analyse(gm, data, steps=args.batches, ops="quantized")

    with torch.no_grad():
        model(data[0])
    # what a user's first call costs: the fused path is still warming up (eager fake-quant, eager metrics)
    f1, first, f2 = _timed(float_pass), _timed(graphwise), _timed(float_pass)
    first_call = round(first[0] / ((f1[0] + f2[0]) / 2), 2)
    with torch.no_grad():  # warm-up, until the fused fake-quant path (if enabled) has compiled what it needs
        for _ in range(30):
            compiles = fused_cpu_stats()["compiles"]
            for x in data:
                gm(x)
            graphwise()  # the analysis quantizes in place: its own compiled graphs
            if args.no_fused or (compiles and fused_cpu_stats()["compiles"] == compiles):
                break
    runs = [("graphwise", graphwise), ("two_passes", two_passes)]
    if args.all_ops:
        runs.append(("graphwise_all_ops", graphwise_all))
    ratios: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name, _ in runs}
    seconds: dict[str, list[float]] = {"floor": [], **{name: [] for name, _ in runs}}
    for _ in range(args.rounds):
        for name, fn in runs:
            f1 = _timed(float_pass)
            t = _timed(fn)
            f2 = _timed(float_pass)
            seconds["floor"] += [round(f1[0], 2), round(f2[0], 2)]
            seconds[name].append(round(t[0], 2))
            for i, kind in enumerate(("wall", "cpu")):
                ratios[name][kind].append(t[i] / ((f1[i] + f2[i]) / 2))

    def summary(values: list[float]) -> dict[str, float]:
        return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
                "max": round(max(values), 2)}

    result = {
        "model": "resnet18 (seeded random init), trt_int8",
        "data": f"{args.batches} x {args.batch_size}x3x{args.size}x{args.size}",
        "threads": torch.get_num_threads(),
        "fused_cpu_fake_quant": os.environ.get("FXQ_CPU_FUSED", "default"),
        "rounds": args.rounds,
        "fused_cpu_stats": {k: round(v, 2) for k, v in fused_cpu_stats().items()},
        "wall_s": seconds,
        "quantize_s": round(t_quant, 2),
        "graphwise_first_call_x_floor": first_call,
        **{f"{name}_x_floor": {kind: summary(v) for kind, v in r.items()} for name, r in ratios.items()},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
