"""bench_generate with the residual-add fold off (A/B)."""
import runpy
import sys

from hf_paged.runner import sibling_linears

sibling_linears.FOLD_RESIDUAL_ADDS = False
sys.argv = ["bench_generate.py"] + sys.argv[1:]
runpy.run_path("benchmarks/bench_generate.py", run_name="__main__")
