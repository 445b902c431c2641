"""Run a benchmark script with Inductor's combo kernels on (experiment)."""
import runpy
import sys

import torch._inductor.config as c

c.combo_kernels = True
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
