"""The rows of consecutive pipelined decode steps of the same sequences, kept from one step to the next.

Why: a busy engine's pipelined decode step schedules the same sequences as the step before, each one token further.
Done per sequence through the general path, that was most of the step's host work at 256 running requests:
checking every group, reserving every slot, building every `ScheduledSeq`, looking for prefix-cache blocks to commit.
`DecodeBatch` keeps the rows between steps and advances them by one. Its positions, last blocks and slots are numpy
arrays, so a step's advance is a few array operations plus one store per row into the block manager's records; the
runner copies the arrays into its upload buffers without a conversion. (`core` never imports torch; numpy, a
dependency of the package, is imported when the first batch is built, so the block manager alone needs neither.)
Only the rows whose next token starts a new block (one in `block_size`) take the per-sequence path: commit the block
just filled, allocate the next one.

A step's items are `BatchRow`s: the `ScheduledSeq` view of one row, reading its position and slot from the step's
arrays. Two sets of items alternate, one per step in flight (the step before last is applied by the time its arrays
are overwritten), so an advance touches no item.

Each row has one block table per *lane* (`_Lane`): the block manager's own table, or, for a
`GroupedBlockManager` (block groups of a mixed sliding / full stack), one table per layer group, all holding the same
tokens, so a row opens a block in every lane at the same step. A lane with a sliding window gives back the blocks
that fall wholly out of it as the rows advance (what `Scheduler._release_out_of_window` does each general step: an
array comparison finds the rows that crossed a block, one in `block_size` steps). So models whose layers slide keep
the fast path.

It is valid while the scheduler's running groups are exactly its groups, each with its one plain sequence (or
`masked`: plain but for a grammar's token mask, which the engine keeps), the scheduler's release window is the one
it was built with, and the scheduler ran no general `schedule()` since. Every other change to those sequences (a
stop, an abort, a failure, a preemption) removes a group from the running list, or goes through `schedule()`, and
drops the batch; except a stop, which only removes the row (`remove`), and a request finishing by length, whose row
leaves before the step that would pass its limit.
`Scheduler.schedule_decode_step` builds it from a step scheduled the general way. Its reservations equal
`BlockManager.append_decode_slots`' (`tests/test_decode_batch.py` compares every step).

The decode hot path without a batch (non-pipelined steps, and the step that builds one). The common step of a busy
engine is "every running sequence decodes one token", and its host cost is kept O(batch) with small constants (a CPU
profile of 256 requests went from ~8 ms to ~0.6 ms a step before this batch took it further):

* `Scheduler._schedule_decodes`: when every live sequence of every running group has exactly one token to compute
  and the budgets hold them, one `BlockManager.append_decode_slots` call reserves all the slots (copy-on-write of
  shared partial last blocks included, counted as the per-sequence path counts them), all or nothing. Otherwise (no
  room, a cached partial block after a truncate) nothing is reserved and the per-group loop runs, with preemption. A
  lockstep test checks that both paths decide every step identically. The batched reservation reports which tables
  changed (`AppendResult.changed`, `SchedulerOutput.table_changes`), so the runner uploads only those.
* `BlockManager.usage()` is O(1) (a logical-block counter every operation keeps; the property tests compare it with
  the full scan of `stats()`), and `table_view()` returns a table without copying it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .sequence import SequenceStatus

if TYPE_CHECKING:
    import numpy as np

__all__ = ["BatchRow", "DecodeBatch", "StepRows"]


class _Due:
    """A row whose window lane releases blocks now, as `SlidingWindow.release_out_of_window` reads a sequence."""

    __slots__ = ("num_computed", "seq_id", "token_ids")

    def __init__(self, seq_id, num_computed: int, token_ids) -> None:
        self.seq_id, self.num_computed, self.token_ids = seq_id, num_computed, token_ids


class _Lane:
    """One block table of every row: `manager`'s records (`records`, in row order), the last block of each and the
    step's slots in it, and, for a lane with a sliding `window`, the blocks each table has released (`released`).
    `group` is the layer group of a `GroupedBlockManager` lane (its records are the inner manager's `(seq_id,
    group)` sub-sequences), None for a manager's own table."""

    __slots__ = ("group", "last_blocks", "manager", "records", "released", "slots", "window")

    def __init__(self, manager, group: int | None, window: int | None, records: list, starts) -> None:
        import numpy as np

        self.manager, self.group, self.window, self.records = manager, group, window, records
        n = len(records)
        self.last_blocks = np.fromiter((record.table[-1] for record in records), np.int64, n)
        # the slots of the tokens at `starts` (each the last token its table holds)
        self.slots = (self.last_blocks << manager._shift) | (starts & manager._mask)
        self.released = None if window is None else np.fromiter((r.released for r in records), np.int64, n)

    def keep(self, rows) -> None:
        """Only rows `rows` stay (`DecodeBatch.remove`)."""
        self.records = [self.records[k] for k in rows.tolist()]
        self.last_blocks, self.slots = self.last_blocks[rows], self.slots[rows]
        if self.released is not None:
            self.released = self.released[rows]

    def release(self, starts, seqs: list) -> None:
        """Give back what falls out of the window once the rows compute positions `starts`: the blocks wholly before
        `starts - window + 1`, the oldest key the step's queries read (committed first with prefix caching). Only
        rows that crossed a block since do any work."""
        import numpy as np

        due = np.flatnonzero(((starts - (self.window - 1)) >> self.manager._shift) > self.released).tolist()
        if not due:
            return
        group, records = self.group, self.records
        self.manager.release_out_of_window(
            [_Due(seqs[k].seq_id if group is None else (seqs[k].seq_id, group), int(starts[k]), seqs[k].token_ids)
             for k in due], self.window)
        self.released[due] = [records[k].released for k in due]

    def extend(self, fresh: list[int], starts, offsets, seqs: list, lengths: list[int]) -> None:
        """Reserve the next slot of every row (`DecodeBatch.advance`, once the pool is known to hold the new
        blocks): the rows `fresh` open a block, after keying the block they just filled; each table then holds
        `lengths` tokens."""
        manager, records, last_blocks = self.manager, self.records, self.last_blocks
        if fresh:
            if manager.enable_prefix_caching:
                manager.commit_rows([records[row] for row in fresh], [seqs[row].token_ids for row in fresh],
                                    starts[fresh].tolist())
            blocks = manager.gpu.allocate_many(len(fresh))  # (the blocks `allocate` would give, in its order)
            for row, block in zip(fresh, blocks):
                records[row].table.append(block)
            last_blocks[fresh] = blocks
            manager._num_logical += len(fresh)
        self.slots = (last_blocks << manager._shift) | offsets
        for record, length in zip(records, lengths):
            record.num_tokens = length


class StepRows:
    """One step of a `DecodeBatch`: each row's position (`starts`) and slot, the step's number, and what applying it
    reads: the batch's row lists as they were then (`seqs`, `seq_ids`, `groups`, `eos`, `last_starts`; a removal
    replaces the batch's lists, never changes them), its `generation` (removals that void a step in flight), and
    `source`, the row of each of its sequences in the step before (whose picks are its input ids, and whose store
    rows are its own)."""

    __slots__ = ("eos", "generation", "groups", "last_starts", "number", "seq_ids", "seqs", "slots", "source",
                 "starts")

    def __init__(self, batch: DecodeBatch, number: int) -> None:
        self.take(batch, number)

    def take(self, batch: DecodeBatch, number: int) -> None:
        self.starts, self.slots, self.number = batch.starts, batch.slots, number
        self.seqs, self.groups, self.eos, self.last_starts = batch.seqs, batch.groups, batch.eos, batch.last_starts
        self.seq_ids = batch.seq_ids  # the list the runner got for this step (it knows its rows by that list)
        self.generation, self.source = batch.generation, batch.same_rows


class BatchRow:
    """Row `k` of a `DecodeBatch` step, read as the `ScheduledSeq` it stands for: one token of `seq` at `start`.

    The general paths (a failed step, the eager fallback, the tests) read these fields; the hot path reads the
    step's arrays directly."""

    __slots__ = ("_k", "_step", "group", "seq")
    num_tokens = 1

    def __init__(self, seq, group, step: StepRows, k: int) -> None:
        self.seq, self.group, self._step, self._k = seq, group, step, k

    @property
    def start(self) -> int:
        return int(self._step.starts[self._k])

    @property
    def slots(self) -> list[int]:
        return [int(self._step.slots[self._k])]

    @property
    def sample(self) -> bool:
        return self.start + 1 == self.seq.num_tokens

    def __repr__(self) -> str:
        return f"BatchRow(seq_id={self.seq.seq_id!r}, start={self.start}, slot={self.slots[0]})"


class DecodeBatch:
    """The running single-sequence groups of the last pipelined decode step, with its rows in arrays."""

    __slots__ = ("groups", "group_ids", "seqs", "lanes", "release_window", "seq_ids", "specs", "starts", "slots",
                 "headroom", "items", "steps", "same_rows", "eos", "eos_ids", "last_starts", "token_stops_only",
                 "number", "generation", "identity")

    def __init__(self, groups: list, items: list, records: list[list], block_manager,
                 release_window: int | None = None) -> None:
        """`records`: `DecodeBatch.records(groups, items, block_manager)`; `release_window`: the scheduler's
        (`Scheduler.release_window`: None while nothing is released out of a window)."""
        self.groups = list(groups)  # == scheduler.running while the batch is valid
        self.group_ids = {id(group) for group in self.groups}  # (whether a finished group is one of its rows)
        self.seqs = [item.seq for item in items]
        self.seq_ids = [seq.seq_id for seq in self.seqs]  # one list for every step: the runner compares it by identity
        self.specs = [group.data.get("device_params") for group in self.groups]  # one list too (`DevicePicker`)
        import numpy as np  # (see the module docstring)

        n = len(items)
        starts = np.fromiter((item.start for item in items), np.int64, n)  # the last step's positions
        self.release_window = release_window
        if getattr(block_manager, "grouped", False):  # one lane per layer group, each with its own window
            releasing = release_window is not None and block_manager.releasing
            self.lanes = [_Lane(block_manager.inner, g, window if releasing else None, lane, starts)
                          for g, (window, lane) in enumerate(zip(block_manager.windows, records))]
        else:
            self.lanes = [_Lane(block_manager, None, release_window, records[0], starts)]
        # a step's length limit per row (prompt + max_new_tokens tokens); every row advances by one token a step, so
        # the smallest gap is all there is to track for `finishing`
        limits = np.fromiter((seq.prompt_len + group.params.max_new_tokens
                              for seq, group in zip(self.seqs, self.groups)), np.int64, n)
        self.headroom = int((limits - starts).min()) if n else 0
        # a row whose step starts here or later gives the token that reaches its length limit (its position + 2)
        self.last_starts = limits - 2
        # what stops a row, for `PipelinedDecode._apply`: its EOS ids and its length limit, unless some row also has
        # stop strings or stopping criteria (then every token goes through the engine's full stop check)
        self.eos = [group.params.eos_token_id for group in self.groups]
        first = self.eos[0] if self.eos else ()
        # the EOS ids of every row when all rows share them (requests of one model usually do), else None
        self.eos_ids = list(first) if all(eos == first for eos in self.eos) else None
        self.token_stops_only = not any(group.params.stop_strings or group.params.stopping_criteria
                                        for group in self.groups)
        # the step this batch was seeded from is step 0; its items stay the scheduler's, the batch's own steps
        # alternate between two sets of rows (`BatchRow`), each set reading its own arrays
        self.number = self.generation = 0
        self.starts, self.slots = starts, self.lanes[0].slots
        # row k of a step is row k of the step before, unless rows were removed in between (then `remove` says)
        self.same_rows = self.identity = np.arange(n, dtype=np.int64)
        self.steps = [StepRows(self, 0), StepRows(self, -1)]
        self.items: list[list[BatchRow] | None] = [None, None]  # made at the first step of each set

    @staticmethod
    def records(groups: list, items: list, block_manager) -> list[list] | None:
        """The block manager's records of `items`, one list per lane (a `GroupedBlockManager`: one per layer group,
        its inner manager's), if the step can seed a batch: one item per running group, each group one plain (or
        masked) running sequence, each last block that a token will go into private and uncached. Else None.
        (A batch reads and advances the block manager's records directly: it is that manager's batched decode
        reservation, kept apart because it lives across steps.)"""
        if not items or len(items) != len(groups):
            return None
        running = SequenceStatus.RUNNING
        for group, item in zip(groups, items):
            if item.group is not group or len(group.seqs) != 1 or not (group.plain or group.masked) \
                    or item.seq.status is not running:
                return None
        if getattr(block_manager, "grouped", False):
            inner = block_manager.inner
            return [DecodeBatch._lane_records(inner, [(item.seq.seq_id, g) for item in items], items)
                    for g in range(block_manager.num_groups)]
        lane = DecodeBatch._lane_records(block_manager, [item.seq.seq_id for item in items], items)
        return None if lane is None else [lane]

    @staticmethod
    def _lane_records(manager, keys: list, items: list) -> list | None:
        """`manager`'s records of `keys` (the rows' sequences, or their sub-sequences in one layer group), if every
        one is resident, at the step's length, and writes its next token into a block of its own."""
        seqs = manager._seqs
        refs = manager.gpu._ref
        entry_of = getattr(manager.gpu, "_entry_of", None) if manager.enable_prefix_caching else None
        mask = manager._mask
        records = []
        for key, item in zip(keys, items):
            record = seqs.get(key)
            if record is None or record.swapped or record.num_tokens != item.start + 1:
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

    def finishing_groups(self) -> set[int]:
        """The `id()`s of the groups whose row in the last step gives the token that reaches their length limit: the
        step after it leaves them out (`Scheduler.schedule_decode_step`'s `skip`)."""
        import numpy as np

        groups = self.groups
        return {id(groups[k]) for k in np.flatnonzero(self.starts >= self.last_starts).tolist()}

    def offsets(self) -> np.ndarray:
        """Where each row of the last step draws its token (`device_sampling.offset`): its sequence's length then
        (one past its position), sample index 0 (one sequence per group)."""
        return self.starts + 1

    def rows_of(self, number: int) -> StepRows | None:
        """The arrays of the batch's step `number`, while they are kept (the last two steps)."""
        for step in self.steps:
            if step.number == number:
                return step
        return None

    def remove(self, gone: set[int], voids_in_flight: bool = True) -> bool:
        """Drop the rows of the groups whose `id()` is in `gone`, so the others keep their batch. Returns False,
        changing nothing, when no row would be left.

        Two reasons, both leaving the step in flight (scheduled before) with the gone rows: it keeps the row lists and
        arrays it was scheduled with (`StepRows`), and the next step's input ids come from its rows (`same_rows`).
        * The groups finished (a stop; the scheduler frees them now): their tokens in the step in flight are void.
          That step's older `generation` makes `PipelinedDecode._apply` take it row by row (`_apply_batch` skips the
          finished rows).
        * `voids_in_flight=False`: the step in flight gives their last token (they reach their length limit with it)
          and the step being scheduled leaves them out. That step is applied like any other: the generation stays."""
        keep = [k for k, group in enumerate(self.groups) if id(group) not in gone]
        if not keep:
            return False
        import numpy as np

        rows = np.asarray(keep, dtype=np.int64)
        self.groups = [self.groups[k] for k in keep]
        self.group_ids = {id(group) for group in self.groups}
        self.seqs = [self.seqs[k] for k in keep]
        for lane in self.lanes:
            lane.keep(rows)
        self.seq_ids = [self.seq_ids[k] for k in keep]
        self.specs = [self.specs[k] for k in keep]
        self.eos = [self.eos[k] for k in keep]  # (`token_stops_only` holds for any subset of rows, and shared EOS ids)
        if self.eos_ids is None:  # the rows left may share their EOS ids
            first = self.eos[0]
            self.eos_ids = list(first) if all(eos == first for eos in self.eos) else None
        self.starts, self.slots = self.starts[rows], self.lanes[0].slots
        self.last_starts = self.last_starts[rows]
        self.headroom = int((self.last_starts + 2 - self.starts).min())
        self.identity = np.arange(len(keep), dtype=np.int64)
        self.same_rows = self.same_rows[rows]  # (composed: two removals before a step would both count)
        if voids_in_flight:
            self.generation += 1
        self.items = [None, None]
        return True

    def group_slots(self) -> list:
        """The slots of the last step's tokens in every layer group but the first (a grouped manager's lanes)."""
        return [lane.slots for lane in self.lanes[1:]]

    def group_last_blocks(self) -> list:
        """The last block of every row's table in every layer group but the first."""
        return [lane.last_blocks for lane in self.lanes[1:]]

    def advance(self) -> tuple[list, list[int]] | None:
        """Reserve the next slot of every row, one token each, as `BlockManager.append_decode_slots` would (in every
        lane), after releasing what the rows' windows no longer read, as the scheduler's general step does first.
        Return `(items, fresh)`: the step's items and the rows whose tables gained a block. Return None, with
        nothing reserved, when the pool cannot hold the new blocks. (The lanes hold the block manager's records: the
        one the batch was built on.)

        This repeats what `BlockManager._append_one_each` does for rows like these (allocate, slot, length), on the
        arrays; `tests/test_decode_batch.py` checks that every step reserves the slots and blocks, and releases the
        blocks, that the per-sequence path does."""
        lanes = self.lanes
        mask = lanes[0].manager._mask
        starts = self.starts + 1
        for lane in lanes:
            if lane.window is not None:
                lane.release(starts, self.seqs)
        offsets = starts & mask
        fresh = [] if offsets.all() else (offsets == 0).nonzero()[0].tolist()  # tokens that open a new block
        if len(fresh) * len(lanes) > lanes[0].manager.gpu.num_free:
            return None
        lengths = (starts + 1).tolist()
        for lane in lanes:
            lane.extend(fresh, starts, offsets, self.seqs, lengths)
        self.number += 1
        self.starts, self.slots = starts, lanes[0].slots
        step = self.steps[self.number & 1]
        step.take(self, self.number)
        self.same_rows = self.identity
        self.headroom -= 1
        items = self.items[self.number & 1]
        if items is None:
            items = self.items[self.number & 1] = [BatchRow(seq, group, step, k) for k, (seq, group)
                                                   in enumerate(zip(self.seqs, self.groups))]
        return items, fresh
