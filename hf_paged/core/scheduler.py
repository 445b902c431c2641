"""Iteration-level FCFS scheduler (PagedAttention paper §4.5, Orca) — pure Python, no torch.

Every call to `schedule()` decides one engine step:

1. Running groups, oldest first, get their next tokens (one per decoding sequence, or the next prompt chunk). When
   the pool cannot hold them, the *latest-arrived* running group is preempted, all or nothing, by recompute (its
   blocks are freed and it goes back to the waiting queue) or by swap (its blocks move to the CPU pool). The oldest
   requests therefore always make progress.
2. Swapped groups come back first-come-first-served when nothing was preempted in this step.
3. Waiting groups are admitted first-come-first-served while the token budget, `max_num_seqs` and free blocks allow;
   a prompt longer than the remaining budget is prefilled in chunks over several steps. With `admission_batch` > 1,
   admissions beside running requests wait until that many sequences can come in at once (or all the waiting ones,
   or `admission_max_wait` steps have withheld one): see `admission_due`.

The scheduler reserves the KV slots of every scheduled token (`BlockManager.append_slots`), so the engine only writes.

Prefix caching (when the block manager has it on): the blocks a step's forward fills are keyed
(`BlockManager.commit`) once the engine has launched that forward (`commit_launched`), or else at the start of the
next `schedule()`; so are a sequence's blocks before it is preempted or freed. A waiting sequence is admitted with its
longest cached whole-block prefix mapped by reference (`BlockManager.allocate_prefix`): `num_computed` starts past it
and only the rest is scheduled (at least the last token; a group's `max_cached_prefix` caps the prefix when it needs
the logits of later positions). If the block right after a waiting group's cached prefix is being computed this very
step by a running sequence (same prompt prefix, admitted a step earlier or prefilling in chunks), admission pauses
for a step so that the group hits it instead of computing it a second time.

Sliding windows (`release_window`, set by the engine when every attention layer of the model slides, or for a mixed
stack's `GroupedBlockManager`, which releases each sliding group at its own window): at the start
of every `schedule()` each running sequence gives back the blocks wholly before the oldest key a future query can
attend (`BlockManager.release_before`), after committing them to the prefix cache. The freed blocks count as free
for this very step's decisions, so a long generation holds about `ceil(window / block_size) + 1` blocks. A
pipelined decode step of the persistent batch releases the same blocks as its rows advance (`DecodeBatch.advance`).

The decode hot path (`_schedule_decodes`, the persistent batch of pipelined steps): `hf_paged.core.decode_batch`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

from .admission import AdmissionPolicy
from .block_manager import BlockManager
from .decode_batch import DecodeBatch
from .schedule import ScheduledSeq, SchedulerOutput
from .sequence import Sequence, SequenceGroup, SequenceStatus
from .state_policy import CheckpointPlanner, free_state_slots

__all__ = ["Scheduler"]

PREEMPTION_MODES = ("recompute", "swap")


class Scheduler(AdmissionPolicy):
    """FCFS iteration-level scheduler over sequence groups: admission, decode reservation, preemption.

    Why one class of this size: admission, the batched decode fast path and preemption all decide against one token
    budget and one view of the block pool per step; they are kept together so the lockstep test can compare the fast
    path with the per-group loop on identical state.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        preemption_mode: str = "recompute",
        admission_batch: int = 1,
        admission_max_wait: int = 16,
    ) -> None:
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive int, got {max_num_seqs!r}")
        for name, value, least in (("admission_batch", admission_batch, 1), ("admission_max_wait", admission_max_wait, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be a positive int, got {max_num_batched_tokens!r}")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        if preemption_mode == "swap" and block_manager.num_cpu_blocks == 0:
            raise ValueError("preemption_mode='swap' needs a CPU swap pool (swap_space > 0)")
        self.block_manager = block_manager
        self._batch: DecodeBatch | None = None  # the rows of the pipelined decode steps (`schedule_decode_step`)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.admission_batch = admission_batch
        self.admission_max_wait = admission_max_wait
        self._withheld_steps = 0  # steps in a row that left free room unused for `admission_batch` (see admission_due)
        self._short_of_blocks: tuple[SequenceGroup, int] | None = None  # (head of `waiting`, free blocks it needs)
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.num_preemptions = {"recompute": 0, "swap": 0}
        # the largest sliding window of the model's layers when every layer slides (set by the engine), else None:
        # keys older than it are attended by no future query, so their blocks go back to the pool
        self.release_window: int | None = None
        # keep a little headroom when admitting so a new prompt does not force an immediate preemption
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)
        # a further admission condition of the engine's (LoRA adapters: a free slot), asked of the head of `waiting`
        self.admission_gate: Callable[[SequenceGroup], bool] | None = None

    # ------------------------------------------------------------------ queues
    @staticmethod
    def _insert(queue: list[SequenceGroup], group: SequenceGroup) -> None:
        keys = [g.arrival for g in queue]
        queue.insert(bisect.bisect_right(keys, group.arrival), group)

    def add(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            seq.status = SequenceStatus.WAITING
        self._insert(self.waiting, group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def groups(self) -> list[SequenceGroup]:
        return self.running + self.swapped + self.waiting

    def find(self, request_id) -> SequenceGroup | None:
        for group in self.groups():
            if group.request_id == request_id:
                return group
        return None

    def free_seq(self, seq: Sequence) -> None:
        """Release a sequence's blocks (finished, aborted or failed); its computed full blocks stay cached."""
        bm = self.block_manager
        if bm.has_seq(seq.seq_id):
            if bm.enable_prefix_caching:
                bm.commit(seq.seq_id, seq.token_ids, seq.num_computed)
            bm.free(seq.seq_id)

    def _commit_running(self) -> None:
        """Key the blocks that the last forward filled (their KV is written now)."""
        commit = self.block_manager.commit
        for group in self.running:
            for seq in group.seqs:
                if not seq.status.is_finished:
                    commit(seq.seq_id, seq.token_ids, seq.num_computed)

    def commit_launched(self, out: SchedulerOutput) -> None:
        """Key the blocks that `out`'s forward fills, once that forward is launched, before its tokens are known.

        Why: `schedule()` keys them at the start of the next step otherwise (`_commit_running`), and a prefill step's
        thousand-odd new blocks then cost host time while the GPU sits idle, the step before having ended in a sync.
        Done here, the keying overlaps the forward it follows. The tokens a forward computes were all known when it
        was scheduled, so the keys are those the next `schedule()` would give; whatever reads the blocks runs after
        that forward on its stream. Rows of one token (decodes) are left to the next reservation, which keys them
        (`append_decode_slots`, `_commit_running`): at most one block each, and a decode step has hundreds of rows.
        """
        bm = self.block_manager
        if not bm.enable_prefix_caching or out.decode_step:
            return
        for seq, position in out.state_saves:  # hybrid models: the state at a chunk's end, kept for later prompts
            if not seq.status.is_finished and bm.has_seq(seq.seq_id) and not bm.is_swapped(seq.seq_id):
                bm.save_state_checkpoint(seq.seq_id, seq.token_ids, position)
        commit = bm.commit
        for item in out.scheduled:
            seq = item.seq
            if item.num_tokens > 1 and not seq.status.is_finished and bm.has_seq(seq.seq_id):
                commit(seq.seq_id, seq.token_ids, item.start + item.num_tokens)

    def prepare_admissions(self) -> None:
        """Hash ahead the prompts of the waiting groups the next step may admit (prefix caching on).

        Why: a new prompt's block keys (a 5k-token prompt has ~300) are what admission spends most of its time on,
        and a step that admits prompts is planned while the GPU waits. The engine calls this once a forward is
        launched; `_plan_admission` then hashes only what a sequence holds beyond its prompt (after a recompute).
        Groups are taken in queue order while one step's budgets (tokens, sequences) could still admit them.
        """
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return
        tokens = seqs = 0
        for group in self.waiting:
            if tokens >= self.max_num_batched_tokens or seqs >= self.max_num_seqs:
                break
            for seq in group.seqs:
                if seq.prompt_keys is None and not seq.status.is_finished:
                    seq.prompt_keys = bm.chain_keys(seq.token_ids[: seq.prompt_len], group.cache_salt)
                tokens += seq.num_tokens
                seqs += 1

    def finish_group(self, group: SequenceGroup, status: SequenceStatus) -> None:
        """Mark every live sequence of `group` finished with `status`, free its blocks, drop it from the queues."""
        self._batch = None
        for seq in group.seqs:
            if not seq.status.is_finished:
                seq.status = status
            self.free_seq(seq)
        for queue in (self.running, self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)
        if self._short_of_blocks is not None and self._short_of_blocks[0] is group:
            self._short_of_blocks = None  # (hold no reference to a dropped request)

    def abort(self, request_id) -> SequenceGroup | None:
        group = self.find(request_id)
        if group is not None:
            self.finish_group(group, SequenceStatus.FINISHED_ABORTED)
        return group

    def remove_finished(self, candidates: Iterable[SequenceGroup] | None = None) -> list[SequenceGroup]:
        """Free and drop the finished running groups; only `candidates` are looked at when given (hot path)."""
        done = [g for g in (self.running if candidates is None else candidates) if g.is_finished]
        if done:
            batch = self._batch
            if batch is not None:  # the batch of the others goes on (see `DecodeBatch.remove`)
                gone = {id(g) for g in done} & batch.group_ids
                if gone and not batch.remove(gone):
                    self._batch = None
            for group in done:
                for seq in group.seqs:
                    self.free_seq(seq)
            gone = {id(g) for g in done}
            self.running[:] = [g for g in self.running if id(g) not in gone]
        return done

    def num_running_seqs(self) -> int:
        """Live sequences of the running groups."""
        running = self.running
        batch = self._batch
        if batch is not None and running == batch.groups:  # one sequence each (`DecodeBatch`): no need to look
            return len(running)
        return len(running) + sum(len(g.live_seqs()) - 1 for g in running if len(g.seqs) != 1)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        self._batch = None  # what this step does to the running sequences is not a batch's one-token advance
        admit = self._count_admission()
        out = SchedulerOutput()
        bm = self.block_manager
        budget = [self.max_num_batched_tokens, self.max_num_seqs]
        caching = bm.enable_prefix_caching
        if self.release_window is not None:
            self._release_out_of_window(self.running)
        decoded = self._schedule_decodes(out, budget)
        out.distinct_groups = False  # admissions below may add several rows of one group (swapped-in samples)
        out.table_changes = None  # and change other tables
        if caching and not decoded:
            self._commit_running()

        index = len(self.running) if decoded else 0
        while index < len(self.running):
            group = self.running[index]
            plan = self._plan(group, budget)
            if plan is None:
                break
            needed = bm.blocks_needed_to_append_many((seq.seq_id, n) for seq, n in plan)
            preempted_self = False
            while needed > bm.gpu.num_free:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is group:
                    preempted_self = True
                    break
            if preempted_self:
                break
            self._reserve(group, plan, out, budget)
            index += 1

        if not out.preempted:
            while self.swapped and budget[1] > 0:
                group = self.swapped[0]
                seqs = group.live_seqs()
                plan = self._plan(group, budget)
                if plan is None:
                    break
                # exact: swapping in and running this step must fit (plus headroom only while others run), so a
                # group always comes back once the pool is empty (admission bounded it by the whole pool)
                needed = bm.blocks_needed_to_swap_in_and_append((s.seq_id, n) for s, n in plan)
                if needed + (self.watermark_blocks if self.running else 0) > bm.gpu.num_free:
                    break
                if bm.state is not None and group.max_running_seqs() > free_state_slots(bm, self.running):
                    break
                out.swap_in.extend(bm.swap_in([s.seq_id for s in seqs]))
                self.swapped.pop(0)
                for seq in seqs:
                    seq.status = SequenceStatus.RUNNING
                self._insert(self.running, group)
                self._reserve(group, plan, out, budget)

        if not out.preempted and not self.swapped and admit:
            free_slots = free_state_slots(bm, self.running) if bm.state is not None else None
            planner = None
            if caching and bm.state is not None:  # (hybrid models: prompts hashed now if no launch did it ahead)
                self.prepare_admissions()
                planner = CheckpointPlanner(self.waiting, bm.block_size)
            while self.waiting and budget[0] > 0 and budget[1] > 0:
                group = self.waiting[0]
                if self.admission_gate is not None and not self.admission_gate(group):
                    break
                if free_slots is not None:  # hybrid models: a state slot for every sequence it will run
                    if group.max_running_seqs() > free_slots:
                        break
                    free_slots -= group.max_running_seqs()
                if caching:
                    plan, matches = self._plan_admission(group, budget, planner)
                    if plan is None:
                        break
                else:
                    plan = self._plan(group, budget)
                    if plan is None:
                        break
                    needed = sum(bm.blocks_for(n) for _, n in plan)
                    headroom = self.watermark_blocks if self.running else 0
                    if needed + headroom > bm.gpu.num_free:
                        self._short_of_blocks = (group, needed + headroom)
                        break
                self.waiting.pop(0)
                self._short_of_blocks = None
                # every live sequence gets its table and runs, also one that `_plan` left out of this step (hybrid
                # models: a sample whose last prompt token waits for the group's others): left waiting, it would sit
                # in a running group with no table
                for seq in group.live_seqs():
                    if caching:
                        cached = bm.allocate_prefix(seq.seq_id, seq.token_ids, matches[seq.seq_id])
                        assert cached == seq.num_computed, "prefix match changed during admission"
                        seq.prompt_keys = None  # the record holds them now (a recompute hashes them again)
                    else:
                        bm.allocate(seq.seq_id, 0)
                    seq.status = SequenceStatus.RUNNING
                if caching and bm.state is not None:
                    planner.plan_saves(group, plan, matches)
                    plan = self._plan(group, budget)  # chunks now end at the checkpoints
                self._insert(self.running, group)
                self._reserve(group, plan, out, budget)
        return out

    def schedule_decode_step(self, skip: set[int] = frozenset()) -> SchedulerOutput | None:
        """The next step if it is a batched decode step of every running group but those whose `id()` is in `skip`
        (groups known to finish before it), else None with nothing reserved. For a pipelined engine, which plans a
        step before the previous one's tokens are known; no admission, swap or preemption happens here: None as well
        when an admission is due (one look at the queues per plan). Only a step it returns counts towards
        `admission_max_wait`: after a None the engine plans the same step with `schedule()`, which counts it."""
        due, withheld = self._admission()
        out = None if due else self._decode_step(skip)
        if out is not None:
            self._withheld_steps = self._withheld_steps + 1 if withheld else 0
        return out

    def _decode_step(self, skip: set[int]) -> SchedulerOutput | None:
        """`schedule_decode_step`'s plan, without the admission count."""
        batch = self._batch
        if batch is not None:
            # the same sequences as the last step (see `DecodeBatch` for why that suffices), but those finishing by
            # length in the step in flight, whose rows leave now: advance its rows
            if self.running == batch.groups and batch.release_window == self.release_window and (
                    not skip or (skip <= batch.group_ids and batch.remove(skip, voids_in_flight=False))):
                advanced = batch.advance()
                if advanced is None:
                    return None  # the pool cannot hold the new blocks: nothing was reserved
                items, fresh = advanced
                return SchedulerOutput(scheduled=items, decode_step=True, distinct_groups=True, table_changes=fresh,
                                       batch=batch, batch_step=batch.number)
            self._batch = None
        out = SchedulerOutput()
        budget = [self.max_num_batched_tokens, self.max_num_seqs]
        groups = [g for g in self.running if id(g) not in skip] if skip else self.running
        if self.release_window is not None:
            self._release_out_of_window(groups)
        if not self._schedule_decodes(out, budget, groups):
            return None
        out.decode_step = True
        # seed a batch for the next steps, if this step can
        # (the skipped groups finish when the step before this one is applied: then `running` is `groups`)
        records = DecodeBatch.records(groups, out.scheduled, self.block_manager)
        if records is not None:
            self._batch = out.batch = DecodeBatch(groups, out.scheduled, records, self.block_manager,
                                                  self.release_window)
        return out

    @property
    def decode_batch(self) -> DecodeBatch | None:
        """The batch the next `schedule_decode_step` would advance, if it still applies (see `DecodeBatch`)."""
        return self._batch

    def _release_out_of_window(self, groups: list[SequenceGroup]) -> None:
        """Give back the blocks of running sequences that no future query attends (see `release_window`).

        A query at position p attends keys in (p - W, p] (transformers' sliding mask, and hf_paged's kernels, which
        do not read blocks wholly before it); the oldest future query of a sequence sits at `num_computed`. A
        pipelined step still in flight may read older keys: the blocks it frees are written again only by later
        steps, which run after it on the same stream.
        """
        running = SequenceStatus.RUNNING
        self.block_manager.release_out_of_window(
            (seq for group in groups for seq in group.seqs if seq.status is running), self.release_window)

    def _schedule_decodes(self, out: SchedulerOutput, budget: list[int],
                          running: list[SequenceGroup] | None = None) -> bool:
        """The common step of a busy engine in one pass: every live sequence of every running group decodes one token.

        If so, and the budgets and the pool hold all of them, their slots (and the copy-on-writes of shared partial
        last blocks, e.g. after beam forks) are reserved by one `BlockManager.append_decode_slots` call and True is
        returned. The result equals what the per-group loop of `schedule()` would do (nothing is preempted when
        everything fits), at a fraction of its cost. Otherwise nothing is reserved and False is returned; the
        per-group loop handles the step.
        """
        if running is None:
            running = self.running
        if not running:
            return False
        seqs: list[Sequence] = []
        owners: list[SequenceGroup] = []
        seq_budget = 0
        running_status = SequenceStatus.RUNNING
        distinct = True  # no group gives two rows (no parallel samples running)
        for group in running:
            group_seqs = group.seqs
            if len(group_seqs) == 1:  # most groups: one sequence (its loop spelled out: the hot path)
                seq = group_seqs[0]
                if seq.status is not running_status or len(seq.token_ids) - seq.num_computed != 1:
                    return False
                seqs.append(seq)
                owners.append(group)
                # what _reserve charges: max(len(plan), group.max_running_seqs()) (a group about to fork: its width)
                width = group.width
                seq_budget += width if width > 1 else 1
                continue
            live = group.live_seqs()
            for seq in live:
                if seq.status is not running_status or len(seq.token_ids) - seq.num_computed != 1:
                    return False
                seqs.append(seq)
                owners.append(group)
            distinct = distinct and len(live) <= 1
            seq_budget += len(live)
        if len(seqs) > budget[0] or seq_budget > budget[1]:
            return False
        bm = self.block_manager
        ids = [seq.seq_id for seq in seqs]
        if bm.enable_prefix_caching:
            result = bm.append_decode_slots(ids, [s.token_ids for s in seqs], [s.num_computed for s in seqs])
        else:
            result = bm.append_decode_slots(ids)
        if result is None:
            return False
        if not out.scheduled:
            out.table_changes = result.changed
        out.scheduled.extend([ScheduledSeq(seq, group, seq.num_computed, 1, [slot])
                              for group, seq, slot in zip(owners, seqs, result.slots)])
        out.copies.extend(result.copies)
        out.distinct_groups = distinct and len(out.scheduled) == len(seqs)  # (`schedule` resets it)
        budget[0] -= len(seqs)
        budget[1] -= seq_budget
        return True

    def _plan_admission(self, group: SequenceGroup, budget: list[int], planner: CheckpointPlanner | None = None):
        """With prefix caching: `(plan, matches)` to admit a waiting group now, or `(None, None)`.

        Each sequence's `num_computed` is moved past its cached prefix (reset to 0 when the group is not admitted).
        Cached blocks taken from the evictable pool count against the free blocks. The group waits (one step) when
        the block after a sequence's cached prefix is being computed by a running sequence right now, or (hybrid
        models, `planner`) when a sequence admitted before it in this pass checkpoints the state it could resume from.
        """
        bm = self.block_manager
        seqs = group.live_seqs()
        matches = {}
        for seq in seqs:
            match = bm.match_prefix(seq.token_ids, group.max_cached_prefix, known_keys=seq.prompt_keys or (),
                                    salt=group.cache_salt)
            if (match.pending or (planner is not None and planner.waits(match))) and self.running:
                return None, None
            matches[seq.seq_id] = match
        for seq in seqs:
            seq.num_computed = matches[seq.seq_id].num_cached_tokens
        plan = self._plan(group, budget)
        if plan is not None:
            planned = {seq.seq_id: n for seq, n in plan}  # (every live sequence is admitted: `schedule`)
            needed = bm.blocks_needed_to_admit((matches[seq.seq_id], planned.get(seq.seq_id, 0)) for seq in seqs)
            headroom = self.watermark_blocks if self.running else 0
            if needed + headroom <= bm.gpu.num_free:
                return plan, matches
            self._short_of_blocks = (group, needed + headroom)
        for seq in seqs:
            seq.num_computed = 0
        return None, None

    def _plan(self, group: SequenceGroup, budget: list[int]) -> list[tuple[Sequence, int]] | None:
        """Tokens per live sequence this step (gang: all sequences of the group or none).

        Hybrid models: a chunk ends at the sequence's next state checkpoint (`Sequence.state_saves`), and the
        sequences of a group finish their prompts in the same step (a recurrent state cannot give a token back, as
        beam search's wait for the slowest beam would need: `BeamSearch._defer`)."""
        seqs = [s for s in group.live_seqs() if s.num_uncomputed > 0]
        if not seqs or group.max_running_seqs() > budget[1]:  # a group about to fork needs its width
            return None
        tokens_left = budget[0]
        if tokens_left < len(seqs):
            return None
        plan = []
        for index, seq in enumerate(seqs):
            # share the budget so every sequence of the group gets at least one token (gang scheduling)
            n = min(seq.num_uncomputed, tokens_left - (len(seqs) - index - 1))
            saves = seq.state_saves
            while saves and saves[0] <= seq.num_computed:  # passed in a one-token step of the decode fast path
                saves.pop(0)
            if saves:
                n = min(n, saves[0] - seq.num_computed)
            plan.append((seq, n))
            tokens_left -= n
        if len(plan) > 1 and self.block_manager.state is not None:
            ends = [n == seq.num_uncomputed for seq, n in plan]
            if any(ends) and not all(ends):  # hold the finishers' last token back until every sequence is there
                plan = [(seq, n - end) for (seq, n), end in zip(plan, ends) if n - end > 0]
        return plan

    def _reserve(self, group, plan, out: SchedulerOutput, budget: list[int]) -> None:
        for seq, n in plan:
            start = seq.num_computed
            result = self.block_manager.append_slots(seq.seq_id, n)
            out.copies.extend(result.copies)
            out.scheduled.append(ScheduledSeq(seq, group, start, n, result.slots))
            budget[0] -= n
            saves = seq.state_saves
            if saves and saves[0] == start + n:  # the chunk ends at a checkpoint: kept once the forward is launched
                out.state_saves.append((seq, saves.pop(0)))
        budget[1] -= max(len(plan), group.max_running_seqs())

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        bm = self.block_manager
        seqs = group.live_seqs()
        ids = [s.seq_id for s in seqs]
        self.running.remove(group)
        group.num_preemptions += 1
        out.preempted.append(group)
        if bm.enable_prefix_caching:  # its written blocks stay cached: a recompute may hit them on re-admission
            for seq in seqs:
                bm.commit(seq.seq_id, seq.token_ids, seq.num_computed)
        if self.preemption_mode == "swap" and bm.can_swap_out(ids):
            out.swap_out.extend(bm.swap_out(ids))
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            self._insert(self.swapped, group)
            self.num_preemptions["swap"] += 1
            return
        for seq in seqs:
            bm.free(seq.seq_id)
            seq.num_computed = 0
            seq.status = SequenceStatus.WAITING
        self._insert(self.waiting, group)
        self.num_preemptions["recompute"] += 1
