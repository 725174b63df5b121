"""AdaRound, BRECQ and LSQ on ResNet-18: time per block, peak memory and output SNR, fxq and PPQ 0.6.6 side by side.

    python bench/reconstruction.py [--quick] [--passes adaround brecq lsq] [--steps N] [--batches 8] [--batch-size 8]
                                   [--size 224] [--heldout 4] [--path onnx|native] [--profile PASS]
                                   [--ppq-python PATH]

Both sides quantize the same ONNX file (torchvision ResNet-18, seeded random init, exported once with
``torch.onnx.export(dynamo=False, opset 13)``) for TRT_INT8 on the same ``--batches`` calibration batches, with one
training pass switched on in the setting, the settings matched field for field:

* ``adaround``: fxq ``setting.adaround`` (layer by layer); PPQ 0.6.6 has one rounding pass, ``AdaroundPass``, switched
  on by ``setting.blockwise_reconstruction``: it runs here with ``block_size=1``. lr 1e-3, rounding regularizer
  0.01 (PPQ gamma 1), beta 20 -> 2 after a 20 % warm-up, scales fixed.
* ``brecq``: fxq ``setting.blockwise_reconstruction`` with ``drop_prob=0`` (BRECQ, not QDrop, which PPQ lacks);
  PPQ's ``AdaroundPass`` through ``blockwise_reconstruction``; ``block_size=4``, lr 1e-3, gamma 1, scales fixed.
* ``lsq``: fxq ``setting.lsq_optimization``; PPQ's ``LearnedStepSizePass`` through ``lsq_optimization``;
  ``block_size=4``, lr 1e-5, scales trainable, gamma 0.

Steps per block (layer) default to PPQ's setting defaults (5000 for the rounding passes, 500 for LSQ): hours on a
2-core CPU. ``--quick`` takes 20 / 20 / 10 steps: the fxq side took 4 minutes on a loaded 2-core host (its FP32
pass 5x slower than quiet), so about 1-2 minutes quiet. The PPQ column takes far longer whatever the steps: before
each block PPQ runs the whole model twice over the calibration batches (``collect``), and its AdaroundPass first
tunes each weight's scale (900 Adam steps per computing op): ~30 minutes for layer-wise AdaRound alone on that
host. ``--sides fxq`` / ``--sides ppq`` runs one side. ``--steps N`` sets all three passes' steps.

Reported per pass and side: the pass's wall time (fxq: ``run_algorithms("post")`` between ``calibrate`` and
``convert``, exactly what ``fxq.quantize`` runs; PPQ: the pass's ``optimize``), that as a multiple of the side's
own FP32 pass over the calibration batches (fxq: the float model; PPQ: its TorchExecutor with quantization off),
time per block (total / blocks, and PPQ's split into data collection and training), the pass's peak memory
(``resource.getrusage`` maxrss after the pass minus VmRSS before it, the process's high-water mark reset through
``/proc/self/clear_refs`` right before the pass; tracemalloc does not see torch's CPU allocations), and the
output SNR (PPQ's: noise power / signal power, lower is better) of the final quantized model against the float
model on ``--heldout`` batches that calibration never saw, next to the same SNR without the pass. fxq runs in this
process, PPQ in a subprocess under its own Python; ratios are taken within each process.

``--profile PASS`` runs fxq's PASS once more under ``torch.profiler`` (CPU) and prints its top ops.
"""
from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _host import add_allocator_argument, apply_allocator  # noqa: E402
from _ppq_bridge import (  # noqa: E402
    add_ppq_argument,
    batches,
    export_onnx,
    machine,
    output_snr,
    run_ppq,
    save_batches,
    seeded_model,
)
from ptq import fp32_pass  # noqa: E402

import fxq  # noqa: E402
from fxq.algorithms import run_algorithms  # noqa: E402

PASSES = ("adaround", "brecq", "lsq")
PPQ_DEFAULT_STEPS = {"adaround": 5000, "brecq": 5000, "lsq": 500}
QUICK_STEPS = {"adaround": 20, "brecq": 20, "lsq": 10}
# fxq setting switch and settings field per pass, and the matched fields (same names on both sides)
FXQ_SWITCH = {"adaround": ("adaround", "adaround_setting"),
              "brecq": ("blockwise_reconstruction", "blockwise_reconstruction_setting"),
              "lsq": ("lsq_optimization", "lsq_optimization_setting")}


