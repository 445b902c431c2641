#!/bin/bash
# H100: the table on the final tree; the GPU-host test fixes of this session
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest 2>&1 | tail -1
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
mkdir -p $OUT/h
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/h/gpu.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:logging "tests/test_compile_decode.py::test_prefill_steps_run_the_compiled_layers_and_compile_nothing_more" tests/test_compile_decode.py::test_a_dropped_engine_is_freed_without_the_cycle_collector tests/test_beam.py::test_copy_on_write_at_kernel_level tests/test_pipeline.py tests/test_parallel_jit.py 2>&1 | grep -v DEBUG | tail -3 | tee $OUT/h/tests.log
run() {  # tag args...
  local tag=$1; shift
  timeout 120 python3 benchmarks/bench_generate.py "$@" --systems paged_compiled --out /tmp/e2e_$tag --no-progress 2>&1 | grep -v Warn > $OUT/h/$tag.log
  grep -A2 "bound / run" $OUT/h/$tag.log | tail -1 | sed "s/^/$tag /"
}
run llama1 --model llama-1b --workload sharegpt
run llama2 --model llama-1b --workload sharegpt
run qwen --model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95
run long --model llama-1b --workload long --num-requests 64
