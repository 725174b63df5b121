"""Find where quantization error comes from: graphwise / layerwise analysis, statistics and an HTML report.

Calibration data is read from a folder of ``.npy`` batches (written here from random data), as in the
seeds' usage tutorial.

    python examples/analyse_errors.py [--fast] [--out fxq_report]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
import torchvision

import fxq


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fast", action="store_true", help="small inputs and few batches (for tests)")
    parser.add_argument("--out", default="fxq_report", help="report folder")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()  # seeded random weights, no download
    size, batches, batch = (32, 2, 2) if args.fast else (224, 8, 8)
    steps = 1 if args.fast else 8
    with tempfile.TemporaryDirectory() as folder:
        rng = np.random.default_rng(0)
        for i in range(batches):
            np.save(Path(folder) / f"batch{i}.npy", rng.standard_normal((batch, 3, size, size)).astype(np.float32))
        calib = fxq.load_calibration_folder(folder, input_shape=[1, 3, size, size])
        qmodel = fxq.quantize(model, calib, platform="trt_int8")

        # error accumulated through the quantized graph (one FP32 + one quantized pass per batch)
        graphwise = fxq.graphwise_error_analyse(qmodel, calib, method="snr", steps=steps)
        print(graphwise.table(limit=8))
        # each layer alone, measured at the network output (PPQ's layerwise)
        layerwise = fxq.layerwise_error_analyse(qmodel, calib, method="snr", steps=steps)
        print(layerwise.table(limit=8))
        # FP32 vs quantized value statistics of the worst layer's output
        stats = fxq.statistics(qmodel, calib, steps=steps)
        worst = graphwise[0].name
        out_q = next(n for n in qmodel.graph.nodes if n.name == worst).meta["fxq"].output
        print(f"worst layer {worst}: output quantizer {out_q}, clipped "
              f"{stats.by_name(out_q).clipped:.4%} of the FP32 values")
        page = fxq.write_report(qmodel, calib, args.out, steps=steps, top_k=3)
    print(f"report: {page}")
    return {"graphwise": graphwise, "layerwise": layerwise, "statistics": stats, "report": page}


if __name__ == "__main__":
    main()
