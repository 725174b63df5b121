"""Fake-quant throughput: fxq's ops vs torch's fake-quant ops vs a plain copy, on the same tensors.

Run ``python bench/fake_quant.py [--numel N] [--repeat R] [--device cpu|cuda] [--channels C]``.
On CPU, fxq runs its fused CPU path (compiled once before timing; the compile time is printed) and,
for reference, the eager torch path. On CUDA, fxq runs its Triton kernels.

Throughput counts nominal bytes read + written per element, the same for every row of a table so the
ratios are ratios of time: forward 2 x itemsize (read x, write y), backward 3 x itemsize (read grad and x,
write grad_x). ``copy`` is ``y.copy_(x)`` into a preallocated tensor; ``clone`` also allocates its output,
as the fake-quant ops must. On CPU the first-touch page faults of each fresh 64 MB output cost about as
much as the copy itself; torch's ``THP_MEM_ALLOC_ENABLE=1`` (huge pages for large CPU tensors, read once at
start-up) removes most of that, for every row alike. On CUDA use a large ``--numel`` (e.g. 67108864) so
launch overhead stays hidden.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxq.ops  # noqa: E402,F401  (registers torch.ops.fxq)
from fxq.fused_cpu import cpu_fusion, fused_cpu_stats  # noqa: E402
from fxq.spec import RoundingPolicy  # noqa: E402

QMIN, QMAX = -128, 127
ROUNDING = int(RoundingPolicy.HALF_EVEN)
COPY, CLONE = "copy (y.copy_(x))", "clone (allocating copy)"


def _timer(device: str) -> Callable[[Callable[[], object], int], float]:
    """Seconds per call of ``fn``: median of ``repeat`` calls on CPU; on CUDA, the mean of ``repeat``
    back-to-back calls between two events (so host launch overhead overlaps with the kernels)."""

    def run(fn: Callable[[], object], repeat: int) -> float:
        for _ in range(2):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeat):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / repeat
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return run


def _table(title: str, rows: list[tuple[str, float]], nbytes: int, torch_name: str) -> None:
    """Print rows (name, seconds) with GB/s and time ratios against torch's op, the copy and the clone."""
    by_name = dict(rows)
    print(f"\n{title}")
    print(f"  {'':34s} {'ms':>9s} {'GB/s':>8s} {'vs torch':>9s} {'vs copy':>8s} {'vs clone':>9s}")
    for name, seconds in rows:
        vs_torch, vs_copy, vs_clone = (by_name[ref] / seconds for ref in (torch_name, COPY, CLONE))
        gbs = nbytes / seconds / 1e9
        print(f"  {name:34s} {seconds * 1e3:9.2f} {gbs:8.2f} {vs_torch:9.2f} {vs_copy:8.2f} {vs_clone:9.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 24, help="elements per tensor (default 16M)")
    parser.add_argument("--repeat", type=int, default=10, help="timed calls per row (median reported)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--channels", type=int, default=64, help="channels of the per-channel case (axis 0)")
    parser.add_argument("--no-eager", action="store_true", help="skip the (slow) eager fxq rows on CPU")
    args = parser.parse_args(argv)

    device, n, channels = args.device, args.numel, args.channels
    n -= n % channels
    timeit = _timer(device)
    torch.manual_seed(0)
    x = torch.randn(channels, n // channels, device=device)
    g = torch.randn_like(x)
    out = torch.empty_like(x)
    scale = torch.full((1,), 0.02, device=device)
    offset = torch.zeros(1, device=device)
    scale_c = torch.rand(channels, device=device) * 0.02 + 0.01
    offset_c = torch.zeros(channels, device=device)
    zp_c = torch.zeros(channels, dtype=torch.int32, device=device)
    op = torch.ops.fxq
    item = x.element_size()
    print(f"device={device} numel={n} dtype={x.dtype} channels={channels} threads={torch.get_num_threads()}")
    print(f"torch {torch.__version__}  THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}")

    def row(name: str, fn: Callable[[], object]) -> tuple[str, float]:
        return name, timeit(fn, args.repeat)

    def fxq_rows(label: str) -> tuple[list[tuple[str, float]], list[tuple[str, float]], list[tuple[str, float]]]:
        lin, bwd = op.fake_quant_linear, op.fake_quant_linear_backward
        qargs = (QMIN, QMAX, ROUNDING)
        fwd_t = [row(f"fxq per-tensor {label}", lambda: lin(x, scale, offset, 0, *qargs))]
        fwd_c = [row(f"fxq per-channel {label}", lambda: lin(x, scale_c, offset_c, 0, *qargs))]
        back = [
            row(f"fxq grad_x {label}", lambda: bwd(g, x, scale, offset, 0, *qargs, False, False)),
            row(f"fxq grad_x+scale+offset {label}", lambda: bwd(g, x, scale, offset, 0, *qargs, True, True)),
            row(f"fxq per-channel grad_x {label}", lambda: bwd(g, x, scale_c, offset_c, 0, *qargs, False, False)),
        ]
        return fwd_t, fwd_c, back

    copy_rows = [row(COPY, lambda: out.copy_(x)), row(CLONE, lambda: x.clone())]
    torch_t = row("torch per-tensor", lambda: torch.fake_quantize_per_tensor_affine(x, 0.02, 0, QMIN, QMAX))
    torch_c = row("torch per-channel", lambda: torch.fake_quantize_per_channel_affine(x, scale_c, zp_c, 0, QMIN, QMAX))

    xr = x.detach().requires_grad_(True)
    y_t = torch.fake_quantize_per_tensor_affine(xr, 0.02, 0, QMIN, QMAX)
    y_c = torch.fake_quantize_per_channel_affine(xr, scale_c, zp_c, 0, QMIN, QMAX)
    torch_bwd = [
        row("torch per-tensor backward", lambda: torch.autograd.grad(y_t, xr, g, retain_graph=True)),
        row("torch per-channel backward", lambda: torch.autograd.grad(y_c, xr, g, retain_graph=True)),
    ]
    s_l = scale.clone().requires_grad_(True)
    z_l = offset.clone().requires_grad_(True)
    try:  # torch's LSQ op: the counterpart of fxq's scale/offset gradients
        y_l = torch._fake_quantize_learnable_per_tensor_affine(xr, s_l, z_l, QMIN, QMAX, 1.0)
        inputs = (xr, s_l, z_l)
        name = "torch learnable backward (x+s+zp)"
        torch_bwd.append(row(name, lambda: torch.autograd.grad(y_l, inputs, g, retain_graph=True)))
    except (AttributeError, RuntimeError) as exc:
        print(f"(no torch learnable fake-quant: {exc})")

    fused_note = ""
    if device == "cpu":
        with cpu_fusion(min_numel=0, warmup_seconds=0):
            before = fused_cpu_stats()
            fwd_t, fwd_c, bwd = fxq_rows("fused")
            after = fused_cpu_stats()
        fused_note = (
            f"fused CPU path: {int(after['compiles'] - before['compiles'])} graphs compiled in "
            f"{after['compile_seconds'] - before['compile_seconds']:.1f} s "
            "(once per process; inductor caches them on disk)"
        )
        if not args.no_eager:
            with cpu_fusion(enabled=False):
                e_t, e_c, e_b = fxq_rows("eager")
            fwd_t, fwd_c, bwd = fwd_t + e_t, fwd_c + e_c, bwd + e_b
    else:
        fwd_t, fwd_c, bwd = fxq_rows("triton")

    fwd_bytes, bwd_bytes = 2 * item * n, 3 * item * n
    _table("forward, per-tensor", fwd_t + [torch_t] + copy_rows, fwd_bytes, torch_t[0])
    _table("forward, per-channel", fwd_c + [torch_c] + copy_rows, fwd_bytes, torch_c[0])
    _table("backward (vs torch per-tensor backward)", bwd + torch_bwd + copy_rows, bwd_bytes, torch_bwd[0][0])
    if fused_note:
        print("\n" + fused_note)


if __name__ == "__main__":
    main()
