"""bench_generate with the decode kernel's shortest split run set: `split_ab.py 128 <bench_generate args>`."""
import sys

sys.path.insert(0, "benchmarks")
from hf_paged.kernels import triton_decode  # noqa: E402

triton_decode.MIN_TOKENS_PER_SPLIT = int(sys.argv.pop(1))
import bench_generate  # noqa: E402

bench_generate.main()
print("min split", triton_decode.MIN_TOKENS_PER_SPLIT)
