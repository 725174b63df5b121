#!/usr/bin/env bash
# fxq on a CUDA machine in one call (issue #16 point 6): the Triton kernels bit for bit and the end-to-end CUDA
# tests, then fake-quant throughput against a device copy, then the PTQ / QAT / inference / analysis ratios of the
# CPU benches with --device cuda. Run from the repository root:  bash bench/gpu.sh [STEPS...]
# Logs go to $OUT (default: a temp folder), one per step; the last lines of each are printed as it ends.
# Wheels a machine lacks (onnx2torch) can sit in .whl/ beside it; they are installed to a temp site first.
set -u
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" > /dev/null; then
    site=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:$site
fi
steps=${*:-tests overhead fake_quant ptq qat_eager inference_eager analysis qat_compiled inference_compiled}

step() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: rc=$? in $((SECONDS - t0)) s"
    tail -n 14 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
for s in $steps; do
    case $s in
    tests) step tests 150 env FXQ_TEST_TRITON_GPU=1 python3 -m pytest -q -p no:cacheprovider -n 8 \
        tests/test_triton_kernels.py tests/test_cuda.py ;;
    overhead) step overhead 90 python3 bench/cuda_overhead.py --device cuda ;;
    fake_quant) step fake_quant 60 python3 bench/fake_quant.py --device cuda --numel 67108864 --repeat 50 ;;
    ptq) step ptq 90 python3 bench/ptq.py --device cuda --sources native onnx --repeat 3 ;;
    qat_eager) step qat_eager 60 python3 bench/qat_step.py --device cuda --modes eager --size 224 --batch-size 32 \
        --warmup 3 --steps 20 ;;
    inference_eager) step inference_eager 90 python3 bench/inference.py --device cuda --modes eager --warmup 2 \
        --steps 20 --repeat 3 ;;
    analysis) step analysis 120 python3 bench/analysis.py --device cuda --paths native onnx --rounds 3 --threads 8 ;;
    analysis_native) step analysis_native 90 python3 bench/analysis.py --device cuda --paths native --rounds 2 \
        --threads 8 ;;
    qat_compiled) step qat_compiled 200 python3 bench/qat_step.py --device cuda --models resnet18 --size 224 \
        --batch-size 32 --warmup 3 --steps 20 ;;
    inference_compiled) step inference_compiled 200 python3 bench/inference.py --device cuda --models resnet18 \
        mobilenet_v2 --warmup 3 --steps 20 --repeat 3 ;;
    inference_cudagraphs) step inference_cudagraphs 200 python3 bench/inference.py --device cuda --models resnet18 \
        mobilenet_v2 --modes compiled --compile-mode reduce-overhead --warmup 3 --steps 20 --repeat 3 ;;
    inference_frozen) step inference_frozen 200 python3 bench/inference.py --device cuda --models resnet18 \
        mobilenet_v2 --modes compiled --compile-mode reduce-overhead --freezing --warmup 3 --steps 20 --repeat 3 ;;
    *) echo "unknown step $s" ;;
    esac
done
