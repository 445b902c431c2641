"""Run a script with the engine's automatic `admission_batch` forced to 1 when $ADMIT is "1" (A/B of batched
admissions); "auto" leaves the default."""
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
import hf_paged.engine.engine as engine_module  # noqa: E402

if os.environ.get("ADMIT", "auto") == "1":
    engine_module.default_admission_batch = lambda max_num_seqs, graphed: 1
script, sys.argv = sys.argv[1], sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
