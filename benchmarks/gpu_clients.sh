#!/usr/bin/env bash
# Issue 17 GPU figures (device tool, nvidia-h100-x1): GRPO rollout time per step, 64 prompts x 8 generations x 256
# tokens, llama-1b-shaped random model in bf16 (no downloads): hf_paged vs transformers generate (DynamicCache) vs
# transformers' generate_batch (TRL's use_transformers_continuous_batching=True path). ~6 min.
# The bench calls model.generate / generate_batch exactly as TRL does; trl itself is not needed on the GPU machine.
# Usage there: bash benchmarks/gpu_clients.sh "$OUT"
set -u
OUT=${1:?usage: gpu_clients.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/env.txt" 2>&1
timeout 560 python3 benchmarks/bench_grpo_rollouts.py --model llama-1b --dtype bfloat16 --prompts 64 \
    --generations 8 --new-tokens 256 --steps 2 --out "$OUT" > "$OUT/grpo_rollouts.log" 2>&1
echo "rc=$?" >> "$OUT/grpo_rollouts.log"
tail -8 "$OUT/grpo_rollouts.log"