def matched_settings(steps: dict[str, int]) -> dict[str, dict]:
    """The PPQ setting fields of each pass (fxq's take the same values, plus the fxq-only ones below)."""
    return {"adaround": {"steps": steps["adaround"], "lr": 1e-3, "gamma": 1.0, "block_size": 1,
                         "is_scale_trainable": False},
            "brecq": {"steps": steps["brecq"], "lr": 1e-3, "gamma": 1.0, "block_size": 4,
                      "is_scale_trainable": False},
            "lsq": {"steps": steps["lsq"], "lr": 1e-5, "gamma": 0.0, "block_size": 4, "is_scale_trainable": True}}


def fxq_setting(name: str, fields: dict) -> fxq.QuantizationSetting:
    setting = fxq.QuantizationSetting()
    if name == "none":
        return setting
    switch, field = FXQ_SWITCH[name]
    setattr(setting, switch, True)
    st = getattr(setting, field)
    if name == "adaround":  # layer by layer by construction; PPQ's gamma 1 = a regularizer weight of 0.01
        st.steps, st.lr, st.reg_weight = fields["steps"], fields["lr"], 0.01 * fields["gamma"]
    else:
        for key, value in fields.items():
            setattr(st, key, value)
    if name == "brecq":
        st.drop_prob = 0.0  # BRECQ; fxq's default 0.5 is QDrop
    return setting


