"""Moved to `hf_paged.engine.sampling / hf_paged.engine.params`; `hf_paged.sampling` stays as a thin re-export for code written against 0.1 (no logic here)."""

from .engine.logits import _apply_repetition_penalty
from .engine.params import SamplingParams
from .engine.sampling import Sampler, sample_next_tokens

__all__ = ["SamplingParams", "Sampler", "sample_next_tokens", "_apply_repetition_penalty"]
