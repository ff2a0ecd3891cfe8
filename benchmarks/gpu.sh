#!/usr/bin/env bash
# The GPU benchmark, as one prepared script: nano-vllm's throughput workload at GPU scale
# (256 requests, input and output lengths uniform in 100-1024, ignore_eos, temperature 0.6)
# on CUDA with Qwen3-0.6B-shaped random bf16 weights, and HF transformers on the same machine.
# Run from the repository root on a machine with a CUDA GPU:  bash benchmarks/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
MODEL=$(mktemp -d)/qwen3-0.6b
"$PY" benchmarks/make_random_model.py qwen3-0.6b "$MODEL" --dtype bfloat16
"$PY" -m minivllm.cli bench throughput --model "$MODEL" --device cuda --dtype bfloat16 \
    --gpu-scale --max-num-seqs 256 --max-num-batched-tokens 16384 --max-model-len 4096 \
    --compare hf --output "$OUT/gpu_throughput.json" --chart "$OUT/gpu_throughput.png"
