"""Host time of one fake-quant call on CUDA, layer by layer of its call path, on a small activation.

    python bench/cuda_overhead.py [--calls 2000] [--device cuda|cpu]

A quantized CNN at batch 1 on a GPU is launch-bound: each kernel takes microseconds, and what the host spends
issuing it decides the speed. This times, per call (host loop of ``--calls`` calls, one synchronize at the end),
each layer of the path an activation quantizer takes in ``fxq.quantize``'s model, from the ``FakeQuantize``
module down to the bare Triton launch, beside one plain torch elementwise op and torch's own fake-quant; with no
grad (inference) and with a learnable scale (QAT, forward + backward). It also counts the host-device
synchronizations of one quantized ResNet-18 forward (``torch.cuda.set_sync_debug_mode``).
"""
from __future__ import annotations

import argparse
import contextlib
import time
import warnings
from typing import Callable

import torch
import torchvision
from _host import add_device_argument, synchronize

import fxq
from fxq import functional, ops
from fxq.triton_kernels import linear as LK

_DEVICE = "cuda"


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(20):
        fn()
    synchronize(_DEVICE)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(_DEVICE)
    return (time.perf_counter() - t0) / calls * 1e6


@contextlib.contextmanager
def without_bindings():
    """Every quantizer call through ``fxq.fake_quantize``'s full path: no bound calls (what came before them)."""
    bind, saved = ops.bind, dict(functional._BOUND)
    ops.bind = lambda *args: None
    functional._BOUND.clear()
    try:
        yield
    finally:
        ops.bind = bind
        functional._BOUND.update(saved)


def main(argv: list[str] | None = None) -> None:
    global _DEVICE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    add_device_argument(parser)
    parser.set_defaults(device="cuda")
    args = parser.parse_args(argv)
    _DEVICE = dev = args.device
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval().to(dev)
    calib = [torch.randn(8, 3, 224, 224, device=dev) for _ in range(2)]
    gm = fxq.quantize(model, calib, "trt_int8", progress=False)
    quantizers = [m for m in gm.modules() if isinstance(m, fxq.FakeQuantize)]
    seen: dict[str, torch.Tensor] = {}
    acts = [m for m in quantizers if m.param is None and m.quant_enabled and not m.config.per_channel]
    fq = acts[1]
    handle = fq.register_forward_pre_hook(lambda mod, inp: seen.setdefault("x", inp[0].detach().clone()))
    x1 = torch.randn(1, 3, 224, 224, device=dev)
    with torch.no_grad():
        gm(x1)
    handle.remove()
    x = seen["x"].contiguous()
    cfg = fq.config
    scale, offset = fq.scale, fq.offset
    qargs = (0, int(cfg.quant_min), int(cfg.quant_max), int(cfg.rounding))
    layout = LK.linear_layout(x, scale, offset, 0, int(cfg.quant_min), int(cfg.quant_max))
    s = scale.detach().reshape(-1).contiguous()
    o = offset.detach().reshape(-1).contiguous()
    y = torch.empty_like(x)

    def raw_launch() -> None:
        LK._linear_fwd_kernel[LK.grid(x.numel())](
            x, s, o, y, x.numel(), 1, 1, qargs[1], qargs[2], ROUNDING=qargs[3], PER_CHANNEL=False,
            IS_FP64=False, NARROW=False, BLOCK=LK.BLOCK, num_warps=LK.NUM_WARPS, enable_fp_fusion=False)

    rows = [
        ("x.mul(1.0)  (one torch launch)", lambda: x.mul(1.0)),
        ("torch.fake_quantize_per_tensor_affine", lambda: torch.fake_quantize_per_tensor_affine(x, 0.02, 0, -128, 127)),
        ("FakeQuantize module  fq(x)", lambda: fq(x)),
        ("fxq.fake_quantize(x, cfg, s, o)", lambda: fxq.fake_quantize(x, cfg, scale, offset)),
        ("torch.ops.fxq.fake_quant_linear", lambda: torch.ops.fxq.fake_quant_linear(x, scale, offset, *qargs)),
        ("fake_quant_linear_triton (op impl)", lambda: LK.fake_quant_linear_triton(x, scale, offset, *qargs)),
        ("linear_forward(layout=...)", lambda: LK.linear_forward(x, scale, offset, *qargs, layout=layout)),
        ("bare Triton launch", raw_launch),
    ]
    print(f"{torch.cuda.get_device_name() if dev == 'cuda' else 'CPU'}, torch {torch.__version__}; activation {tuple(x.shape)}, "
          f"{len(quantizers)} quantizers in the model")
    print("\nno grad (inference): host us per call")
    with torch.no_grad():
        for name, fn in rows:
            print(f"  {name:40s} {per_call_us(fn, args.calls):8.1f}")
        with without_bindings():
            print(f"  {'FakeQuantize module, no bound call':40s} {per_call_us(lambda: fq(x), args.calls):8.1f}")
        fq(x)
        bound = functional._BOUND.get(cfg)
        if bound is not None:
            print(f"  {'its bound call  run(x, params, tag)':40s} "
                  f"{per_call_us(lambda: bound.run(x, (scale, offset), functional._call_tag(cfg)), args.calls):8.1f}"
                  f"  ({type(bound).__name__}{'' if getattr(bound, 'runner', 1) is not None else ', Triton launch'})")

    print("\nlearnable scale (QAT): forward + backward, host us per call")
    xs = x.clone().requires_grad_(True)
    ls = scale.detach().clone().requires_grad_(True)
    lo = offset.detach().clone()
    g = torch.randn_like(x)

    def fxq_step() -> None:
        torch.autograd.grad(torch.ops.fxq.fake_quant_linear(xs, ls, lo, *qargs), (xs, ls), g)

    def torch_step() -> None:
        out = torch._fake_quantize_learnable_per_tensor_affine(xs, ls, lo, -128, 127, 1.0)
        torch.autograd.grad(out, (xs, ls), g)

    def mul_step() -> None:
        torch.autograd.grad(xs * ls, (xs, ls), g)

    for name, fn in (("x * s  (torch, autograd)", mul_step), ("torch learnable fake-quant", torch_step),
                     ("torch.ops.fxq.fake_quant_linear", fxq_step)):
        print(f"  {name:40s} {per_call_us(fn, args.calls // 4):8.1f}")

    print("\nwhole model, batch 1, no grad: ms per forward")
    with torch.no_grad():
        print(f"  fp32 resnet18  {per_call_us(lambda: model(x1), 100) / 1e3:8.2f}")
        print(f"  fxq  resnet18  {per_call_us(lambda: gm(x1), 100) / 1e3:8.2f}")
        with without_bindings():
            print(f"  fxq  no bound  {per_call_us(lambda: gm(x1), 100) / 1e3:8.2f}")
        with fxq.fp32_mode(gm):
            print(f"  fxq  fp32_mode {per_call_us(lambda: gm(x1), 100) / 1e3:8.2f}")
    if dev != "cuda":
        return
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        gm(x1)
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    print(f"\nhost-device synchronizations in one quantized forward: {len(syncs)}")
    for line in syncs[:5]:
        print("  ", line)


if __name__ == "__main__":
    main()
