"""Run a script with the engine's automatic `admission_batch` set to $ADMIT ("auto": the default) and every engine's
`admission_max_wait` set to $WAIT (unset: the default): a sweep of the admission defaults."""
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
import hf_paged.engine.engine as engine_module  # noqa: E402

admit = os.environ.get("ADMIT", "auto")
if admit != "auto":
    engine_module.default_admission_batch = lambda max_num_seqs, graphed: int(admit)
if "WAIT" in os.environ:
    init = engine_module.Engine.__init__

    def patched(self, *args, **kwargs):
        kwargs.setdefault("admission_max_wait", int(os.environ["WAIT"]))
        init(self, *args, **kwargs)

    engine_module.Engine.__init__ = patched
script, sys.argv = sys.argv[1], sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
