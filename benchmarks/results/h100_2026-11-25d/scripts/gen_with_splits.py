"""bench_generate.py with the decode kernel's split parameters set first: gen_with_splits.py NS TGT MIN -- args."""
import runpy
import sys

from hf_paged.kernels import triton_decode as td

ns, tgt, mn = (int(v) for v in sys.argv[1:4])
td.NO_SPLIT_PROGRAMS_PER_SM, td.TARGET_PROGRAMS_PER_SM, td.MIN_TOKENS_PER_SPLIT = ns, tgt, mn
sys.argv = ["bench_generate.py"] + sys.argv[5:]
sys.path.insert(0, "benchmarks")
runpy.run_path("benchmarks/bench_generate.py", run_name="__main__")
