"""Quantization-aware training of a torchvision model, compiled, then converted and exported for TensorRT.

    python examples/qat_torchvision.py [--fast] [--model resnet18] [--backend inductor] [--out qat_out]

The model starts from random weights and learns a synthetic task (the class of an image is the position
of its brightest quadrant and channel), so the example runs anywhere without downloads. Steps:

1. estimate BatchNorm statistics on a few batches (what a pretrained model would bring);
2. ``fxq.prepare_qat``: fold BatchNorm, insert TensorRT INT8 quantizers, initialize their scales, make the
   scales learnable (LSQ);
3. train with ``torch.optim.SGD`` on ``torch.compile(qat_model)``;
4. ``fxq.convert`` and ``fxq.export(model, "trt_int8", path)`` (ONNX with Q/DQ for TensorRT).

``--backend aot_eager`` compiles without code generation (fast; what the test uses), ``none`` runs eagerly.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision

import fxq


def synthetic_batch(n: int, size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Images with one bright quadrant in one channel; label = 4 * channel + quadrant (12 classes)."""
    x = torch.randn(n, 3, size, size, generator=gen) * 0.5
    y = torch.randint(0, 12, (n,), generator=gen)
    h = size // 2
    for i, label in enumerate(y.tolist()):
        c, q = divmod(label, 4)
        r0, c0 = (q // 2) * h, (q % 2) * h
        x[i, c, r0:r0 + h, c0:c0 + h] += 1.5
    return x, y


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fast", action="store_true", help="tiny images, a few steps")
    parser.add_argument("--model", default="resnet18", help="torchvision model name")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend, or 'none'")
    parser.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    parser.add_argument("--lr", type=float, default=2e-3, help="SGD learning rate (BatchNorm is folded: keep it low)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 4 with --fast, else 100)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    size, batch, steps = (32, 8, 4) if args.fast else (64, 32, 100)
    steps = args.steps or steps
    model = getattr(torchvision.models, args.model)(num_classes=12)

    # 1. BatchNorm statistics from data (cumulative average), as a pretrained model would have them
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.momentum = None
    model.train()
    with torch.no_grad():
        for _ in range(4):
            model(synthetic_batch(batch, size, gen)[0])
    model.eval()

    # 2. QAT model: TensorRT INT8 quantizers with learnable (LSQ) scales
    calib = [synthetic_batch(batch, size, gen)[0] for _ in range(2)]
    qat = fxq.prepare_qat(model, "trt_int8", calib_data=calib, method="lsq")

    # 3. an ordinary training loop on the compiled model
    step_fn = qat if args.backend == "none" else torch.compile(qat, backend=args.backend)
    opt = torch.optim.SGD(qat.parameters(), lr=args.lr, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(batch, size, gen)
        loss = F.cross_entropy(step_fn(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())  # no host sync per step; read them when printing
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {losses[-1].item():.4f}", flush=True)

    # 4. fixed scales, baked weights, export
    qmodel = fxq.convert(qat.eval())
    x, y = synthetic_batch(256 if not args.fast else 32, size, gen)
    with torch.no_grad():
        acc = float((qmodel(x).argmax(1) == y).float().mean())
    print(f"quantized model accuracy on fresh synthetic data: {acc:.1%}")

    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fxq_qat_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    written = list(fxq.export(qmodel, "trt_int8", out_dir / f"{args.model}_qat"))
    print("exported for TensorRT:", ", ".join(str(p) for p in written))
    return {"losses": [float(v) for v in losses], "accuracy": acc, "written": written}


if __name__ == "__main__":
    main()
