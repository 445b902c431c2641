"""One model forward per engine step: inputs, block operations, static decode buffers and CUDA graphs, the compiled
decode step, and tensor parallelism.

Layer 5 of hf_paged (docs/architecture.md): imports `hf_paged.core`, `hf_paged.cache` and `hf_paged.attention`;
imported by the engine.
"""

from .compile import compile_submodules, uncompile_submodules
from .distributed import TensorParallel
from .model_ref import ModelFreedError, ModelRef
from .model_runner import ModelRunner
from .weights import WeightChange, WeightWatch

__all__ = ["ModelFreedError", "ModelRef", "ModelRunner", "WeightChange", "WeightWatch", "TensorParallel", "compile_submodules", "uncompile_submodules"]
