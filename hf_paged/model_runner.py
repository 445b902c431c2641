"""Moved to `hf_paged.runner.model_runner`; `hf_paged.model_runner` stays as a thin re-export for code written against 0.1 (no logic here)."""

from .runner.model_runner import ModelRunner

__all__ = ["ModelRunner"]
