"""Moved to `hf_paged.core.sequence`; `hf_paged.sequence` stays as a thin re-export for code written against 0.1 (no logic here)."""

from .core.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = ["Sequence", "SequenceGroup", "SequenceStatus"]
