#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs (device tool, nvidia-h200-x2 / nvidia-h100-x2): the TP tests over NCCL, then the
# llama-8b shape on 1 GPU and on 2 (torchrun), with CUDA graphs and the compiled decode step under TP.
#
# Usage there: bash benchmarks/run_tp.sh "$OUT" PART...   PART: tests, one, two, two_eager, long1, long2
#   tests      tests/test_tensor_parallel.py over NCCL, its cases side by side (each launches 1 + 2 processes)
#   one        GPU 0 alone, `paged_compiled` (CUDA graphs: the default) on the KV-bound workload
#   two        both GPUs, the same workload: `paged_compiled` (the default: compiled step, CUDA graphs), then `paged`
#              (the model's own code, CUDA graphs)
#   two_eager  both GPUs, `paged --no-cuda-graph`: TP's default before it was measured (no graphs, model code eager)
#   long1/2    the ~100k-token-context workload on 1 / 2 GPUs (`paged_compiled`)
# The KV-bound workload has more tokens than one GPU's pool holds: 384 requests on 80 GB cards, 512 on larger ones
# (TP_REQUESTS overrides); the long-context one LONG_REQUESTS (default 8). The llama-8b checkpoint the TP runs load
# is built on GPU 1 in the background while the tests run.
set -u
DEST=${1:?usage: run_tp.sh OUT_DIR PART...}
shift
OUT=$(mktemp -d)  # logs and JSON, packed into DEST/tp.tgz at the end (few files travel back best)
mkdir -p "$DEST"
# NVLink multicast stays off on these machines (KINDS.md): a program using it can take the host's GPUs down
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
PY=python3
stamp() { echo "== $(date +%T) $*"; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
  echo "tree: ${TREE:-not given} (git metadata on the device does not follow the tree sent)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
MEM_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${MEM_MIB:-0}" -gt 100000 ]; then N=${TP_REQUESTS:-512}; else N=${TP_REQUESTS:-384}; fi
KV="--model llama-8b --workload kvbound --num-requests $N --max-num-seqs 512 --no-progress"
LONG="--model llama-8b --workload longctx --num-requests ${LONG_REQUESTS:-8} --max-num-seqs 64 --no-progress"
TORCHRUN="$PY -m torch.distributed.run --standalone --nproc-per-node 2"
CKPT_PID=""
for part in "$@"; do
  stamp "$part"
  RES="$OUT/json/$part"  # a folder per part: two runs of one workload write the same file names
  case "$part" in
    tests)
      CUDA_VISIBLE_DEVICES=1 $PY -c "import sys; sys.path.insert(0, 'benchmarks'); import torch, bench_generate as b
print(b.shape_checkpoint('llama-8b', torch.bfloat16, 'cuda'))" > "$OUT/ckpt.log" 2>&1 &
      CKPT_PID=$!
      pids=()
      for case in roomy recompute swap static-decode compiled-decode cuda-graph cuda-graph-compiled; do
        timeout 240 $PY -m pytest -q -p no:cacheprovider \
          "tests/test_tensor_parallel.py::test_two_ranks_generate_what_one_process_generates[$case]" \
          > "$OUT/tests_$case.log" 2>&1 &
        pids+=($!)
      done
      timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py -k "refuses" \
        > "$OUT/tests_refuses.log" 2>&1
      for p in "${pids[@]}"; do wait "$p"; done
      for f in "$OUT"/tests_*.log; do echo "$(basename "$f"): $(tail -n 1 "$f")"; done | tee "$OUT/tests.txt"
      wait "$CKPT_PID"; tail -n 2 "$OUT/ckpt.log" ;;
    one) CUDA_VISIBLE_DEVICES=0 timeout 240 $PY benchmarks/bench_generate.py $KV --out $RES --systems paged_compiled \
        > "$OUT/one.log" 2>&1 ;;
    two) timeout 300 $TORCHRUN benchmarks/bench_generate.py $KV --out $RES --systems paged_compiled,paged \
        > "$OUT/two.log" 2>&1 ;;
    two_eager) timeout 240 $TORCHRUN benchmarks/bench_generate.py $KV --out $RES --systems paged --no-cuda-graph \
        > "$OUT/two_eager.log" 2>&1 ;;
    long1) CUDA_VISIBLE_DEVICES=0 timeout 300 $PY benchmarks/bench_generate.py $LONG --out $RES \
        --systems paged_compiled > "$OUT/long1.log" 2>&1 ;;
    long2) timeout 300 $TORCHRUN benchmarks/bench_generate.py $LONG --out $RES --systems paged_compiled \
        > "$OUT/long2.log" 2>&1 ;;
    *) echo "unknown part $part"; continue ;;
  esac
  echo "exit $?"
  [ -f "$OUT/$part.log" ] && grep -E "tok/s|^\| paged|bound|Error|error" "$OUT/$part.log" | tail -n 12
  tar czf "$DEST/tp.tgz" -C "$OUT" .  # after every part: a call cut short still brings back what ran
done
stamp done
