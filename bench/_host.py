"""How the timing benches set up their process: glibc's allocator kept in one regime for the whole run.

On Linux, glibc serves a large block (an activation of a batch of images: megabytes) with ``mmap`` and gives it
back with ``munmap`` when freed, and it trims freed memory at the top of its heap back to the kernel. Every such
block is then faulted in and zeroed by the kernel again on its next use. How often that happens depends on the
process's history (glibc raises its ``mmap`` threshold as blocks are freed), so the same FP32 pass in the same
process ran at 0.36 s or 1.1 s (torchvision MobileNetV2, 8 batches of 8x3x224x224, 2 threads) and every ratio
against it moved with it. ``steady`` fixes the thresholds for this process (``mallopt``) and for the processes it
starts (the ``MALLOC_*_`` variables, read by glibc at start-up: fxq's child processes and PPQ's runner alike):
blocks up to 32 MiB come from the heap, which keeps up to 1 GiB of freed memory and grows 256 MiB at a time.
Peak memory is unchanged; freed memory is kept by the process instead of given back. ``default`` leaves the
process as it started (glibc's own behaviour unless the variables were set).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import platform

STEADY = {  # environment variable: (mallopt parameter, value)
    "MALLOC_MMAP_THRESHOLD_": (-3, 32 << 20),  # M_MMAP_THRESHOLD
    "MALLOC_TRIM_THRESHOLD_": (-1, 1 << 30),  # M_TRIM_THRESHOLD
    "MALLOC_TOP_PAD_": (-2, 256 << 20),  # M_TOP_PAD
}


def add_allocator_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allocator", choices=["steady", "default"], default="steady",
                        help="glibc allocator regime (see bench/_host.py; default: steady)")


def apply_allocator(mode: str) -> str:
    """Put this process (and its future children) in allocator regime ``mode``; return a line for the header."""
    if mode == "default":
        inherited = [f"{k}={os.environ[k]}" for k in STEADY if k in os.environ]
        return "allocator: as started" + (f" ({', '.join(inherited)})" if inherited else " (glibc default)")
    if platform.libc_ver()[0] != "glibc":
        return f"allocator: {platform.libc_ver()[0] or 'not glibc'} (left as is)"
    libc = ctypes.CDLL(None)
    for name, (param, value) in STEADY.items():
        os.environ[name] = str(value)
        if libc.mallopt(param, value) != 1:
            raise OSError(f"mallopt({param}, {value}) failed")
    return "allocator: glibc steady (" + ", ".join(f"{k}={v}" for k, (_, v) in STEADY.items()) + ")"


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the models and data live (cuda: fxq's Triton kernels; default: cpu)")


def synchronize(device: str) -> None:
    """Wait for the device's queued work, so that a host clock read after it times the work (CUDA is async)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def device_line(device: str) -> str:
    """The device part of a bench header: the GPU's name, or the CPU's threads."""
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"CPU, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
