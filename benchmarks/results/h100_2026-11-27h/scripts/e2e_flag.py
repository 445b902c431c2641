"""bench_generate.py (or another script) with module switches set: e2e_flag.py mod.path:NAME=0/1 ... -- script args."""
import importlib
import runpy
import sys

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
split = sys.argv.index("--")
for spec in sys.argv[1:split]:
    mod, assign = spec.split(":")
    name, value = assign.split("=")
    setattr(importlib.import_module(mod), name, value == "1")
script = sys.argv[split + 1]
sys.argv = [script] + sys.argv[split + 2:]
runpy.run_path(script, run_name="__main__")
