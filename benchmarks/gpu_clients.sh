#!/usr/bin/env bash
# Issue 17 GPU figures (device tool, nvidia-h100-x1), on llama-1b-shaped random models in bf16 (no downloads):
#  1. lm-eval generate_until: 400 requests as the `hf` backend batches them (batch 64) vs the same with
#     cache_implementation="paged" vs the `hf-paged` backend (benchmarks/bench_lm_eval.py; needs SmolLM2's tokenizer
#     in .wheels/smollm2-tokenizer, see gpu_serve.sh; carry .wheels). ~2.5 min.
#  2. GRPO rollout time per step, 64 prompts x 8 generations x 256 tokens: hf_paged vs transformers generate
#     (DynamicCache) vs transformers' generate_batch (TRL's use_transformers_continuous_batching=True path). ~3 min
#     at STEPS=1. The bench calls model.generate / generate_batch exactly as TRL does; trl is not needed there.
# Usage there: bash benchmarks/gpu_clients.sh "$OUT"      (STEPS=..., REQUESTS=... override the defaults)
set -u
OUT=${1:?usage: gpu_clients.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/env.txt" 2>&1
if [ -d .wheels/smollm2-tokenizer ]; then
  timeout 240 python3 benchmarks/bench_lm_eval.py --tokenizer .wheels/smollm2-tokenizer --requests "${REQUESTS:-400}" \
      --out "$OUT" > "$OUT/lm_eval.log" 2>&1
  echo "rc=$?" >> "$OUT/lm_eval.log"
  tail -8 "$OUT/lm_eval.log"
fi
timeout 330 python3 benchmarks/bench_grpo_rollouts.py --model llama-1b --dtype bfloat16 --prompts 64 \
    --generations 8 --new-tokens 256 --steps "${STEPS:-1}" --out "$OUT" > "$OUT/grpo_rollouts.log" 2>&1
echo "rc=$?" >> "$OUT/grpo_rollouts.log"
tail -9 "$OUT/grpo_rollouts.log"
