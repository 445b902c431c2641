#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs (device tool, nvidia-h200-x2): the TP tests over NCCL, then llama-8b on a KV-bound
# workload on 1 GPU and on 2 (torchrun), with CUDA graphs and the compiled decode step under TP.
# Usage there: bash benchmarks/run_tp.sh "$OUT" tests bench
set -u
OUT=${1:?usage: run_tp.sh OUT_DIR PART...}
shift
RES=$(mktemp -d)
mkdir -p "$OUT"
# NVLink multicast stays off on these machines (KINDS.md): a program using it can take the host's GPUs down
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
PY=python3
stamp() { echo "== $(date +%T) $*"; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
} > "$OUT/env.txt" 2>&1
W="--model llama-8b --workload kvbound --num-requests ${TP_REQUESTS:-384} --max-num-seqs 512 --no-progress --out $RES"
for part in "$@"; do
  stamp "$part"
  case "$part" in
    tests) timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py > "$OUT/tests.log" 2>&1 ;;
    one) CUDA_VISIBLE_DEVICES=0 timeout 300 $PY benchmarks/bench_generate.py $W --systems paged \
        > "$OUT/one.log" 2>&1 ;;
    two) timeout 420 $PY -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_generate.py $W \
        --systems paged,paged_compiled --cuda-graph > "$OUT/two.log" 2>&1 ;;
    *) echo "unknown part $part (tests, one, two)"; continue ;;
  esac
  echo "exit $?"
  tail -n 25 "$OUT/$part.log" 2>/dev/null
done
tar czf "$OUT/results.tgz" -C "$RES" .
stamp done
