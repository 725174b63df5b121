"""ONNX files nobody here wrote, through load -> quantize -> export -> runtime, one subprocess per file.

    python bench/onnx_corpus.py                               # the onnx package's own backend test files
    python bench/onnx_corpus.py --sets light --platforms trt_int8,ncnn_int8
    python bench/onnx_corpus.py --dir path/to/onnx/files      # any folder of .onnx files (searched recursively)

The default corpus is what ships inside the ``onnx`` wheel (``onnx/backend/test/data``): ``light`` (onnx-caffe2's
model-zoo graphs at opset 9, IR 3: AlexNet, DenseNet-121, GoogLeNet, Inception-v2, ResNet-50, ShuffleNet,
SqueezeNet, VGG-19, ZFNet-512; their weights are constants, so their numbers say little), ``pytorch-converted`` and
``pytorch-operator`` (torch 0.3/0.4's exports of single modules and ops at opset 6) and ``simple`` (hand-written
models: Expand to an input shape, sequences, string ops, training ops). Files of ``pytorch-*`` and ``simple`` come with
their inputs (``test_data_set_0``); a float input whose stored values are not usable (uninitialised memory in some
float64 files, constants) is drawn from U(0, 1) instead, as the ``light`` inputs are.

Steps per file: ``load`` (:func:`fxq.load_onnx`, its onnxruntime check on), then per platform ``quantize`` (two
calibration batches: the inputs and a copy with 5 % relative noise, which keeps signs for sqrt / log / pow), ``export`` and ``runtime`` — the exported file in onnxruntime
(default session and ``ORT_DISABLE_ALL``) or ncnn against fxq's simulation on a third batch, with the classes of
``bench/zoo.py`` (``ok`` at cosine >= 0.999; ``Degenerate``, ``Fused``, ``Sensitive``, ``Mismatch``). A file whose
inputs cannot be made (strings) is ``skipped``. Where ``load_onnx`` asks for ``input_shapes`` (symbolic dims shape
inference cannot resolve) or the export names a ``batch_dims`` entry with its dim, the bench follows the advice as
a user would (the shapes of the inputs it made; the entry given) and says so in ``diagnosis``. Output: a CSV (one row per file x platform x step) and a markdown
table per set.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo import PLATFORMS, _error, advised_batch_dims, check_runtime, record_rows  # noqa: E402  (the zoo's runtime check)

SETS = ("light", "pytorch-converted", "pytorch-operator", "simple")
UNKNOWN_DIM = 64
"""The size given to a symbolic or unknown input dim after dim 0 (an image's H and W) where no input is stored."""


def backend_data() -> Path:
    import onnx

    return Path(onnx.__file__).parent / "backend" / "test" / "data"


def corpus(sets: list[str], folder: str | None) -> list[tuple[str, str, Path, Path | None]]:
    """``(set, name, model file, test data folder or None)`` of every file to run."""
    if folder:
        return [("dir", str(p.relative_to(folder)), p, None) for p in sorted(Path(folder).rglob("*.onnx"))]
    root = backend_data()
    found = []
    for s in sets:
        if s == "light":
            found += [(s, p.stem, p, None) for p in sorted((root / s).glob("*.onnx"))]
        else:
            found += [(s, d.name, d / "model.onnx", d / "test_data_set_0") for d in sorted((root / s).iterdir())
                      if (d / "model.onnx").exists()]
    return found


def _usable(t: Any) -> bool:
    """Stored float values worth feeding: finite, moderate and not all equal."""
    import torch

    return t.numel() > 1 and bool(torch.isfinite(t).all()) and float(t.abs().max()) < 1e4 and float(
        t.double().std()) > 0


def _inputs(path: Path, data: Path | None) -> tuple:
    """The file's stored inputs, float ones replaced by U(0, 1) draws where their values are not usable."""
    import numpy as np
    import onnx
    import torch
    from onnx import numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    inits = {t.name for t in model.graph.initializer}
    declared = [i for i in model.graph.input if i.name not in inits]
    stored = sorted(data.glob("input_*.pb"), key=lambda p: int(p.stem.split("_")[1])) if data and data.exists() else []
    gen = torch.Generator().manual_seed(0)
    values = []
    for k, info in enumerate(declared):
        if k < len(stored):
            array = numpy_helper.to_array(onnx.load_tensor(str(stored[k])))
            if array.dtype.kind not in "biuf":
                raise TypeError(f"input {info.name!r} holds {array.dtype} values")
            t = torch.from_numpy(np.array(array))
        else:  # no stored input: the declared shape, a symbolic dim 1 at dim 0 (the batch) and UNKNOWN_DIM after
            dims = info.type.tensor_type.shape.dim
            shape = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1 if i == 0 else UNKNOWN_DIM
                     for i, d in enumerate(dims)]
            t = torch.empty(shape, dtype=torch.float32)
        if t.is_floating_point() and (k >= len(stored) or not _usable(t)):
            t = torch.rand(t.shape, generator=gen, dtype=t.dtype)
        values.append(t)
    return tuple(values)


