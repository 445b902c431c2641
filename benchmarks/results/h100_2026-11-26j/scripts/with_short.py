"""Run a script with the scheduler's pool-bound admission check (SHORT=1, the library) or without it (SHORT=0:
every step with a waiting queue tries to admit, as before). Scratch A/B wrapper."""
import os
import runpy
import sys

from hf_paged.core import scheduler as sched_mod

if os.environ.get("SHORT", "1") == "0":
    original = sched_mod.Scheduler._admission

    def forgetful(self):
        self._short_of_blocks = None
        return original(self)

    sched_mod.Scheduler._admission = forgetful
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
