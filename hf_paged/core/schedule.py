"""What one engine step runs: `SchedulerOutput` (the scheduled token runs, block operations, preemptions) and its
items `ScheduledSeq`. Made by `hf_paged.core.scheduler`, read by the runner and the engine. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .decode_batch import DecodeBatch
from .sequence import Sequence, SequenceGroup

__all__ = ["ScheduledSeq", "SchedulerOutput"]


@dataclass(slots=True)
class ScheduledSeq:
    """`num_tokens` tokens of `seq` starting at `start` are computed this step; `sample` when it reaches the end."""

    seq: Sequence
    group: SequenceGroup
    start: int
    num_tokens: int
    slots: list[int]

    @property
    def sample(self) -> bool:
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), GPU -> GPU
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    preempted: list[SequenceGroup] = field(default_factory=list)
    # every item is one sampled token of a running sequence (`Scheduler.schedule_decode_step`): lets the runner skip
    # its per-item check of the static decode path
    decode_step: bool = False
    # its items' groups are distinct (a decode step where no group gave two rows: no parallel samples running)
    distinct_groups: bool = False
    # a decode step's items whose block table changed in its reservation (new block, copy-on-write), by index; None:
    # unknown (the runner then compares every table with the one it uploaded)
    table_changes: list[int] | None = None
    # a pipelined decode step of the scheduler's `DecodeBatch`: its rows' positions and slots are in the batch's arrays
    batch: DecodeBatch | None = None
    # and which of the batch's steps it is (`DecodeBatch.rows_of`)
    batch_step: int = 0
    # hybrid models: (sequence, position) whose recurrent state is checkpointed once this step's forward is launched
    # (its chunk ends there; `Scheduler.commit_launched`)
    state_saves: list[tuple[Sequence, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def one_token_each(self) -> bool:
        """Every item runs one token (a decode-only step): known without a pass over the items for a batched
        decode step (`decode_step`)."""
        return self.decode_step or all(item.num_tokens == 1 for item in self.scheduled)
