"""Moved to `hf_paged.runner.compile and hf_paged.attention.compiled_op`; `hf_paged.integrations.compile` stays as a thin re-export for code written against 0.1 (no logic here)."""

from ..attention.compiled_op import active_cache, fused_decode_attention, write_and_decode
from ..runner.compile import compile_submodules, uncompile_submodules

__all__ = ["active_cache", "compile_submodules", "fused_decode_attention", "uncompile_submodules", "write_and_decode"]
