#!/bin/bash
# call 4: the residual fold in place (hf_paged::add_linear_) against the out-of-place addmm: kernels, end to end
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
F=hf_paged.runner.sibling_linears:FOLD_IN_PLACE
for f in 1 0; do
timeout 90 python3 benchmarks/scratch/s20/e2e_flag.py $F=$f -- benchmarks/scratch/s20/step_list.py --model llama-1b > $OUT/list_$f.log 2>&1; echo "list $f rc $?"
grep -v -i warn $OUT/list_$f.log | head -30
done
for r in a b; do for f in 1 0; do
for m in llama-1b qwen2.5-0.5b; do
timeout 100 python3 benchmarks/scratch/s20/e2e_flag.py $F=$f -- benchmarks/bench_generate.py --model $m --workload sharegpt --systems paged_compiled --no-progress --out $OUT/e2e_${m}_$f$r > $OUT/e2e_${m}_$f$r.log 2>&1; echo "$m $f rc $?"
grep -A2 "^| system | run s" $OUT/e2e_${m}_$f$r.log | tail -1
done
done
done
