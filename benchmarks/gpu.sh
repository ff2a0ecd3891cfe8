#!/usr/bin/env bash
# The GPU benchmark, as one prepared script: nano-vllm's throughput workload at GPU scale
# (256 requests, input and output lengths uniform in 100-1024, ignore_eos, temperature 0.6)
# on CUDA with Qwen3-0.6B-shaped random bf16 weights, and HF transformers on the same machine.
# Run from the repository root on a machine with a CUDA GPU:  bash benchmarks/gpu.sh
# The tests that load models, on CUDA (the engine's default device where torch sees one):
#   bash benchmarks/gpu.sh --tests
set -euo pipefail
cd "$(dirname "$0")/.."
# the project's venv where `make install` made one, else the machine's python3 (a GPU machine's
# image with torch for CUDA)
PY=${PY:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
if [[ "${1:-}" == "--tests" ]]; then
    # -n: pytest-xdist where installed, one CUDA context a worker
    XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8" || true)
    exec "$PY" -m pytest -q $XDIST -m "not slow and not scale and not default_model" -rfE \
        tests/models tests/e2e tests/engine/test_weight_policy.py tests/engine/test_memory.py \
        tests/layers/test_attention_backends.py tests/layers/test_layers.py \
        tests/layers/test_sampler.py tests/layers/test_rejection_sampler.py \
        tests/layers/test_family_layers.py
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
MODEL=$(mktemp -d)/qwen3-0.6b
"$PY" benchmarks/make_random_model.py qwen3-0.6b "$MODEL" --dtype bfloat16
"$PY" -m minivllm.cli bench throughput --model "$MODEL" --device cuda --dtype bfloat16 \
    --gpu-scale --max-num-seqs 256 --max-num-batched-tokens 16384 --max-model-len 4096 \
    --compare hf --output "$OUT/gpu_throughput.json" --chart "$OUT/gpu_throughput.png"
