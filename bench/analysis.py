"""Graphwise analysis cost, as a multiple of one FP32 pass over the same data: fxq and PPQ 0.6.6.

Models: torchvision ResNet-18 and MobileNetV2 (seeded random init), each on two paths: ``native`` (the
``nn.Module`` into ``fxq.quantize``) and ``onnx`` (``torch.onnx.export(dynamo=False, opset 13)``, then
``fxq.load_onnx``). Each (model, path) runs in its own process, so its first analysis is the first call in a
process. Measured in that process: these machines are shared and noisy, so each round times the floor, then the
analysis, then the floor again, and the ratio of that round is analysis / mean of its two floors; the median over
rounds is reported (with min / max), for wall time and for this process's CPU time.

* floor: the float model of that path (the torchvision module, or the float ``GraphModule`` ``fxq.load_onnx``
  gives), one forward pass over the batches;
* two passes (reference): the quantized model over the batches once inside ``fxq.fp32_mode`` and once
  quantized — what any graphwise analysis must at least run;
* ``fxq.graphwise_error_analyse`` (computing ops, SNR: the default); ``--all-ops`` also times
  ``ops="quantized"``; its first call in the process (before the fused path has warmed up) is reported
  separately.

The fused CPU fake-quant path (``FXQ_CPU_FUSED``, compiled by inductor after some eager use) is warmed
up by untimed quantized passes and analyses over the data until nothing new compiles, so that no compile
lands in a timed section; ``--no-fused`` measures the eager fake-quant instead.

PPQ column (with ``--ppq-python PATH`` or ``$FXQ_BENCH_PPQ_PYTHON``; skipped without): in a subprocess under
PPQ's own Python (``bench/_ppq_runner.py``), the same ONNX file and the same batches (a ``.npy``) are quantized
with ``quantize_onnx_model(..., TargetPlatform.TRT_INT8, trt_setting)``, then rounds of PPQ's FP32 pass (its
``TorchExecutor`` forward with every quantable op dequantized, i.e. quantization off — not onnxruntime),
``ppq.quantization.analyse.graphwise_error_analyse`` (``steps`` = the batches), FP32 pass again; its first
round is PPQ's first analysis in that process.

Usage: ``python bench/analysis.py [--models resnet18 mobilenet_v2] [--paths native onnx] [--batches 8]
[--batch-size 8] [--size 224] [--rounds 5] [--all-ops] [--no-fused] [--ppq-python PATH] [--allocator steady|default]
[--device cpu|cuda]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_DEVICE = "cpu"


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process), the device's queued work included."""
    from _host import synchronize

    synchronize(_DEVICE)
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    synchronize(_DEVICE)
    return time.perf_counter() - w0, time.process_time() - c0


def measure(args: argparse.Namespace, model_name: str, path: str, onnx_file: str | None) -> dict:
    """One (model, path) in this process: first analysis, warm-up, rounds."""
    import torch

    import fxq
    from fxq.fused_cpu import fused_cpu_stats

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _ppq_bridge import batches, seeded_model

    global _DEVICE
    _DEVICE = args.device
    torch.set_num_threads(args.threads)
    data = [x.to(args.device) for x in batches(args.batches, args.batch_size, args.size, seed=0)]
    if path == "onnx":
        model = fxq.load_onnx(onnx_file).to(args.device)  # the float model of this path: the floor
        source = fxq.load_onnx(onnx_file).to(args.device)
    else:
        model = source = seeded_model(model_name).to(args.device)

    t0 = time.perf_counter()
    gm = fxq.quantize(source, data, platform="trt_int8", progress=False)
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
        "model": f"{model_name} (seeded random init), trt_int8",
        "path": path,
        "data": f"{args.batches} x {args.batch_size}x3x{args.size}x{args.size}",
        "threads": torch.get_num_threads(),
        "device": args.device,
        "fused_cpu_fake_quant": os.environ.get("FXQ_CPU_FUSED", "default"),
        "rounds": args.rounds,
        "fused_cpu_stats": {k: round(v, 2) for k, v in fused_cpu_stats().items()},
        "wall_s": seconds,
        "quantize_s": round(t_quant, 2),
        "graphwise_first_call_x_floor": first_call,
        **{f"{name}_x_floor": {kind: summary(v) for kind, v in r.items()} for name, r in ratios.items()},
    }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    ap.add_argument("--paths", nargs="+", default=["native", "onnx"], choices=["native", "onnx"])
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--all-ops", action="store_true", help="also time the analysis of every quantized op")
    ap.add_argument("--no-fused", action="store_true", help="eager fake-quant (FXQ_CPU_FUSED=0)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # MODEL:PATH, run in a child process
    ap.add_argument("--onnx-file", help=argparse.SUPPRESS)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _host import add_allocator_argument, add_device_argument, apply_allocator, device_line
    from _ppq_bridge import add_ppq_argument

    add_ppq_argument(ap)
    add_allocator_argument(ap)
    add_device_argument(ap)
    args = ap.parse_args()
    allocator = apply_allocator(args.allocator)
    if args.no_fused:
        os.environ["FXQ_CPU_FUSED"] = "0"
    if args.one:
        model_name, path = args.one.split(":")
        print(json.dumps(measure(args, model_name, path, args.onnx_file)))
        return

    import torch
    from _ppq_bridge import batches, export_onnx, machine, run_ppq, save_batches, seeded_model

    torch.set_num_threads(args.threads)
    print(f"{machine()}, {allocator}", flush=True)
    if args.device != "cpu":
        print(device_line(args.device), flush=True)
    passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("batches", "batch_size", "size",
                                                                           "threads", "rounds", "allocator", "device")]
    passthrough += ["--all-ops"] * args.all_ops + ["--no-fused"] * args.no_fused
    results = []
    with tempfile.TemporaryDirectory(prefix="fxq_analysis_") as tmp:
        work = Path(tmp)
        data = batches(args.batches, args.batch_size, args.size, seed=0)
        npy = save_batches(data, work / "calib.npy")
        for model_name in args.models:
            onnx_file = export_onnx(seeded_model(model_name), data[0], work / f"{model_name}.onnx")
            row: dict = {"model": model_name}
            for path in args.paths:
                proc = subprocess.run([sys.executable, __file__, f"--one={model_name}:{path}",
                                       f"--onnx-file={onnx_file}", *passthrough], capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"{model_name} {path}: failed\n{proc.stderr[-3000:]}", flush=True)
                    continue
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                row[path] = r
                print(json.dumps(r, indent=2), flush=True)
            ppq = run_ppq(args.ppq_python, {"task": "analysis", "onnx": str(onnx_file), "calib": str(npy),
                                            "rounds": args.rounds, "threads": args.threads}, work, args.ppq_timeout)
            if ppq is not None:
                row["ppq"] = ppq
                print(json.dumps({"ppq": ppq}, indent=2), flush=True)
            results.append(row)
    print("\nsummary: graphwise analysis / one FP32 pass of the same side, wall time, median (min-max); first call")
    for row in results:
        for path in args.paths:
            if path in row:
                g = row[path]["graphwise_x_floor"]["wall"]
                print(f"  {row['model']:13s} fxq {path:6s} {g['median']:5.2f}x ({g['min']:.2f}-{g['max']:.2f})  "
                      f"first call {row[path]['graphwise_first_call_x_floor']:.2f}x", flush=True)
        if "ppq" in row:
            g = row["ppq"]["graphwise_x_floor"]
            print(f"  {row['model']:13s} PPQ onnx   {g['median']:5.2f}x ({g['min']:.2f}-{g['max']:.2f})  "
                  f"first call {row['ppq']['first_call_x_floor']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
