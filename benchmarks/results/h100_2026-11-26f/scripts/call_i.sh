#!/bin/bash
# Inductor's PDL (Programmatic Dependent Launch) for the compiled step: decode-step graph time and e2e, off vs on
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
mkdir -p $OUT/i
python3 -c "import torch._inductor.config as c; print('enable_pdl available:', hasattr(c.triton, 'enable_pdl'), c.triton.enable_pdl)"
for pdl in 0 1; do
  TORCHINDUCTOR_ENABLE_PDL=$pdl python3 benchmarks/bench_decode_step.py --model llama-1b --batches 32,256 --variants compiled --context 512 --out /tmp/ds_$pdl 2>&1 | grep -v Warn | grep "^|" | tee $OUT/i/step_pdl$pdl.log
done
for i in 1 2; do for pdl in 0 1; do
  TORCHINDUCTOR_ENABLE_PDL=$pdl python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled --out /tmp/e2e_pdl$pdl --no-progress 2>&1 | grep -v Warn > $OUT/i/e2e_pdl${pdl}_$i.log
  echo "pdl $pdl run $i: $(grep -A2 'bound / run' $OUT/i/e2e_pdl${pdl}_$i.log | tail -1)"
done; done
