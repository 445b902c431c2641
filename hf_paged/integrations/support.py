"""Moved to `hf_paged.attention.support`; `hf_paged.integrations.support` stays as a thin re-export for code written against 0.1 (no logic here)."""

from ..attention.support import (
    HANDLED_FEATURES,
    SUPPORTED_MODEL_TYPES,
    check_supported,
    describe_support,
    model_features,
)

__all__ = ["HANDLED_FEATURES", "SUPPORTED_MODEL_TYPES", "check_supported", "describe_support", "model_features"]
