"""Moved to `hf_paged.attention`; `hf_paged.integrations.attention` stays as a thin re-export for code written against 0.1 (no logic here)."""

from ..attention.functions import ATTENTION_NAME, paged_attention_forward, paged_mask, register

__all__ = ["ATTENTION_NAME", "paged_attention_forward", "paged_mask", "register"]