class _BlockTimes(logging.Handler):
    """Time stamps of the algorithms' one DEBUG record per finished block (layer)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.stamps: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "reconstruction loss" in record.getMessage():
            self.stamps.append(time.perf_counter())


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _reset_peak() -> None:
    try:  # Linux: resets the high-water mark that getrusage's maxrss reports
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # elsewhere the delta is a lower bound
        pass


def run_fxq(name: str, source, fields: dict, calib: list[torch.Tensor], held: list[torch.Tensor]) -> dict:
    """prepare -> calibrate -> the pass (timed, peak memory) -> convert, as ``fxq.quantize`` runs them."""
    setting = fxq_setting(name, fields)
    t0 = time.perf_counter()
    model = fxq.load_onnx(source) if isinstance(source, Path) else source
    gm = fxq.prepare(model, "trt_int8", example_inputs=calib[0], setting=setting)
    fxq.calibrate(gm, calib, progress=False, bake=False)
    handler = _BlockTimes()
    algo_logger = logging.getLogger("fxq.algorithms")
    level, propagate = algo_logger.level, algo_logger.propagate
    algo_logger.setLevel(logging.DEBUG)
    algo_logger.propagate = False  # the records are only counted here
    algo_logger.addHandler(handler)
    _reset_peak()
    rss0 = _rss_kib()
    t1 = time.perf_counter()
    try:
        gm = run_algorithms("post", gm, calib, setting)
    finally:
        t_pass = time.perf_counter() - t1
        algo_logger.removeHandler(handler)
        algo_logger.setLevel(level)
        algo_logger.propagate = propagate
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    fxq.convert(gm)
    total = time.perf_counter() - t0
    with torch.no_grad():
        outs = torch.stack([gm(x) for x in held])
    stamps = [t1] + handler.stamps
    per_block = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"quantize_s": total, "pass_s": t_pass, "blocks": len(per_block), "block_s": per_block,
            "peak_rss_mib": peak / 1024, "outputs": outs}


def profile_fxq(name: str, source, fields: dict, calib: list[torch.Tensor]) -> None:
    from torch.profiler import ProfilerActivity, profile

    setting = fxq_setting(name, fields)
    model = fxq.load_onnx(source) if isinstance(source, Path) else source
    gm = fxq.prepare(model, "trt_int8", example_inputs=calib[0], setting=setting)
    fxq.calibrate(gm, calib, progress=False, bake=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_algorithms("post", gm, calib, setting)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"steps per block {QUICK_STEPS} instead of PPQ's defaults")
    parser.add_argument("--steps", type=int, help="steps per block for every pass")
    parser.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--heldout", type=int, default=4, help="held-out batches for the output SNR")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--path", choices=("onnx", "native"), default="onnx",
                        help="fxq loads the ONNX file PPQ loads (default) or takes the torchvision module")
    parser.add_argument("--profile", choices=PASSES, help="also profile this fxq pass with torch.profiler")
    parser.add_argument("--sides", nargs="+", default=["fxq", "ppq"], choices=["fxq", "ppq"],
                        help="run one side only (e.g. to re-run PPQ's long passes alone)")
    parser.add_argument("--json", help="write the results here")
    add_ppq_argument(parser)
    add_allocator_argument(parser)
    args = parser.parse_args(argv)
    allocator = apply_allocator(args.allocator)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    steps = dict(QUICK_STEPS if args.quick else PPQ_DEFAULT_STEPS)
    if args.steps:
        steps = dict.fromkeys(steps, args.steps)
    fields = matched_settings(steps)
    print(f"{machine()}, {allocator}", flush=True)

    model = seeded_model("resnet18")
    calib = batches(args.batches, args.batch_size, args.size, seed=0)
    held = batches(args.heldout, args.batch_size, args.size, seed=1)
    with torch.no_grad():
        reference = [model(x) for x in held]
    result: dict = {"machine": machine(), "model": "resnet18", "path": args.path,
                    "data": f"{args.batches} x {args.batch_size}x3x{args.size}x{args.size}, held out {args.heldout}",
                    "settings": fields, "fxq": {}, "ppq": None}
    with tempfile.TemporaryDirectory(prefix="fxq_recon_") as tmp:
        work = Path(tmp)
        onnx_path = export_onnx(model, calib[0], work / "resnet18.onnx")
        source = onnx_path if args.path == "onnx" else model
        fp32_pass(model, calib[:1])
        floor = fp32_pass(model, calib)
        result["fxq_fp32_pass_s"] = floor
        for name in ["none", *args.passes] if "fxq" in args.sides else []:
            r = run_fxq(name, source, fields.get(name, {}), calib, held)
            r["snr"] = output_snr(r.pop("outputs"), reference)
            result["fxq"][name] = r
            print(f"fxq  {name:9s} pass {r['pass_s']:8.1f} s ({r['pass_s'] / floor:6.1f}x FP32 pass)  "
                  f"{r['blocks']:2d} blocks, {_mean(r['block_s']):6.2f} s/block  peak +{r['peak_rss_mib']:6.0f} MiB  "
                  f"output SNR {r['snr']:.5f}", flush=True)
        if args.profile:
            profile_fxq(args.profile, source, fields[args.profile], calib)
        if args.ppq_python and "ppq" in args.sides:
            job = {"task": "reconstruction", "onnx": str(onnx_path), "threads": args.threads,
                   "calib": str(save_batches(calib, work / "calib.npy")),
                   "heldout": str(save_batches(held, work / "heldout.npy")),
                   "passes": ["none", *args.passes], "settings": fields, "outputs_prefix": str(work / "ppq_out")}
            ppq = run_ppq(args.ppq_python, job, work, args.ppq_timeout)
            if ppq is not None:
                import numpy as np

                for name, r in ppq["passes"].items():
                    r["snr"] = output_snr(np.load(r.pop("outputs")), reference)
                    r["block_s"] = [c + f for c, f in zip(r["collect_s"], r["finetune_s"])]
                    print(f"PPQ  {name:9s} pass {r['pass_s']:8.1f} s ({r['pass_s'] / ppq['fp32_pass_s']:6.1f}x FP32 "
                          f"pass)  {r['blocks']:2d} blocks, {_mean(r['block_s']):6.2f} s/block (collect "
                          f"{_mean(r['collect_s']):.2f}, train {_mean(r['finetune_s']):.2f}, of which weight-scale "
                          f"tuning {sum(r['weight_scale_tuning_s']) / max(1, r['blocks']):.2f})  "
                          f"peak +{r['peak_rss_mib']:6.0f} MiB  output SNR {r['snr']:.5f}", flush=True)
            result["ppq"] = ppq
    print("\nsummary (pass time as a multiple of each side's own FP32 pass; SNR = noise / signal, lower is better)")
    for name in args.passes:
        f = result["fxq"].get(name)
        line = f"  {name:9s} fxq {f['pass_s'] / floor:7.1f}x  SNR {f['snr']:.5f}" if f else f"  {name:9s} fxq -"
        if result["ppq"] and f:
            p = result["ppq"]["passes"][name]
            pr = p["pass_s"] / result["ppq"]["fp32_pass_s"]
            line += (f"   PPQ {pr:7.1f}x  SNR {p['snr']:.5f}   fxq faster by {p['pass_s'] / f['pass_s']:.2f}x (wall), "
                     f"{pr / (f['pass_s'] / floor):.2f}x (ratio of ratios)")
        elif result["ppq"]:
            p = result["ppq"]["passes"][name]
            line += f"   PPQ {p['pass_s'] / result['ppq']['fp32_pass_s']:7.1f}x  SNR {p['snr']:.5f}"
        print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
