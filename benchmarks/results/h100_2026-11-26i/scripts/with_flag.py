"""Run a script with `sibling_linears.IN_PLACE_RESIDUAL` set from $IN_PLACE (1 / 0): an A/B of the in-place fold."""
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
from hf_paged.runner import sibling_linears as sl  # noqa: E402

sl.IN_PLACE_RESIDUAL = os.environ.get("IN_PLACE", "1") == "1"
script, sys.argv = sys.argv[1], sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
print(f"IN_PLACE_RESIDUAL={sl.IN_PLACE_RESIDUAL} FUSED={sl.FUSED}")
