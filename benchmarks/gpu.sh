#!/usr/bin/env bash
# The GPU run, as one prepared script under 8 minutes; each part has its own timeout and a part
# that fails or runs out of time does not stop the others (their logs go to $OUT/gpu_*.txt):
#   tests       the CUDA test subset (the tests that load models, attention, graphs)   150 s
#   throughput  nano-vllm's workload (256 requests, input and output lengths uniform in
#               100-1024, seed 0, temperature 0.6, ignore_eos) on Qwen3-0.6B-shaped random
#               bf16 weights: output tok/s                                              120 s
#   steps       the median decode step at 256 / 64 / 1 sequences, and where a 256-sequence
#               step's time goes (torch.profiler, top ops)                               75 s
#   hf          HF transformers' generate on a slice of the workload, for a ratio        60 s
# Run from the repository root on a machine with a CUDA GPU:  bash benchmarks/gpu.sh
# One part only:  bash benchmarks/gpu.sh tests|throughput|steps|hf  (--tests: tests)
set -uo pipefail
cd "$(dirname "$0")/.."
# the project's venv where `make install` made one, else the machine's python3 (a GPU machine's
# image with torch for CUDA)
PY=${PY:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-benchmarks/results}
PARTS=${1:-tests throughput steps hf}
[[ $PARTS == --tests ]] && PARTS=tests  # the older spelling
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
declare -A LIMIT=([tests]=150 [throughput]=120 [steps]=75 [hf]=60)
declare -A RESULT

run_tests() {
    # -n: pytest-xdist where installed, one CUDA context a worker
    XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8" || true)
    "$PY" -m pytest -q $XDIST -m "not slow and not scale and not default_model" -rfE \
        tests/models tests/e2e tests/engine/test_weight_policy.py tests/engine/test_memory.py \
        tests/engine/test_cuda_graphs.py tests/engine/test_gpu_memory.py \
        tests/layers/test_attention_backends.py tests/layers/test_triton_attention.py \
        tests/layers/test_layers.py tests/layers/test_sampler.py \
        tests/layers/test_rejection_sampler.py tests/layers/test_family_layers.py
}

run_part() {
    local part=$1 start=$SECONDS
    echo "=== $part (at most ${LIMIT[$part]} s)"
    if [[ $part == tests ]]; then
        export -f run_tests
        export PY
        timeout -k 10 "${LIMIT[$part]}" bash -c run_tests 2>&1 | tee "$OUT/gpu_$part.txt"
    else
        timeout -k 10 "${LIMIT[$part]}" "$PY" benchmarks/gpu_bench.py "$part" "$MODEL" 2>&1 \
            | grep --line-buffered -v "Warning\|warn(" | tee "$OUT/gpu_$part.txt"
    fi
    local rc=${PIPESTATUS[0]}
    RESULT[$part]="exit $rc$([[ $rc == 124 || $rc == 137 ]] && echo ' (timed out)'), $((SECONDS - start)) s"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/gpu.txt"
if [[ $PARTS != tests ]]; then
    MODEL=$(mktemp -d)/qwen3-0.6b
    timeout 45 "$PY" benchmarks/make_random_model.py qwen3-0.6b "$MODEL" --dtype bfloat16
fi
for part in $PARTS; do
    run_part "$part"
done
echo "=== summary"
for part in $PARTS; do
    echo "$part: ${RESULT[$part]}"
done
grep -h "throughput:\|decode step,\|HF generate" "$OUT"/gpu_*.txt 2>/dev/null || true
