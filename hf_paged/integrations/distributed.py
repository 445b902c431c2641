"""Moved to `hf_paged.runner.distributed`; `hf_paged.integrations.distributed` stays as a thin re-export for code written against 0.1 (no logic here)."""

from ..runner.distributed import TensorParallel

__all__ = ["TensorParallel"]
