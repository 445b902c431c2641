"""Moved to `hf_paged.engine.beam`; `hf_paged.beam` stays as a thin re-export for code written against 0.1 (no logic here)."""

from .engine.beam import BeamSearch, BeamState, SharingStats, sharing_stats, track_sharing
from .engine.params import validate_beam_params

__all__ = ["BeamSearch", "BeamState", "SharingStats", "sharing_stats", "track_sharing", "validate_beam_params"]
