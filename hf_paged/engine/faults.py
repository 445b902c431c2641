"""What a failed or interrupted step undoes: failing only its own requests, or requeueing them intact
(`StepRecovery`, a part of `Engine` that touches the scheduler, the block manager and the runner's tables only).

* A step that raises an `Exception` (block copies, forward, a kernel, sampling, a logits processor) fails the requests
  scheduled in it: finish reason "error", `RequestOutput.error` is the exception, their blocks are freed; the engine
  keeps serving the others. If the block copies raised, the groups the step's swaps moved are recomputed instead
  (their tokens are intact, their swapped K/V may not be).
* A `BaseException` (KeyboardInterrupt, SystemExit) propagates after the engine is made consistent: before sampling
  began, the step's requests (and the groups its swaps moved) go back to the waiting queue with `num_computed = 0`
  and are recomputed, losing nothing; during sampling (tokens or forks may be half applied) they are failed as above.
  `tests/test_reliability.py::assert_consistent` is the invariant. Pipelined steps: `hf_paged.engine.pipelined`.
"""

from __future__ import annotations

from ..core import SchedulerOutput, SequenceGroup, SequenceStatus

__all__ = ["StepRecovery"]


class StepRecovery:
    """Failure and interrupt handling of engine steps. It changes the requests' state through the scheduler and the
    block manager, and drops the runner's cached block tables; the engine reports what it returns."""

    def __init__(self, scheduler, block_manager, runner) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.runner = runner

    def fail(self, sched: SchedulerOutput, error: BaseException, phase: str = "forward") -> list[SequenceGroup]:
        """Fail the requests scheduled in a step that raised (finish reason "error", `error` attached).

        If the block operations raised (`phase == "blocks"`), the step's swaps may be incomplete: the groups they
        moved are not failed (their tokens are intact) but recomputed from scratch instead of resumed.
        """
        failed = []
        for item in sched.scheduled:
            if item.group not in failed:
                failed.append(item.group)
        for group in failed:
            group.error = error
            self.scheduler.finish_group(group, SequenceStatus.FINISHED_ERROR)
        if phase == "blocks":
            for group in self._swapped_in_step(sched):
                if group not in failed:
                    self.requeue(group)
        self.runner.invalidate_tables()
        return failed

    def interrupted(self, sched: SchedulerOutput, error: BaseException, phase: str) -> list[SequenceGroup]:
        """A step was interrupted (KeyboardInterrupt, SystemExit): keep every request whole and the engine usable.
        Returns the requests it failed, for the engine to report at its next step (the interrupted one returns none).

        Before sampling began nothing of the step's requests changed but their reserved slots and possibly half
        written K/V: they go back to the waiting queue and are recomputed (with the groups of the step's swaps, whose
        copies may be incomplete). During sampling their tokens and forks may be half applied: they are failed.
        """
        if phase == "sample":
            return self.fail(sched, error, phase)
        groups = []
        for group in [item.group for item in sched.scheduled] + (self._swapped_in_step(sched) if phase == "blocks"
                                                                  else []):
            if group not in groups:
                groups.append(group)
        for group in groups:
            self.requeue(group)
        self.runner.invalidate_tables()
        return []

    def _swapped_in_step(self, sched: SchedulerOutput) -> list[SequenceGroup]:
        """Groups whose blocks this step's swaps moved (swapped out, or swapped in and still running)."""
        groups = [g for g in sched.preempted if g in self.scheduler.swapped] if sched.swap_out else []
        if sched.swap_in:
            moved = {gpu for _, gpu in sched.swap_in}
            bm = self.block_manager
            for group in self.scheduler.running:
                if any(bm.has_seq(s.seq_id) and moved.intersection(bm.block_table(s.seq_id))
                       for s in group.live_seqs()):
                    groups.append(group)
        return groups

    def requeue(self, group: SequenceGroup) -> None:
        """Send a running or swapped group back to the waiting queue, to be recomputed (its blocks are freed)."""
        scheduler = self.scheduler
        for seq in group.live_seqs():
            scheduler.free_seq(seq)
            seq.num_computed = 0
            seq.status = SequenceStatus.WAITING
        for queue in (scheduler.running, scheduler.swapped):
            if group in queue:
                queue.remove(group)
        if group not in scheduler.waiting:
            scheduler._insert(scheduler.waiting, group)
