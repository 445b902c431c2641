"""The rows of consecutive pipelined decode steps of the same sequences, kept from one step to the next.

Why: a busy engine's pipelined decode step schedules the same sequences as the step before, each one token further.
Done per sequence through the general path, that was most of the step's host work at 256 running requests:
checking every group, reserving every slot, building every `ScheduledSeq`, looking for prefix-cache blocks to commit.
`DecodeBatch` keeps the rows between steps (positions, last blocks, slots; plain lists: `core` is pure Python) and
advances them by one. Only the rows whose next token starts a new block (one in `block_size`) take the per-sequence
path: commit the block just filled, allocate the next one. The `ScheduledSeq` items of the step before last are
updated in place and reused: that step is applied by then, and nothing holds its items any more.

It is valid while the scheduler's running groups are exactly its groups, each with its one plain sequence, and the
scheduler ran no general `schedule()` since. Every other change to those sequences (a stop, an abort, a failure, a
preemption) removes a group from the running list, or goes through `schedule()`, and drops the batch.
`Scheduler.schedule_decode_step` builds it from a step scheduled the general way. Its reservations equal
`BlockManager.append_decode_slots`' (`tests/test_decode_batch.py` compares every step).
"""

from __future__ import annotations

from .sequence import SequenceStatus

__all__ = ["DecodeBatch"]


class DecodeBatch:
    """The running single-sequence groups of the last pipelined decode step, with its rows in lists."""

    __slots__ = ("groups", "seqs", "records_", "seq_ids", "specs", "starts", "slots", "last_blocks", "headroom",
                 "items", "spare", "same_rows", "eos", "limits", "token_stops_only")

    def __init__(self, groups: list, items: list, records: list) -> None:
        self.groups = list(groups)  # == scheduler.running while the batch is valid
        self.seqs = [item.seq for item in items]
        self.records_ = records  # the block manager's records of `seqs`, in order
        self.seq_ids = [seq.seq_id for seq in self.seqs]  # one list for every step: the runner compares it by identity
        self.specs = [group.data.get("device_params") for group in self.groups]  # one list too (`DevicePicker`)
        self.starts = [item.start for item in items]  # the last step's positions
        self.slots = [item.slots[0] for item in items]  # and slots
        self.last_blocks = [record.table[-1] for record in records]
        # steps until the first row reaches its length limit (prompt + max_new_tokens tokens); every row advances by
        # one token a step, so the smallest gap is all there is to track
        self.limits = [seq.prompt_len + group.params.max_new_tokens for seq, group in zip(self.seqs, self.groups)]
        self.headroom = min(limit - item.start for limit, item in zip(self.limits, items))
        # what stops a row, for `PipelinedDecode._apply`: its EOS ids and its length limit, unless some row also has
        # stop strings or stopping criteria (then every token goes through the engine's full stop check)
        self.eos = [group.params.eos_token_id for group in self.groups]
        self.token_stops_only = not any(group.params.stop_strings or group.params.stopping_criteria
                                        for group in self.groups)
        self.items = items  # the last step's ScheduledSeq items
        self.spare: list | None = None  # the items of the step before it (applied: free to reuse)
        self.same_rows = list(range(len(items)))  # row k of a step is row k of the step before

    @staticmethod
    def records(groups: list, items: list, block_manager) -> list | None:
        """The block manager's records of `items` if the step can seed a batch: one item per running group, each
        group one plain running sequence, each last block that a token will go into private and uncached. Else None.
        (A batch reads and advances the block manager's records directly: it is that manager's batched decode
        reservation, kept apart because it lives across steps.)"""
        if len(items) != len(groups):
            return None
        running = SequenceStatus.RUNNING
        seqs = block_manager._seqs
        refs = block_manager.gpu._ref
        entry_of = getattr(block_manager.gpu, "_entry_of", None) if block_manager.enable_prefix_caching else None
        mask = block_manager._mask
        records = []
        for group, item in zip(groups, items):
            seq = item.seq
            if item.group is not group or len(group.seqs) != 1 or not group.plain or seq.status is not running:
                return None
            record = seqs.get(seq.seq_id)
            if record is None or record.swapped or record.num_tokens != item.start + 1 or record.released:
                return None
            if record.num_tokens & mask:  # the next token goes into this block: it must be this sequence's alone
                last = record.table[-1]
                if refs[last] != 1 or (entry_of is not None and entry_of[last] is not None):
                    return None
            records.append(record)
        return records

    def finishing(self) -> bool:
        """Whether the step after the last one reaches some row's length limit: the engine then leaves that row's
        group out of it (what `PipelinedDecode._schedule_next` computes per row otherwise)."""
        return self.headroom <= 2

    def offsets(self) -> list[int]:
        """Where each row of the last step draws its token (`device_sampling.offset`): its sequence's length then
        (one past its position), sample index 0 (one sequence per group)."""
        return [start + 1 for start in self.starts]

    def advance(self, block_manager) -> tuple[list, list[int]] | None:
        """Reserve the next slot of every row, one token each, as `BlockManager.append_decode_slots` would. Return
        `(items, fresh)`: the step's items and the rows whose table gained a block. Return None, with nothing
        reserved, when the pool cannot hold the new blocks.

        This repeats what `BlockManager._append_one_each` does for rows like these (allocate, slot, length) in the
        loop that also updates the items: through that method the step took a second pass over the rows, 40 us of
        host work at 256 rows (0.26 -> 0.30 ms on the CPU sandbox). `tests/test_decode_batch.py` checks that every
        step reserves the slots and blocks that the per-sequence path does."""
        mask, shift = block_manager._mask, block_manager._shift
        starts = [start + 1 for start in self.starts]
        fresh = [row for row, start in enumerate(starts) if not start & mask]  # tokens that open a new block
        gpu = block_manager.gpu
        if len(fresh) > gpu.num_free:
            return None
        records, last_blocks = self.records_, self.last_blocks
        if fresh:
            caching = block_manager.enable_prefix_caching
            allocate = gpu.allocate
            for row in fresh:
                if caching:  # the block before this one is computed now: key it, as `append_decode_slots` does
                    seq = self.seqs[row]
                    block_manager.commit(seq.seq_id, seq.token_ids, starts[row])
                block = allocate()
                records[row].table.append(block)
                last_blocks[row] = block
            block_manager._num_logical += len(fresh)
        items = self.spare
        if items is None:
            items = [type(item)(item.seq, item.group, 0, 1, [0]) for item in self.items]
        slots = []
        for item, record, start, block in zip(items, records, starts, last_blocks):
            slot = (block << shift) | (start & mask)
            record.num_tokens = start + 1
            item.start = start
            item.slots[0] = slot
            slots.append(slot)
        self.spare, self.items = self.items, items
        self.starts, self.slots = starts, slots
        self.headroom -= 1
        return items, fresh
