"""Peak memory of quantizing and exporting, as multiples of the model's FP32 weights (Linux only).

    python bench/export_memory.py                                   # resnet152 and vit_l_16, trt_int8 and ort_int8
    python bench/export_memory.py --models resnet50 --platforms trt_int8,ncnn_int8 --size 64
    python bench/export_memory.py --models mlp --json     # 6 x Linear(2048): 96 MiB, tests/test_export_memory.py

Each model x platform runs in its own subprocess. A stage's peak is the process's resident high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs`` before the stage) minus its resident size when the stage began,
so it counts what the stage allocates on top of what is already held (the user's model; for ``export``, the
quantized model too). Large allocations are made with ``mmap`` (``MALLOC_MMAP_THRESHOLD_``) so freed weights leave
the resident size at once and the peaks measure live memory, not the allocator's leftovers.

What a stage must hold at least: ``quantize`` a copy of the weights (the user's model is left as it was) and their
FP32 backups (baked weights, restorable): 2x; ``export`` the ONNX model being built (1x) and, while it is written,
its serialized bytes (1x more, 2x inside protobuf's serializer).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import json, os, sys, tempfile
import torch
import fxq

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024

def peak_over(fn):
    start = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out = fn()
    return out, status("VmHWM") - start

name, platform, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
if name == "mlp":  # no convolutions: the export's own copies dominate, nothing of torchvision is imported
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)]).eval()
    x = torch.randn(4, 2048)
else:
    import torchvision
    model = getattr(torchvision.models, name)().eval()
    x = torch.randn(1, 3, size, size)
weights = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
q, q_peak = peak_over(lambda: fxq.quantize(model, [(x,), (x + 0.1,)], platform=platform, progress=False))
with tempfile.TemporaryDirectory() as d:
    files, e_peak = peak_over(lambda: fxq.export(q, platform, os.path.join(d, "m.onnx")))
    written = sum(os.path.getsize(f) for f in files) / 2**20
print(json.dumps({"model": name, "platform": platform, "weights_mib": round(weights),
                  "quantize_x": round(q_peak / weights, 2), "export_x": round(e_peak / weights, 2),
                  "files_mib": round(written)}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet152,vit_l_16")
    ap.add_argument("--platforms", default="trt_int8,ort_int8")
    ap.add_argument("--size", type=int, default=0, help="input side (default: 224 for ViTs, 64 otherwise)")
    ap.add_argument("--json", action="store_true", help="one JSON object per model x platform, not a table")
    args = ap.parse_args(argv)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # freed tensors leave at once: live memory is measured
    if not args.json:
        print("| model | platform | FP32 weights MiB | quantize peak / weights | export peak / weights | files MiB |")
        print("|---|---|---:|---:|---:|---:|")
    for name in args.models.split(","):
        size = args.size or (224 if name.startswith(("vit_", "swin_", "maxvit")) else 64)
        for platform in args.platforms.split(","):
            proc = subprocess.run([sys.executable, "-c", _CHILD, name, platform, str(size)], capture_output=True,
                                  text=True, env=env)
            if proc.returncode != 0:
                error = proc.stderr.strip()[-3000:]
                print(json.dumps({"model": name, "platform": platform, "error": error}) if args.json else
                      f"| {name} | {platform} | failed: {error.splitlines()[-1:]} |||", flush=True)
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            print(json.dumps(r) if args.json else f"| {name} | {platform} | {r['weights_mib']} | {r['quantize_x']} | "
                  f"{r['export_x']} | {r['files_mib']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
