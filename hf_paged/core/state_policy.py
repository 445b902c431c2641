"""Scheduling decisions that only hybrid models need (their sequences hold recurrent-state slots). Pure Python.

* `free_state_slots`: the slots admissions may take, once the running groups that are about to fork (parallel
  samples, beams) have their share: a fork needs a slot of its own, since a state cannot be shared by reference.
* `WaitingKeys` and `plan_state_saves`: where an admitted sequence checkpoints its recurrent state for the prefix
  cache. A prefix hit of a hybrid model needs the state at the hit's end as well as the K/V blocks before it, and a
  state exists only where a forward ended, so the scheduler ends prefill chunks at these positions
  (`Sequence.state_saves`) and the block manager keeps a copy of the state there once the forward is launched.
"""

from __future__ import annotations

from collections.abc import Iterable

from .block_manager import BlockManager
from .block_stats import PrefixMatch
from .sequence import Sequence, SequenceGroup

__all__ = ["WaitingKeys", "free_state_slots", "plan_state_saves"]


def free_state_slots(block_manager: BlockManager, running: Iterable[SequenceGroup]) -> int:
    """Free state slots left for admissions: those the running groups about to fork will take are not."""
    forks = sum(group.width - 1 for group in running if len(group.seqs) == 1 and group.width > 1)
    return block_manager.state.num_free - forks


class WaitingKeys:
    """Which block prefixes the waiting prompts share: prefix-cache key -> how many waiting groups' prompts have it,
    over the groups hashed ahead (`Scheduler.prepare_admissions`: those one step could admit)."""

    def __init__(self, waiting: Iterable[SequenceGroup]) -> None:
        self.counts: dict[int, int] = {}
        self.given: dict[int, int] = {}  # group id -> how many keys it gave (its prompt's first blocks)
        for group in waiting:
            keys = group.seqs[0].prompt_keys or ()
            self.given[id(group)] = len(keys)
            for key in keys:
                self.counts[key] = self.counts.get(key, 0) + 1

    def shared_blocks(self, group: SequenceGroup, keys: tuple[int, ...]) -> int:
        """How many leading blocks of `keys` (a prompt of `group`) another waiting group's prompt shares."""
        mine = self.given.get(id(group), 0)
        common = 0
        for i, key in enumerate(keys):
            if self.counts.get(key, 0) - (i < mine) <= 0:
                break
            common = i + 1
        return common


def plan_state_saves(block_size: int, group: SequenceGroup, plan: list[tuple[Sequence, int]],
                     matches: dict, waiting: WaitingKeys) -> None:
    """Set `state_saves` of each admitted sequence of `group`: the block-aligned positions where a later prompt is
    likely to resume.

    * where the cached K/V of an earlier prompt ends beyond the checkpoint found, and where the prompt stops sharing
      blocks with another waiting prompt: both are a shared prefix (a system prompt); the next prompt that shares it
      resumes there, and one that waits for its pending blocks resumes after one step;
    * the last full block of the prompt: a conversation's next turn starts with this prompt.
    """
    shift = block_size.bit_length() - 1
    for seq, _ in plan:
        match: PrefixMatch = matches[seq.seq_id]
        common = waiting.shared_blocks(group, match.keys)
        points = {match.num_hit_blocks << shift, common << shift, (seq.prompt_len >> shift) << shift}
        seq.state_saves = sorted(p for p in points if seq.num_computed < p <= seq.num_tokens)
