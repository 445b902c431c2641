#!/usr/bin/env bash
# The set-up the GPU runners share (sourced by gpu_shapes.sh, gpu_hybrid.sh, gpu_perf3.sh): OUT made, the environment
# exported, the wheels under .whl/ (fla-core, einops, ...) installed into /tmp/site when there, and the versions
# printed. Usage: source benchmarks/gpu_env.sh OUT_DIR
: "${1:?usage: gpu_env.sh OUT_DIR (sourced by the gpu_*.sh runners)}"
mkdir -p "$1"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
PY=python3
$PY -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())'
