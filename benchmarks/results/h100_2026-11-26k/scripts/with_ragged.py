"""Run a script with ragged steps replayed from CUDA graphs (RAGGED=1, the library default) or eager (RAGGED=0).
Scratch A/B wrapper."""
import os
import runpy
import sys

from hf_paged.runner import ragged_graphs

if os.environ.get("RAGGED", "1") == "0":
    _init = ragged_graphs.RaggedGraphs._init_ragged

    def _off(self):
        _init(self)
        self.ragged_graphs = False

    ragged_graphs.RaggedGraphs._init_ragged = _off
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
