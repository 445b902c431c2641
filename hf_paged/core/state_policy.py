"""Scheduling decisions that only hybrid models need (their sequences hold recurrent-state slots). Pure Python.

* `free_state_slots`: the slots admissions may take, once the running groups that are about to fork (parallel
  samples, beams) have their share: a fork needs a slot of its own, since a state cannot be shared by reference.
* `CheckpointPlanner`: where an admitted sequence checkpoints its recurrent state for the prefix cache, and which
  prompts wait a step for a checkpoint on its way. A prefix hit of a hybrid model needs the state at the hit's end as well as the K/V blocks before it, and a
  state exists only where a forward ended, so the scheduler ends prefill chunks at these positions
  (`Sequence.state_saves`) and the block manager keeps a copy of the state there once the forward is launched.
"""

from __future__ import annotations

from collections.abc import Iterable

from .block_manager import BlockManager
from .block_stats import PrefixMatch
from .sequence import Sequence, SequenceGroup

__all__ = ["CheckpointPlanner", "free_state_slots"]


def free_state_slots(block_manager: BlockManager, running: Iterable[SequenceGroup]) -> int:
    """Free state slots left for admissions: those the running groups about to fork will take are not."""
    forks = sum(group.width - 1 for group in running if len(group.seqs) == 1 and group.width > 1)
    return block_manager.state.num_free - forks


class CheckpointPlanner:
    """Where the sequences admitted in one scheduling pass checkpoint their recurrent states, and which of them wait.

    Built per admission pass: it knows which block prefixes the waiting prompts share (prefix-cache key -> how many
    waiting groups' prompts have it, over the groups hashed ahead by `Scheduler.prepare_admissions`: those one step
    could admit), and the prefixes whose states this pass's admissions will checkpoint.
    """

    def __init__(self, waiting: Iterable[SequenceGroup], block_size: int) -> None:
        self.shift = block_size.bit_length() - 1
        self.counts: dict[int, int] = {}
        self.given: dict[int, int] = {}  # group id -> how many keys it gave (its prompt's first blocks)
        self.upcoming: set[int] = set()  # keys of the blocks ending where this pass's admissions checkpoint
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

    def waits(self, match: PrefixMatch) -> bool:
        """Whether a prompt should wait a step: its cached K/V go past its checkpointed prefix to where a sequence
        admitted in this pass checkpoints (a burst of prompts that share a prefix an earlier prompt left in the
        cache: one computes the state there, the others resume from it one step later)."""
        hits = match.num_hit_blocks
        return hits << self.shift > match.num_cached_tokens and match.keys[hits - 1] in self.upcoming

    def plan_saves(self, group: SequenceGroup, plan: list[tuple[Sequence, int]], matches: dict) -> None:
        """Set `state_saves` of each admitted sequence of `group`: the block-aligned positions where a later prompt
        is likely to resume.

        * where the cached K/V of an earlier prompt ends beyond the checkpoint found, and where the prompt stops
          sharing blocks with another waiting prompt: both are a shared prefix (a system prompt); the next prompt
          that shares it resumes there, and one that waits for the blocks or the checkpoint resumes after one step;
        * the last full block of the prompt: a conversation's next turn starts with this prompt.
        """
        shift = self.shift
        for seq, _ in plan:
            match: PrefixMatch = matches[seq.seq_id]
            common = self.shared_blocks(group, match.keys)
            points = {match.num_hit_blocks << shift, common << shift, (seq.prompt_len >> shift) << shift}
            seq.state_saves = sorted(p for p in points if seq.num_computed < p <= seq.num_tokens)
            self.upcoming.update(match.keys[(p >> shift) - 1] for p in seq.state_saves
                                 if (p >> shift) <= len(match.keys))
