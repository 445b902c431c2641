"""Run a benchmark script with Inductor's combo kernels off (experiment)."""
import os
import runpy
import sys

import hf_paged.runner.sibling_linears as s

s.COMBO_KERNELS = False
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
