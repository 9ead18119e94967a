#!/usr/bin/env bash
# The GPU checks, for a session lent a device machine (one NVIDIA GPU, its image's python3 with
# torch, triton and transformers; no network). Run from the repo root:
#
#     bash tools/bench/gpu_check.sh            # all steps, a log of each under $OUT (or /tmp/gpu_check)
#     bash tools/bench/gpu_check.sh kernels    # only the named steps: kernels, model, offline, batch
#
# Wheels the image lacks (msgspec, starlette, uvicorn, llguidance, pytest-asyncio) are carried in
# .whl/ (see the device README for how to download them for the machine's Python). Every step has
# its own time limit, so one that hangs leaves the rest their time.
#   kernels: the Triton kernels against the torch backend (SDPA) compiled on the GPU, fp32/bf16/
#            fp16, and the demo model through both backends against HF greedy
#   model:   a random Llama of about 1.1B parameters (Llama-3.2-1B's shape, 32k vocabulary), bf16
#   offline: the library API (the actor processes and rings) against HF generate, same GPU,
#            for each kernel backend in GPU_CHECK_BACKENDS (default "triton torch")
#   batch:   the raw model's static batches for each backend; beside the first, HF generate and
#            the decode step through the whole actor system
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_check}
MODEL=${GPU_CHECK_MODEL:-/tmp/llama-1b-random}
KV_BYTES=$((8 << 30))
STEPS=${*:-kernels model offline batch}
BACKENDS=${GPU_CHECK_BACKENDS:-triton torch}  # kernel backends the benchmarks run, first in full
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi

step() {  # step NAME SECONDS COMMAND...: run it under a limit, its output to the screen and a log
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s) $(date +%T)"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "== $name exit ${PIPESTATUS[0]} $(date +%T)"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, triton, transformers as t; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformers', t.__version__, torch.cuda.get_device_name())"

for name in $STEPS; do
    case $name in
    kernels)
        ENGINE_TEST_DEVICE=cuda step kernels 150 python3 -m pytest -q -p no:cacheprovider \
            --tb=short tests/unit/test_triton_kernels.py ;;
    model)
        [ -f "$MODEL/config.json" ] || step model 120 python3 tools/data/make_model.py --out "$MODEL" \
            --arch llama --layers 16 --hidden 2048 --heads 32 --kv-heads 8 --intermediate 8192 \
            --vocab 32000 --dtype bfloat16 ;;
    offline)
        for backend in $BACKENDS; do
            step "offline_$backend" 150 python3 tools/bench/offline.py --model "$MODEL" \
                --device cuda --dtype bfloat16 --kernel-backend "$backend" --num-requests 256 \
                --input-len 256 --output-len 128 --range-ratio 0.5 --peer hf --hf-batch-size 64 \
                --kv-cache-memory $KV_BYTES
        done ;;
    batch)
        extra=(--compare-hf)  # HF and the actor system once, beside the first backend
        for backend in $BACKENDS; do
            step "batch_$backend" 180 python3 tools/bench/one_batch.py --model "$MODEL" \
                --device cuda --dtype bfloat16 --kernel-backend "$backend" \
                --batch-size 1 32 128 --input-len 512 --output-len 128 \
                --kv-cache-memory $KV_BYTES "${extra[@]}"
            extra=(--no-engine-overhead)
        done ;;
    *) echo "unknown step $name (kernels, model, offline, batch)"; exit 2 ;;
    esac
done
