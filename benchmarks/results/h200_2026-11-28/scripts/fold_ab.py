"""bench_generate with the compiled step's residual fold on or off: `fold_ab.py on|off <bench_generate args>`."""
import sys

sys.path.insert(0, "benchmarks")
from hf_paged.runner import sibling_linears  # noqa: E402

mode = sys.argv.pop(1)
sibling_linears.FOLD_RESIDUAL_ADDS = mode == "on"
import bench_generate  # noqa: E402

bench_generate.main()
print("fold", mode, "folded", sibling_linears.FUSED)
