"""`RecurrentStates`: a `PagedCache`'s recurrent states (hybrid models), as one part with a narrow interface.

It joins the two halves: the slot bookkeeping (`hf_paged.core.StateSlots`, which the cache's block manager holds so
that every sequence operation moves its slot too) and the tensors (`StatePool`). The cache asks it for room (the
drop-in cache's batch grows), for the slots of a step's sequences, and to apply the slot operations decided since the
last forward before the next one reads any state.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ..core import BlockManager, StateSlots
from .state_pool import StateKey, StatePool, StateSpec

__all__ = ["RecurrentStates"]


class RecurrentStates:
    """Slots and tensors of a hybrid model's recurrent states for one cache.

    Args:
        block_manager: the cache's; it gets the slots (`block_manager.state`), and its existing sequences get one each.
        device: where the states live.
        num_slots: fixed sequence slots (the engine's, sized with its memory budget); None: one per sequence of the
            drop-in cache, grown with its batch (`make_room`).
        num_checkpoints, specs, num_cpu_slots: see `StateSlots` and `StatePool`.
    """

    def __init__(self, block_manager: BlockManager, device: torch.device, *, num_slots: int | None = None,
                 num_checkpoints: int = 0, specs: dict[StateKey, StateSpec] | None = None,
                 num_cpu_slots: int = 0) -> None:
        self.fixed = num_slots is not None
        existing = block_manager.seq_ids()
        self.slots = StateSlots(num_slots if self.fixed else max(1, len(existing)), num_cpu_slots=num_cpu_slots,
                                num_checkpoints=num_checkpoints)
        for seq_id in existing:
            self.slots.allocate(seq_id)
        block_manager.state = self.slots
        self.pool = StatePool(self.slots.scratch + 1, device, specs, num_cpu_slots=num_cpu_slots)

    def __repr__(self) -> str:
        return f"RecurrentStates({self.slots!r}, {self.pool!r})"

    @property
    def scratch(self) -> int:
        return self.slots.scratch

    def make_room(self, needed: int) -> None:
        """Room for `needed` more sequences: the drop-in cache grows; the engine's slots are fixed (its scheduler
        never asks for more than it has)."""
        if self.fixed or self.slots.num_free >= needed:
            return
        self.slots.grow(self.slots.num_slots + needed - self.slots.num_free)
        self.pool.grow(self.slots.scratch + 1)

    def slot_tensor(self, seq_ids: Sequence[Hashable], device: torch.device) -> torch.Tensor:
        """The slots of `seq_ids`, as an int64 tensor on `device`."""
        return torch.tensor(self.slots.slots(seq_ids), dtype=torch.long, device=device)

    def fill_step(self, step, seq_ids: Sequence[Hashable], device: torch.device) -> None:
        """Give a padded step (the drop-in cache's, one row a sequence) the slots of `seq_ids`, after the slot
        operations decided since the last forward. A drop-in cache learns its states at the first recurrent layer
        of its first forward, which may come after an attention layer began the step (MiniMax's first layer)."""
        self.apply_ops()
        step.state_slots = self.slot_tensor(seq_ids, device)

    def apply_ops(self) -> None:
        """Apply the slot operations decided since the last forward (forks, fresh zeros, swaps, checkpoints)."""
        if self.slots.has_pending:
            self.pool.apply(self.slots.take_ops())

    def release(self) -> None:
        self.pool.release()
