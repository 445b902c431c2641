"""Run a script with ragged-step padding off when $PAD is "0" (A/B of `padded_tokens`)."""
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
import hf_paged.runner.model_runner as mr  # noqa: E402

if os.environ.get("PAD", "1") == "0":
    init = mr.ModelRunner.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.pad_ragged = False

    mr.ModelRunner.__init__ = patched
script, sys.argv = sys.argv[1], sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
