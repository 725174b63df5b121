"""PPQ 0.6.6 side of the benches, run by PPQ's own Python (not fxq's): ``<ppq python> bench/_ppq_runner.py JOB.json``.

``bench/analysis.py`` and ``bench/reconstruction.py`` write the job (a json file in a temp dir) and read the result
json this script writes to ``job["out"]``. It imports neither fxq nor anything of this repository: only PPQ, torch
and numpy. Data comes as ``.npy`` files holding the stacked batches ``[n_batches, batch, C, H, W]``.

Jobs (``job["task"]``):

* ``analysis``: quantize ``job["onnx"]`` for TRT_INT8 (PPQ's ``trt_setting``), then in rounds time PPQ's FP32 pass
  (its ``TorchExecutor`` forward over the batches with every quantable op dequantized, i.e. quantization off) and
  ``ppq.quantization.analyse.graphwise_error_analyse`` on the same batches; the first round is the first analysis
  call in the process.
* ``reconstruction``: for each name in ``job["passes"]`` (``none``, ``adaround``, ``brecq``, ``lsq``), quantize the
  file again with that pass switched on in the ``QuantizationSetting``, time the pass (its ``optimize``) and, per
  block, its data collection and its training, measure the pass's peak RSS (the process's high-water mark is reset
  through ``/proc/self/clear_refs`` before the pass; peak = ``getrusage`` maxrss after it − RSS before it), and save
  the quantized model's outputs on the held-out batches (``.npy``) for the caller's SNR.
"""
from __future__ import annotations

import contextlib
import io
import json
import resource
import statistics
import sys
import time

import numpy as np
import torch


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _quiet():
    """PPQ prints banners, settings and progress bars: keep them off the caller's pipe."""
    return contextlib.redirect_stdout(io.StringIO())


def _quantize(job: dict, setting, calib: list[torch.Tensor]):
    from ppq import TargetPlatform
    from ppq.api import quantize_onnx_model

    with _quiet():
        return quantize_onnx_model(onnx_import_file=job["onnx"], calib_dataloader=calib, calib_steps=len(calib),
                                   input_shape=list(calib[0].shape), setting=setting,
                                   platform=TargetPlatform.TRT_INT8, device="cpu", verbose=0)


def _fp32_pass(executor, graph, data: list[torch.Tensor]) -> float:
    """PPQ's FP32 pass: its TorchExecutor over ``data`` with every quantable op dequantized (timed part only)."""
    from ppq.IR import QuantableOperation

    ops = [op for op in graph.operations.values() if isinstance(op, QuantableOperation)]
    for op in ops:
        op.dequantize()
    t0 = time.perf_counter()
    with torch.no_grad():
        for x in data:
            executor.forward(inputs=x)
    t = time.perf_counter() - t0
    for op in ops:
        op.restore_quantize_state()
    return t


def analysis(job: dict) -> dict:
    from ppq.api import QuantizationSettingFactory
    from ppq.executor import TorchExecutor
    from ppq.quantization.analyse import graphwise_error_analyse

    data = [torch.from_numpy(b) for b in np.load(job["calib"])]
    t0 = time.perf_counter()
    graph = _quantize(job, QuantizationSettingFactory.trt_setting(), data)
    t_quant = time.perf_counter() - t0
    executor = TorchExecutor(graph=graph, device="cpu")
    _fp32_pass(executor, graph, data[:1])  # warm-up of the executor, as the fxq side warms up its float model

    def graphwise() -> float:
        t = time.perf_counter()
        with _quiet():
            graphwise_error_analyse(graph=graph, running_device="cpu", dataloader=data, steps=len(data),
                                    verbose=False)
        return time.perf_counter() - t

    ratios, floors, seconds = [], [], []
    for _ in range(1 + job["rounds"]):  # the first round is the first call in the process
        f1 = _fp32_pass(executor, graph, data)
        t = graphwise()
        f2 = _fp32_pass(executor, graph, data)
        floors += [f1, f2]
        seconds.append(t)
        ratios.append(t / ((f1 + f2) / 2))
    return {"quantize_s": t_quant, "fp32_pass_s": floors, "graphwise_s": seconds,
            "first_call_x_floor": ratios[0],
            "graphwise_x_floor": {"median": statistics.median(ratios[1:] or ratios[:1]),
                                  "min": min(ratios[1:] or ratios[:1]), "max": max(ratios[1:] or ratios[:1])}}