def _input_names(path: Path) -> list[str]:
    """The file's graph inputs that are not initializers, in order (those :func:`_inputs` makes)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    inits = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def work(set_name: str, name: str, path: Path, data: Path | None, platforms: list[str]) -> list[dict[str, Any]]:
    """One file through every step; one record per step."""
    import torch

    import fxq

    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []

    def row(platform: str, step: str, status: str, **extra: Any) -> None:
        rows.append({"set": set_name, "file": name, "platform": platform, "step": step, "status": status, **extra})

    try:
        args = _inputs(path, data)
    except Exception as exc:
        row("-", "load", f"skipped: its inputs cannot be made ({_error(exc)})")
        return rows
    t0 = time.perf_counter()
    advice: dict[str, Any] = {}  # load_onnx arguments an error advised, followed as a user would
    try:
        gm = fxq.load_onnx(path)
    except fxq.FrontendError as exc:
        if "input_shapes=" not in str(exc):
            row("-", "load", _error(exc))
            return rows
        advice["input_shapes"] = {name: list(a.shape) for name, a in zip(_input_names(path), args)}
        try:
            gm = fxq.load_onnx(path, **advice)
        except Exception as exc2:
            row("-", "load", _error(exc2), diagnosis=f"followed: {advice}")
            return rows
    except Exception as exc:
        row("-", "load", _error(exc))
        return rows
    row("-", "load", "ok", seconds=round(time.perf_counter() - t0, 2),
        **({"diagnosis": f"followed: {advice}"} if advice else {}))
    gen = torch.Generator().manual_seed(1)

    def jittered(a: torch.Tensor) -> torch.Tensor:  # relative noise: signs and zeros stay (sqrt, log, pow inputs)
        if not a.is_floating_point() or a.numel() < 2:
            return a
        return a * (1 + 0.05 * torch.randn(a.shape, generator=gen, dtype=a.dtype))

    calib = [args, tuple(jittered(a) for a in args)]
    fresh = tuple(jittered(a) for a in args)
    with tempfile.TemporaryDirectory() as tmp:
        for platform in platforms:
            try:
                q = fxq.quantize(gm, calib, platform=platform, progress=False)
            except Exception as exc:
                row(platform, "quantize", _error(exc))
                continue
            row(platform, "quantize", "ok")
            given: dict[str, Any] = {}  # batch_dims entries the export's errors advised, followed as a user does
            files, failure = None, None
            for _ in range(8):  # load again with the advice, quantize, export; each error may name one more tensor
                try:
                    if given:
                        q = fxq.quantize(fxq.load_onnx(path, **advice, batch_dims=given), calib, platform=platform,
                                         progress=False)
                    files = fxq.export(q, platform, Path(tmp) / f"{platform}.onnx")
                    break
                except Exception as exc:
                    failure = exc
                    more = advised_batch_dims(str(exc)) if isinstance(exc, fxq.ExportError) else None
                    if not more or set(more) <= set(given):
                        break
                    given.update(more)
            followed = {"diagnosis": f"followed: batch_dims={given}"} if given else {}
            if files is None:
                row(platform, "export", _error(failure), **followed)
                continue
            row(platform, "export", "ok", **followed)
            # ncnn has no batch: it runs the first sample (zoo's ncnn_run), so the simulation runs on that sample too;
            # an input without a batch dim (batch_dims={name: None}) whole
            sample = fresh
            if platform == "ncnn_int8":
                from fxq.graph.data import input_batch_dim

                dims = [input_batch_dim(q, p) for p in q.graph.find_nodes(op="placeholder")]
                sample = tuple(a if not a.dim() or d is None else a.narrow(d, 0, 1) for a, d in zip(fresh, dims))
            try:
                status, extra = check_runtime(q, files, sample, platform, platform)
            except Exception as exc:
                row(platform, "runtime", _error(exc))
                continue
            row(platform, "runtime", status, **extra)
    return rows


def run_one(item: tuple[str, str, Path, Path | None], platforms: list[str], timeout: float) -> list[dict[str, Any]]:
    set_name, name, path, data = item
    cmd = [sys.executable, __file__, "--worker", json.dumps([set_name, name, str(path), str(data or "")]),
           "--platforms", ",".join(platforms)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, PYTHONWARNINGS="ignore"))
    except subprocess.TimeoutExpired:
        return [{"set": set_name, "file": name, "platform": "-", "step": "timeout",
                 "status": f"Timeout: over {timeout:.0f} s"}]
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("CORPUS-ROWS "):
            return json.loads(line[len("CORPUS-ROWS "):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return [{"set": set_name, "file": name, "platform": "-", "step": "crash",
             "status": f"Crash (exit {proc.returncode}): {tail}"}]


def summarize(rows: list[dict[str, Any]], platforms: list[str]) -> str:
    """Markdown: per set, files loaded and deployed per platform (every step ok), then the failure classes."""
    files: dict[str, set[str]] = defaultdict(set)
    ok: dict[tuple[str, str], set[str]] = defaultdict(set)
    skipped: dict[str, set[str]] = defaultdict(set)
    for r in rows:
        files[r["set"]].add(r["file"])
        if r["status"] == "ok":
            ok[(r["file"], r["platform"])].add(r["step"])
        if r["status"].startswith("skipped"):
            skipped[r["set"]].add(r["file"])
    lines = ["| set | files | inputs made | loaded | " + " | ".join(platforms) + " |",
             "|" + "---|" * (4 + len(platforms))]
    for s in sorted(files) + ["all"]:
        names = set().union(*files.values()) if s == "all" else files[s]
        skip = set().union(*skipped.values()) if s == "all" else skipped[s]
        loaded = sum("load" in ok[(n, "-")] for n in names)
        cells = [str(sum({"quantize", "export", "runtime"} <= ok[(n, p)] for n in names)) for p in platforms]
        lines.append(f"| {s} | {len(names)} | {len(names) - len(skip)} | {loaded} | " + " | ".join(cells) + " |")
    failures: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        if r["status"] != "ok":
            failures[f"{r['step']} ({r['platform']}): {r['status'].split(':')[0]}"].append(r["file"])
    lines += ["", "| failure (step, platform: class) | files |", "|---|---|"]
    lines += [f"| {k} | {len(v)}: {', '.join(sorted(v)[:6])}{' ...' if len(v) > 6 else ''} |"
              for k, v in sorted(failures.items(), key=lambda kv: -len(kv[1]))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)}")
    parser.add_argument("--dir", help="a folder of .onnx files instead of the onnx package's (no stored inputs)")
    parser.add_argument("--match", default="", help="only files whose name contains this")
    parser.add_argument("--platforms", default=",".join(PLATFORMS))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per file")
    parser.add_argument("--csv", default="bench/onnx_corpus.csv")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    platforms = [p for p in args.platforms.split(",") if p]
    if args.worker:
        set_name, name, path, data = json.loads(args.worker)
        try:
            rows = work(set_name, name, Path(path), Path(data) if data else None, platforms)
        except Exception as exc:  # a failure outside the recorded steps
            traceback.print_exc()
            rows = [{"set": set_name, "file": name, "platform": "-", "step": "setup",
                     "status": f"{type(exc).__name__} (raw): {str(exc)[:300]}"}]
        print("CORPUS-ROWS " + json.dumps(rows, default=str))
        return 0
    sets = [s for s in args.sets.split(",") if s]
    if any(s not in SETS for s in sets):
        parser.error(f"--sets {args.sets}: use {', '.join(SETS)}")
    items = [i for i in corpus(sets, args.dir) if args.match in i[1]]
    fields = ["set", "file", "platform", "step", "status", "seconds", "cosine_ort", "cosine_ort_disable_all",
              "cosine_ncnn", "tf_identical", "tf_max_code_diff", "cosine_sim_perturbed", "diagnosis"]
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with open(args.csv, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for item in items:
            t0 = time.perf_counter()
            record_rows(run_one(item, platforms, args.timeout), rows, writer, fh, f"{item[0]:18s} {item[1]:44s}", t0)
    print()
    print(summarize(rows, platforms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
