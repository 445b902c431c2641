#!/usr/bin/env bash
# the two CUDA-graph TP test cases, run directly with tracebacks dumped after HANG_DUMP_S
DEST=$1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=1
export PYTHONPATH=$PWD/benchmarks/scratch/hang:$PWD HANG_DUMP_S=${HANG_DUMP_S:-100} PYTHONUNBUFFERED=1
mkdir -p /tmp/hangdump; D=/tmp/dbg; mkdir -p $D
i=0
for args in "--num-blocks 20 --block-size 8 --cuda-graph" "--cuda-graph --compile-decode"; do
  i=$((i+1))
  HANG_TAG=single$i TORCHELASTIC_RUN_ID=dbgs$i timeout 130 python3 examples/tensor_parallel.py --model tiny --max-new-tokens 14 --json $D/s$i $args > $D/single$i.log 2>&1 &
  HANG_TAG=tp$i TORCHELASTIC_RUN_ID=dbg$i timeout 130 python3 -m torch.distributed.run --standalone --nproc-per-node 2 examples/tensor_parallel.py --model tiny --max-new-tokens 14 --json $D/t$i $args > $D/tp$i.log 2>&1 &
done
wait
cp /tmp/hangdump/* $D/ 2>/dev/null
for f in $D/*.log; do echo "== $f"; tail -n 30 $f; done
for f in $D/*.txt; do echo "== $f"; head -c 4000 $f; done
tar czf $DEST/dbg.tgz -C $D .