def _pass_setting(name: str, job: dict):
    from ppq.api import QuantizationSettingFactory

    setting = QuantizationSettingFactory.trt_setting()
    cfg = job["settings"].get(name, {})
    if name == "lsq":
        setting.lsq_optimization = True
        st = setting.lsq_optimization_setting
    elif name in ("adaround", "brecq"):
        # PPQ 0.6.6 has one rounding pass, AdaroundPass (block-wise AdaRound = BRECQ without Fisher weighting),
        # switched on by blockwise_reconstruction; layer-wise AdaRound is the same pass with block_size 1
        setting.blockwise_reconstruction = True
        st = setting.blockwise_reconstruction_setting
    elif name == "none":
        return setting
    else:
        raise SystemExit(f"unknown pass {name!r}")
    st.collecting_device = "cpu"
    for key, value in cfg.items():
        if not hasattr(st, key):
            raise SystemExit(f"PPQ's {type(st).__name__} has no field {key!r}")
        setattr(st, key, value)
    return setting


class _PassProbe:
    """Times a PPQ training pass (``optimize``) and its per-block ``collect`` / ``finetune``, and its peak RSS."""

    def __init__(self) -> None:
        from ppq.quantization.optim import AdaroundPass, LearnedStepSizePass

        self.classes = (AdaroundPass, LearnedStepSizePass)
        self.saved: list[tuple[type, str, object]] = []
        self.reset()

    def reset(self) -> None:
        self.pass_s = 0.0
        self.collect_s: list[float] = getattr(self, "collect_s", [])  # the wrappers hold these very lists
        self.finetune_s: list[float] = getattr(self, "finetune_s", [])
        self.weight_scale_s: list[float] = getattr(self, "weight_scale_s", [])
        for times in (self.collect_s, self.finetune_s, self.weight_scale_s):
            times.clear()
        self.peak_kib = 0
        self.peak_method = "getrusage maxrss after the pass - VmRSS before (high-water mark reset by clear_refs)"

    def _wrap(self, cls: type, method: str, record) -> None:
        orig = getattr(cls, method)
        self.saved.append((cls, method, orig))

        def timed(inner_self, *args, **kwargs):
            return record(orig, inner_self, *args, **kwargs)

        setattr(cls, method, timed)

    def __enter__(self) -> "_PassProbe":
        def whole(orig, obj, *args, **kwargs):
            if not _reset_peak():
                self.peak_method = "getrusage maxrss delta (no clear_refs: a lower bound)"
            rss0 = _rss_kib()
            t = time.perf_counter()
            out = orig(obj, *args, **kwargs)
            self.pass_s += time.perf_counter() - t
            self.peak_kib = max(self.peak_kib, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0)
            return out

        def part(into: list[float]):
            def rec(orig, obj, *args, **kwargs):
                t = time.perf_counter()
                out = orig(obj, *args, **kwargs)
                into.append(time.perf_counter() - t)
                return out
            return rec

        for cls in self.classes:
            self._wrap(cls, "optimize", whole)
            self._wrap(cls, "collect", part(self.collect_s))
            self._wrap(cls, "finetune", part(self.finetune_s))
        # AdaroundPass first tunes each weight's scale (900 Adam steps per computing op, whatever the setting's steps)
        self._wrap(self.classes[0], "tune_block_weight_scale", part(self.weight_scale_s))
        return self

    def __exit__(self, *exc) -> None:
        for cls, method, orig in reversed(self.saved):
            setattr(cls, method, orig)


def reconstruction(job: dict) -> dict:
    from ppq.executor import TorchExecutor

    calib = [torch.from_numpy(b) for b in np.load(job["calib"])]
    held = [torch.from_numpy(b) for b in np.load(job["heldout"])]
    results = {}
    floor = None
    with _PassProbe() as probe:
        for name in job["passes"]:
            probe.reset()
            t0 = time.perf_counter()
            graph = _quantize(job, _pass_setting(name, job), calib)
            total = time.perf_counter() - t0
            executor = TorchExecutor(graph=graph, device="cpu")
            if floor is None:
                _fp32_pass(executor, graph, calib[:1])
                floor = _fp32_pass(executor, graph, calib)
            with torch.no_grad():
                outs = np.stack([executor.forward(inputs=x)[0].numpy() for x in held])
            path = f"{job['outputs_prefix']}_{name}.npy"
            np.save(path, outs)
            results[name] = {"quantize_s": total, "pass_s": probe.pass_s, "blocks": len(probe.finetune_s),
                             "collect_s": list(probe.collect_s), "finetune_s": list(probe.finetune_s),
                             "weight_scale_tuning_s": list(probe.weight_scale_s),
                             "peak_rss_mib": probe.peak_kib / 1024, "peak_method": probe.peak_method,
                             "outputs": path}
    return {"fp32_pass_s": floor, "passes": results}


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    torch.set_num_threads(job.get("threads", 2))
    torch.manual_seed(0)
    result = {"analysis": analysis, "reconstruction": reconstruction}[job["task"]](job)
    import ppq.core.config as ppq_config

    result["ppq_version"] = ppq_config.PPQ_CONFIG.VERSION
    result["torch"] = torch.__version__
    with open(job["out"], "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    with _quiet():
        import ppq  # noqa: F401
    main()
