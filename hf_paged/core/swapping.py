"""Swapping a sequence group's blocks between the GPU pool and the CPU pool (PagedAttention §4.5), as a mixin of
`BlockManager`: all or nothing, keeping the sharing inside the group. Pure Python; returns the block pairs the tensor
side copies.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from .block_pool import BlockAllocator, NoFreeBlocksError, _as_int
from .seq_blocks import _Seq

__all__ = ["Swapping"]


class Swapping:
    """Swap-out / swap-in of whole sequence groups; mixed into `BlockManager` (uses its `_seqs`, `gpu`, `cpu`)."""

    @staticmethod
    def _ids(seq_ids: Iterable[Hashable]) -> list:
        if isinstance(seq_ids, (str, bytes)):
            raise TypeError(f"seq_ids must be a collection of sequence ids, got the single string {seq_ids!r}")
        return list(seq_ids)

    def _group(self, seq_ids: Iterable[Hashable], swapped: bool, action: str) -> list[_Seq]:
        """Validate a sequence group for a swap: known, distinct, all on the expected device."""
        ids = self._ids(seq_ids)
        seqs = []
        seen = set()
        for seq_id in ids:
            seq = self._get(seq_id, "seq_ids entry")
            if seq_id in seen:
                raise ValueError(f"seq_ids lists {seq_id!r} twice")
            seen.add(seq_id)
            if seq.swapped != swapped:
                state = "already swapped out" if seq.swapped else "not swapped out"
                raise ValueError(f"seq_ids entry {seq_id!r} is {state}; cannot {action}")
            seqs.append(seq)
        return seqs

    @staticmethod
    def _distinct_blocks(seqs: list[_Seq]) -> dict[int, int]:
        """Block id -> number of group tables holding it, in first-appearance order (a shared block moves once)."""
        counts: dict[int, int] = {}
        for seq in seqs:
            for block in seq.held():  # released entries (sliding window) hold nothing and do not move
                counts[block] = counts.get(block, 0) + 1
        return counts

    def _move(self, seqs: list[_Seq], src: BlockAllocator, dst: BlockAllocator, to_cpu: bool) -> list[tuple[int, int]]:
        """Move a validated group's blocks from ``src`` to ``dst``, preserving sharing within the group.

        A block also held by tables outside the group stays allocated in ``src`` for them (only the group's
        references are dropped); the group gets its own copy in ``dst``.
        """
        counts = self._distinct_blocks(seqs)
        if len(counts) > dst.num_free:
            where = "CPU" if to_cpu else "GPU"
            raise NoFreeBlocksError(f"swap needs {len(counts)} free {where} blocks, only {dst.num_free} are free")
        mapping: dict[int, int] = {}
        for block, count in counts.items():
            new = dst.allocate()
            for _ in range(count - 1):
                dst.incref(new)
            mapping[block] = new
        for seq in seqs:
            held = seq.held()
            for block in held:
                src.decref(block)
            seq.table[seq.released:] = [mapping[block] for block in held]
            seq.swapped = to_cpu
            self._num_logical += -len(held) if to_cpu else len(held)
        return list(mapping.items())


    # ------------------------------------------------------------------ swapping (§4.5)

    def blocks_needed_to_swap_out(self, seq_ids: Iterable[Hashable]) -> int:
        """CPU blocks :meth:`swap_out` of this group would take (blocks shared inside the group count once)."""
        return len(self._distinct_blocks(self._group(seq_ids, swapped=False, action="swap out")))

    def blocks_needed_to_swap_in(self, seq_ids: Iterable[Hashable]) -> int:
        """GPU blocks :meth:`swap_in` of this group would take (exact count, no headroom for the next token)."""
        return len(self._distinct_blocks(self._group(seq_ids, swapped=True, action="swap in")))

    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        """Whether the CPU pool can take the whole group now (and the CPU state slots its recurrent states)."""
        ids = self._ids(seq_ids)
        if self.state is not None and not self.state.can_swap_out(ids):
            return False
        return self.blocks_needed_to_swap_out(ids) <= self.cpu.num_free

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Move a resident sequence group to the CPU pool, all or nothing.

        Returns the ``(gpu_block, cpu_block)`` pairs to copy; the caller must copy them before the freed GPU blocks
        are written again (i.e. before the next step's writes). Blocks shared inside the group move once and stay
        shared on the CPU.
        """
        ids = self._ids(seq_ids)
        seqs = self._group(ids, swapped=False, action="swap out")
        if self.state is not None and not self.state.can_swap_out(ids):
            raise NoFreeBlocksError(f"swap-out of {len(ids)} recurrent states needs as many free CPU state slots, "
                                    f"{self.state.num_cpu_free} are free")
        pairs = self._move(seqs, self.gpu, self.cpu, to_cpu=True)
        if self.state is not None:
            self.state.swap_out(ids)
        return pairs

    def blocks_needed_to_swap_in_and_append(self, requests: Iterable[tuple[Hashable, int]]) -> int:
        """Exact GPU blocks that :meth:`swap_in` of a swapped group and then :meth:`append_slots` of each
        ``(seq_id, num_new_tokens)`` take: the group's distinct blocks plus its new blocks and copy-on-writes.

        A swapped group shares CPU blocks only inside itself and :meth:`swap_in` keeps that sharing, so the append
        plan read off the CPU tables is the plan the sequences will have on the GPU.
        """
        pairs = [(seq_id, _as_int("num_new_tokens", k, 0)) for seq_id, k in requests]
        seqs = self._group([seq_id for seq_id, _ in pairs], swapped=True, action="swap in")
        appends = self._count_appends([(seq_id, seq, k) for (seq_id, k), seq in zip(pairs, seqs)], self.cpu)
        return len(self._distinct_blocks(seqs)) + appends

    def can_swap_in(self, seq_ids: Iterable[Hashable]) -> bool:
        """Whether the GPU pool can take the whole group back now (exact block count, no headroom; and a free
        state slot for each recurrent state)."""
        ids = self._ids(seq_ids)
        if self.state is not None and len(ids) > self.state.num_free:
            return False
        return self.blocks_needed_to_swap_in(ids) <= self.gpu.num_free

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Move a swapped sequence group back to the GPU pool, all or nothing; returns ``(cpu_block, gpu_block)``.

        Swap a group back with the same grouping it was swapped out with: sharing is only preserved inside a group.
        """
        ids = self._ids(seq_ids)
        seqs = self._group(ids, swapped=True, action="swap in")
        if self.state is not None and len(ids) > self.state.num_free:
            raise NoFreeBlocksError(f"swap-in of {len(ids)} recurrent states needs as many free state slots, "
                                    f"{self.state.num_free} are free")
        pairs = self._move(seqs, self.cpu, self.gpu, to_cpu=False)
        if self.state is not None:
            self.state.swap_in(ids)
        return pairs
