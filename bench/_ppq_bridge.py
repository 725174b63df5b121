"""What the benches share to put PPQ 0.6.6 side by side with fxq: the seeded models and data, the ONNX file both
load, and running ``bench/_ppq_runner.py`` under PPQ's own Python.

PPQ lives in a separate environment (it pins onnx 1.15 and protobuf 3.20). Its interpreter is given with
``--ppq-python PATH`` or the environment variable ``FXQ_BENCH_PPQ_PYTHON``; without either, the PPQ column is skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

RUNNER = Path(__file__).resolve().parent / "_ppq_runner.py"
ENV_VAR = "FXQ_BENCH_PPQ_PYTHON"


def add_ppq_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ppq-python", default=os.environ.get(ENV_VAR),
                        help=f"python of a venv with PPQ 0.6.6 (default: ${ENV_VAR}); absent = no PPQ column")
    parser.add_argument("--ppq-timeout", type=float, default=3 * 3600, help="seconds before a PPQ job is abandoned")


def machine() -> str:
    """Date, CPU and torch, for the header of a bench's output."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cpu}, {os.cpu_count()} cores, "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads), python {sys.version.split()[0]}")


def seeded_model(name: str) -> torch.nn.Module:
    """A torchvision model with seeded random init, in eval mode."""
    import torchvision

    torch.manual_seed(0)
    return getattr(torchvision.models, name)(weights=None).eval()


def batches(n: int, batch_size: int, size: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch_size, 3, size, size, generator=gen) for _ in range(n)]


def export_onnx(model: torch.nn.Module, example: torch.Tensor, path: Path) -> Path:
    """The file both sides load: TorchScript exporter, opset 13 (PPQ 0.6.6 parses it), fixed shapes."""
    torch.onnx.export(model, (example,), str(path), opset_version=13, dynamo=False,
                      input_names=["input"], output_names=["output"])
    return path


def save_batches(data: list[torch.Tensor], path: Path) -> Path:
    np.save(path, torch.stack(data).numpy())
    return path


def run_ppq(ppq_python: str | None, job: dict, workdir: Path, timeout: float) -> dict | None:
    """Run one job of ``_ppq_runner.py`` under ``ppq_python``; None (with the reason printed) when it fails."""
    if not ppq_python:
        return None
    job = {**job, "out": str(workdir / f"ppq_{job['task']}_result.json")}
    job_path = workdir / f"ppq_{job['task']}_job.json"
    job_path.write_text(json.dumps(job))
    try:
        proc = subprocess.run([ppq_python, str(RUNNER), str(job_path)], capture_output=True, text=True,
                              timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"PPQ job {job['task']} did not run: {exc}", flush=True)
        return None
    if proc.returncode != 0:
        print(f"PPQ job {job['task']} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
        return None
    return json.loads(Path(job["out"]).read_text())


def output_snr(outputs: np.ndarray | torch.Tensor, reference: list[torch.Tensor]) -> float:
    """PPQ's SNR of model outputs: noise power / signal power (lower is better), over all held-out batches."""
    out = torch.as_tensor(np.asarray(outputs)).reshape(-1)
    ref = torch.stack(reference).reshape(-1)
    return float((out - ref).pow(2).sum() / ref.pow(2).sum())
