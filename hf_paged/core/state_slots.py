"""Slots of recurrent state (hybrid and recurrent models), and checkpoints of it for prefix caching. Pure Python.

A recurrent layer (Mamba, gated DeltaNet, a short convolution) keeps a fixed-size state per sequence instead of K/V
per token: a convolution window and an SSM or delta-rule matrix. The tensor side (`hf_paged.cache.state_pool`) holds
every layer's states in tensors indexed by *slot*; this module decides which slot holds whose state, exactly as the
block manager decides which block holds which tokens, and returns the copies the tensor side performs.

Why slots cannot be shared like blocks: a state changes at every token, so a fork (parallel sample, beam) gets a
*copy* of its parent's slot, and a prefix-cache hit restores a *copy* of a checkpoint.

Slot ids: ``0 .. num_slots - 1`` hold running sequences' states; ``num_slots .. num_slots + num_checkpoints - 1``
hold checkpoints (the state of some prefix at a block boundary, keyed by the prefix cache's entry id of the block
ending there); ``num_slots + num_checkpoints`` is a scratch slot that padding rows of a CUDA graph write into.

Operations between two forwards are collected and handed out together (:meth:`StateSlots.take_ops`), to be applied
before the next forward, in this order: (1) reads: swap-outs copy GPU slots to the CPU and every copy's source is
gathered; (2) writes: the copies are scattered, fresh slots zeroed, swap-ins written. For that to equal applying the
operations one by one, a copy never reads a slot that another pending operation writes: a copy from a slot whose own
content is still pending (a fork of a fork, a checkpoint of a just-restored sequence) takes that pending source
instead. A checkpoint that a pending restore reads is pinned, and a CPU slot that a pending swap-in reads stays
taken, until the operations are taken. A swapped-in state is read (forked, checkpointed, swapped out) only after
its swap-in ran: the engine swaps in while it schedules, after the forks and checkpoints of the step before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

__all__ = ["NoFreeSlotsError", "SlotOps", "StateSlots"]

_ZERO = -1  # a pending "source" meaning: the slot starts from zeros


class NoFreeSlotsError(RuntimeError):
    """No state slot is free (the scheduler checks `num_free` before it admits or forks)."""


@dataclass
class SlotOps:
    """The state copies to apply before the next forward (see the module docstring for the order).

    ``swap_out``: (GPU slot, CPU slot), GPU -> CPU; a GPU slot of -1 means zeros. ``copies``: (source, destination)
    GPU slots. ``zeros``: GPU slots that start from zeros. ``swap_in``: (CPU slot, GPU slot), CPU -> GPU.
    """

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    zeros: list[int] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.copies or self.zeros or self.swap_in)


class StateSlots:
    """Which slot holds each sequence's recurrent state; checkpoints of prefixes' states (LRU, capped).

    Args:
        num_slots: slots for sequences (the scheduler never runs more sequences than this).
        num_cpu_slots: slots of the CPU swap pool (preemption by swapping).
        num_checkpoints: slots for prefix-cache checkpoints (0: no prefix caching of states).
    """

    def __init__(self, num_slots: int, num_cpu_slots: int = 0, num_checkpoints: int = 0) -> None:
        for name, value, least in (("num_slots", num_slots, 1), ("num_cpu_slots", num_cpu_slots, 0),
                                   ("num_checkpoints", num_checkpoints, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        self.num_slots = num_slots
        self.num_cpu_slots = num_cpu_slots
        self.num_checkpoints = num_checkpoints
        self.scratch = num_slots + num_checkpoints  # written by padding rows, read by nobody
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: the lowest ids first
        self._cpu_free = list(range(num_cpu_slots - 1, -1, -1))
        self._slot: dict[Hashable, int] = {}  # sequence -> GPU slot
        self._cpu_slot: dict[Hashable, int] = {}  # swapped-out sequence -> CPU slot
        self._ckpt_free = list(range(num_slots + num_checkpoints - 1, num_slots - 1, -1))
        self._ckpt: OrderedDict[Hashable, int] = OrderedDict()  # key -> checkpoint slot, least recently used first
        self._ckpt_key: dict[int, Hashable] = {}
        self._pinned: set[int] = set()  # checkpoints a pending restore reads
        self._writes: dict[int, int] = {}  # GPU slot -> pending source (a slot, or _ZERO)
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: dict[int, int] = {}  # GPU slot -> CPU slot
        self._cpu_released: list[int] = []  # CPU slots a pending swap-in reads: free again once it has run
        self.checkpoint_hits = 0
        self.checkpoints_saved = 0
        self.checkpoint_evictions = 0

    def __repr__(self) -> str:
        return (f"StateSlots(num_slots={self.num_slots}, free={len(self._free)}, num_cpu_slots={self.num_cpu_slots}, "
                f"num_checkpoints={self.num_checkpoints}, checkpoints={len(self._ckpt)})")

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """GPU slots free for sequences."""
        return len(self._free)

    @property
    def num_cpu_free(self) -> int:
        return len(self._cpu_free)

    @property
    def num_used(self) -> int:
        return len(self._slot)

    @property
    def num_checkpoints_used(self) -> int:
        return len(self._ckpt)

    def slot(self, seq_id: Hashable) -> int:
        """The GPU slot of a resident sequence."""
        try:
            return self._slot[seq_id]
        except KeyError:
            raise ValueError(f"seq_id {seq_id!r} holds no state slot") from None

    def slots(self, seq_ids: Iterable[Hashable]) -> list[int]:
        """`slot` of each id (a step's rows), in one call."""
        table = self._slot
        try:
            return [table[seq_id] for seq_id in seq_ids]
        except KeyError:
            for seq_id in seq_ids:
                self.slot(seq_id)
            raise

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._slot or seq_id in self._cpu_slot

    # ------------------------------------------------------------------ pending operations
    def _source(self, slot: int) -> int:
        """What a copy from `slot` must read: its pending source when its content is still to be written."""
        if slot in self._swap_in:
            raise RuntimeError(f"state slot {slot} is read before its swap-in was applied (take_ops first)")
        return self._writes.get(slot, slot)

    def _write(self, dst: int, src: int) -> None:
        self._writes[dst] = self._source(src) if src != _ZERO else _ZERO

    def _forget_writes(self, slot: int) -> None:
        self._writes.pop(slot, None)
        self._swap_in.pop(slot, None)

    def take_ops(self) -> SlotOps:
        """The operations decided since the last call, to apply before the next forward; clears them."""
        ops = SlotOps(swap_out=self._swap_out,
                      copies=[(src, dst) for dst, src in self._writes.items() if src != _ZERO],
                      zeros=[dst for dst, src in self._writes.items() if src == _ZERO],
                      swap_in=[(cpu, gpu) for gpu, cpu in self._swap_in.items()])
        self._swap_out = []
        self._writes = {}
        self._swap_in = {}
        self._pinned.clear()
        self._cpu_free.extend(self._cpu_released)
        self._cpu_released = []
        return ops

    @property
    def has_pending(self) -> bool:
        return bool(self._writes or self._swap_out or self._swap_in)

    # ------------------------------------------------------------------ lifecycle
    def allocate(self, seq_id: Hashable, checkpoint: Hashable | None = None) -> int:
        """A slot for a new sequence: zeros, or a copy of the checkpoint keyed `checkpoint` (a prefix hit)."""
        if seq_id in self._slot or seq_id in self._cpu_slot:
            raise ValueError(f"seq_id {seq_id!r} already holds a state slot")
        if checkpoint is not None and checkpoint not in self._ckpt:
            raise ValueError(f"no state checkpoint {checkpoint!r} (evicted since the match?)")
        if not self._free:
            raise NoFreeSlotsError(f"no free state slot ({self.num_slots} in use)")
        slot = self._free.pop()
        self._slot[seq_id] = slot
        if checkpoint is None:
            self._write(slot, _ZERO)
        else:
            source = self._ckpt[checkpoint]
            self._ckpt.move_to_end(checkpoint)
            self._write(slot, source)
            self._pinned.add(source)
            self.checkpoint_hits += 1
        return slot

    def fork(self, parent_id: Hashable, child_id: Hashable) -> int:
        """A slot for `child_id` holding a copy of `parent_id`'s state (parallel samples, beams)."""
        if parent_id not in self._slot:
            raise ValueError(f"parent_id {parent_id!r} holds no resident state slot")
        if child_id in self._slot or child_id in self._cpu_slot:
            raise ValueError(f"child_id {child_id!r} already holds a state slot")
        if not self._free:
            raise NoFreeSlotsError(f"no free state slot to fork {parent_id!r} ({self.num_slots} in use)")
        slot = self._free.pop()
        self._slot[child_id] = slot
        self._write(slot, self._slot[parent_id])
        return slot

    def free(self, seq_id: Hashable) -> None:
        """Give the sequence's slot back (finished, aborted, preempted by recompute); unknown ids are ignored."""
        slot = self._slot.pop(seq_id, None)
        if slot is not None:
            self._forget_writes(slot)
            self._free.append(slot)
            return
        cpu = self._cpu_slot.pop(seq_id, None)
        if cpu is not None:
            self._cpu_free.append(cpu)

    def grow(self, num_slots: int) -> None:
        """More sequence slots (the drop-in cache's batch grew); only without checkpoints, whose ids follow them."""
        if num_slots <= self.num_slots:
            return
        if self.num_checkpoints:
            raise ValueError("a StateSlots with checkpoints cannot grow")
        self._free[:0] = range(num_slots - 1, self.num_slots - 1, -1)  # taken after the free ids below them
        self.num_slots = num_slots
        self.scratch = num_slots

    def reset(self) -> None:
        """Forget every sequence and checkpoint (nothing pending)."""
        self.__init__(self.num_slots, self.num_cpu_slots, self.num_checkpoints)

    # ------------------------------------------------------------------ swapping
    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        return sum(1 for s in seq_ids if s in self._slot) <= len(self._cpu_free)

    def swap_out(self, seq_ids: Iterable[Hashable]) -> None:
        """Move the sequences' states to CPU slots (all or nothing; `num_cpu_free` of them must be free)."""
        ids = [s for s in seq_ids if s in self._slot]
        if len(ids) > len(self._cpu_free):
            raise NoFreeSlotsError(f"swap-out of {len(ids)} states needs as many free CPU slots, "
                                   f"{len(self._cpu_free)} are free")
        for seq_id in ids:
            slot = self._slot.pop(seq_id)
            source = self._source(slot)
            self._forget_writes(slot)
            cpu = self._cpu_free.pop()
            self._cpu_slot[seq_id] = cpu
            self._swap_out.append((source, cpu))
            self._free.append(slot)

    def swap_in(self, seq_ids: Iterable[Hashable]) -> None:
        """Bring swapped-out sequences' states back into GPU slots (all or nothing)."""
        ids = [s for s in seq_ids if s in self._cpu_slot]
        if len(ids) > len(self._free):
            raise NoFreeSlotsError(f"swap-in of {len(ids)} states needs as many free slots, {len(self._free)} are free")
        for seq_id in ids:
            cpu = self._cpu_slot.pop(seq_id)
            slot = self._free.pop()
            self._slot[seq_id] = slot
            self._writes.pop(slot, None)
            self._swap_in[slot] = cpu
            self._cpu_released.append(cpu)

    # ------------------------------------------------------------------ checkpoints (prefix caching)
    def has_checkpoint(self, key: Hashable) -> bool:
        return key in self._ckpt

    def save_checkpoint(self, seq_id: Hashable, key: Hashable) -> bool:
        """Keep a copy of the sequence's current state (its state after the last forward) under `key`.

        Evicts the least recently used checkpoint when all are taken (never one a pending restore reads); returns
        False when there is no room (no checkpoint slots, or every one pinned) or the key is already kept."""
        if self.num_checkpoints == 0 or seq_id not in self._slot:
            return False
        if key in self._ckpt:
            self._ckpt.move_to_end(key)
            return False
        if not self._ckpt_free:
            victim = next((k for k, s in self._ckpt.items() if s not in self._pinned), None)
            if victim is None:
                return False
            self._drop_checkpoint(victim)
            self.checkpoint_evictions += 1
        slot = self._ckpt_free.pop()
        self._ckpt[key] = slot
        self._ckpt_key[slot] = key
        self._write(slot, self._slot[seq_id])
        self.checkpoints_saved += 1
        return True

    def _drop_checkpoint(self, key: Hashable) -> None:
        slot = self._ckpt.pop(key)
        del self._ckpt_key[slot]
        self._forget_writes(slot)
        self._ckpt_free.append(slot)

    def drop_checkpoints(self) -> int:
        """Forget every checkpoint (the weights changed); returns how many. Pinned ones stay until their restore ran."""
        keys = [k for k, s in self._ckpt.items() if s not in self._pinned]
        for key in keys:
            self._drop_checkpoint(key)
        return len(keys)
