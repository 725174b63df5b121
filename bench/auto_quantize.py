"""Accuracy-budgeted precision search: the verified search against greedy worst-first on trained models.

    python bench/auto_quantize.py [--fast] [--size 32] [--threads N] [--platforms trt_int8,ncnn_int8]

Three conformance models are trained here on scikit-learn's digits (the CNN of ``bench/accuracy.py`` and the small
ResNet and ViT of ``bench/deployed_fidelity.py``). For each model and platform the all-INT8 output SNR ``e`` is
measured, and :func:`fxq.auto_quantize` is asked for ``e × {0.75, 0.5, 0.25, 0.1}`` with ``strategy="greedy"`` (worst
layerwise error first, the field's baseline) and ``strategy="verified"`` (fxq's default). Printed per budget: the
float layers each strategy needed, whether it met the budget, the configurations it measured and its wall time.
The goal: the verified search never needs more float layers than greedy, and fewer on some.
"""
from __future__ import annotations

import argparse
import logging
import platform as platform_mod
import sys
import time
from pathlib import Path

import torch

import fxq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy import load_digits  # noqa: E402
from deployed_fidelity import trained_model  # noqa: E402

FACTORS = (0.75, 0.5, 0.25, 0.1)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fast", action="store_true", help="one model, one platform, two budgets (smoke run)")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="cnn,resnet,vit")
    parser.add_argument("--platforms", default="trt_int8,ncnn_int8")
    args = parser.parse_args(argv)
    logging.getLogger("fxq").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    x_train, y_train, _, _ = load_digits(args.size, seed=0)
    models = ["cnn"] if args.fast else args.models.split(",")
    platforms = args.platforms.split(",")[:1] if args.fast else args.platforms.split(",")
    factors = FACTORS[:2] if args.fast else FACTORS
    calib = [x_train[i:i + 32] for i in range(0, 256, 32)]
    rows: list[dict] = []
    for name in models:
        model = trained_model(name, args.size, x_train, y_train, 1 if args.fast else 10)
        for plat in platforms:
            base = fxq.quantize(model, calib, plat, progress=False)
            e = fxq.graphwise_error_analyse(base, calib, steps=None).outputs[0].value
            for factor in factors:
                row: dict = {"model": name, "platform": plat, "int8": e, "target": e * factor}
                for strategy in ("greedy", "verified"):
                    t0 = time.perf_counter()
                    _, rep = fxq.auto_quantize(model, calib, plat, e * factor, strategy=strategy, steps=None,
                                               eval_steps=None)
                    row[strategy] = {"fallbacks": len(rep.fallbacks), "met": rep.met, "value": rep.final_value,
                                     "evaluations": rep.evaluations, "seconds": time.perf_counter() - t0}
                row["layers"] = rep.layers
                rows.append(row)
    print(f"# {time.strftime('%Y-%m-%d')} — {platform_mod.processor() or platform_mod.machine()}, "
          f"torch {torch.__version__}, digits {args.size}x{args.size}, {len(calib)} batches of 32, "
          f"{'fast' if args.fast else 'full'} training")
    print("| model | platform | layers | all-INT8 SNR | target | greedy: float layers (met, evals, s) | "
          "verified: float layers (met, evals, s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[s]['fallbacks']} ({'met' if r[s]['met'] else 'NOT met'}, {r[s]['evaluations']}, "
                 f"{r[s]['seconds']:.1f})" for s in ("greedy", "verified")]
        print(f"| {r['model']} | {r['platform']} | {r['layers']} | {r['int8']:.4%} | {r['target']:.4%} | "
              f"{cells[0]} | {cells[1]} |")
    both = [r for r in rows if r["verified"]["met"] and r["greedy"]["met"]]  # fewer layers that miss is no win
    fewer = sum(r["verified"]["fallbacks"] < r["greedy"]["fallbacks"] for r in both)
    more = sum(r["verified"]["fallbacks"] > r["greedy"]["fallbacks"] for r in both)
    missed = {s: sum(not r[s]["met"] for r in rows) for s in ("greedy", "verified")}
    print(f"verified needs fewer float layers than greedy on {fewer} of {len(both)} budgets both meet, more on "
          f"{more}; budgets missed: greedy {missed['greedy']}, verified {missed['verified']}")
    return rows


if __name__ == "__main__":
    main()
