"""Sequences and sequence groups: the engine's unit of scheduling (pure Python, no torch).

A request becomes one `SequenceGroup`. Its sequences (one for greedy / sampling; several for parallel sampling or
beam search) are scheduled, preempted and freed together (paper §4.5: all-or-nothing eviction of a group).
`num_computed` counts tokens whose K/V are in the cache; a step computes tokens `[num_computed, num_computed + n)`,
and when that reaches the end of the sequence the step also samples the next token.

Preempting a group by recompute frees every sequence's blocks, and each is prefilled again on its own, without
sharing; swapping moves the blocks shared inside the group once, and they stay shared. `max_num_seqs` counts a group
at `SequenceGroup.max_running_seqs()`: its `width` (samples or beams) until it forks, then its live sequences, so
admitting a one-sequence prompt that will fork never overfills the next step.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    is_finished: bool  # a plain attribute of each member (set below): read on every step for every sequence


for _status in SequenceStatus:
    _status.is_finished = _status.name.startswith("FINISHED_")
del _status

_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One token stream. `token_ids` = prompt followed by generated tokens."""

    token_ids: list[int]
    prompt_len: int
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    cumulative_logprob: float = 0.0
    stop_reason: str | None = None
    sample_index: int = 0  # which sample of a parallel-sampling request (0 for the first / only one)
    # prefix-cache keys of the prompt's full blocks, hashed ahead of admission (`Scheduler.prepare_admissions`)
    prompt_keys: list[int] | None = field(default=None, repr=False)
    # hybrid models with prefix caching: block-aligned positions, ascending, after which the recurrent state is
    # checkpointed; a prefill chunk ends at each (`Scheduler._plan`), set at admission (`state_save_points`)
    state_saves: list[int] = field(default_factory=list, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_prefill(self) -> bool:
        """More than the last sampled token is missing from the cache (first prefill, chunk, or after recompute)."""
        return self.num_uncomputed > 1

    def fork(self) -> Sequence:
        return Sequence(
            token_ids=list(self.token_ids),
            prompt_len=self.prompt_len,
            num_computed=self.num_computed,
            status=self.status,
            cumulative_logprob=self.cumulative_logprob,
        )


@dataclass(eq=False)
class SequenceGroup:
    """A request: its sequences, its parameters (opaque here) and its arrival order (FCFS key)."""

    request_id: Any
    seqs: list[Sequence]
    arrival: int
    params: Any = None
    num_preemptions: int = 0
    error: BaseException | None = None
    data: dict = field(default_factory=dict)
    width: int = 1  # sequences it forks into after the prompt (parallel samples, beams)
    plain: bool = False  # engine hint: one greedy sequence, no logits processing, no scores (its token is the argmax)
    # engine hint: plain but for a token mask the host fills from the tokens so far (structured outputs); pipelined
    # decode fills it while the step's forward runs, after the step before's tokens arrived
    masked: bool = False
    metrics: dict = field(default_factory=dict)  # engine timestamps (perf_counter): arrival, first token, finished
    # the prefix cache may serve at most this many leading tokens at admission (None: no limit); the positions from
    # here on must be computed because their logits are wanted (prompt log-probabilities)
    max_cached_prefix: int | None = None
    # what its K/V depend on besides the tokens, for the prefix cache (a LoRA adapter's id; 0: nothing): its blocks
    # are shared with groups of the same salt only (`block_pool.salted_root`)
    cache_salt: int = 0

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.status.is_finished]

    def max_running_seqs(self) -> int:
        """Sequences this group runs at once from its next step on: its width until it forks, then its live ones."""
        live = len(self.live_seqs())
        return max(self.width, live) if len(self.seqs) == 1 else live

    @property
    def is_finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:
            return seqs[0].status.is_finished
        return all(s.status.is_finished for s in seqs)
