"""Moved to `hf_paged.core.scheduler`; `hf_paged.scheduler` stays as a thin re-export for code written against 0.1 (no logic here)."""

from .core.scheduler import PREEMPTION_MODES, ScheduledSeq, Scheduler, SchedulerOutput

__all__ = ["PREEMPTION_MODES", "ScheduledSeq", "Scheduler", "SchedulerOutput"]
