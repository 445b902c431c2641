"""Pipelined decode: launch the next decode step before the host has the current step's tokens (plain requests,
greedy or sampled on the device, constrained or not, on the static path). A mixin of `Engine`, used by
`Engine.step()` (what `generate()`, `stream()` and the server run).

* Which steps: a decode step on the static path (`_can_pipeline`) that covers every running request, each plain, with
  nothing swapped, no copy and no admission due (requests may wait for their admission batch), is *launched*: its
  picks stay on the device and are copied to a pinned buffer behind an event; each sequence counts the step as
  computed and holds the placeholder `-1` where the token will go.
* Before waiting for it, the engine schedules the next step (`Scheduler.schedule_decode_step`; requests this step
  finishes by length are left out) and launches it, its input ids gathered on the device from the step before.
* Then it waits for the earlier step's tokens and applies them (`_apply`): a request that stops there by EOS or a stop
  string is freed (its token in the step already launched is discarded; the stream runs that step before any later
  use of its blocks); a request aborted while its step was in flight keeps the tokens it had. A token goes in place
  without the stop checks when none can hold (no EOS of the request, under its length, no stop strings or criteria).
* Constrained requests (structured outputs, `SequenceGroup.masked`): when a step's picks are launched, worker
  threads start advancing its grammar matchers with them (waiting for their event) and filling the next step's masks
  (`StructuredOutputs.advance`: the engine thread goes on meanwhile). Between launching the next step's forward and
  its picks, `_mask_next` collects that work (`_accept_in_flight`, once: `_apply` reads the ends it found) and
  uploads and applies the masks, while the forward runs. A grammar that ends with a token finishes its request in
  `_apply`, like an EOS.
* `abort`, `close` and the end of `generate()` / `stream()` drain the step in flight first, so no placeholder is ever
  visible. A failing launch fails its requests; an interrupted launch requeues them (nothing lost); an interrupt while
  waiting for tokens fails the requests of both steps (half applied). `tests/test_pipelined_decode.py`.

Host work, about 0.5-0.9 us a request a step at 256 requests on the CPU sandbox (`benchmarks/bench_host_step.py`):
once a pipelined step covers every running group, each with one plain (or masked) sequence, the scheduler keeps
their rows in a `hf_paged.core.decode_batch.DecodeBatch`. The runner copies positions, slots and store rows from its
arrays into its pinned upload buffer, and a table that changed in its last entry goes to the store as one point
(`hf_paged.runner.table_store`); a batch step after rows left takes its sequences' store rows through the step's
`source` (`model_runner._kept_rows`). The picker keeps the batch's parameter columns in its pinned buffers and on the
device: a sampled step uploads its seeds and offsets only, with parameters normalised on the host bitwise as the
device would (`kernels.sampling.inverse_temperature`, `effective_top_k`, then `sample_normalised`). When no request of
the batch has stop strings or stopping criteria, the tokens go in place in one loop: on the arrays (`_apply_rows`, EOS
ids and length limits found by array comparisons) while the batch is still the scheduler's, at most one step
further; else by `_apply_batch`, which checks each row. Rows that hit an EOS id or their length limit, or whose
sequence stopped meanwhile, take `_apply`'s full path in row order, and the finished groups go to the outputs
directly. A group that finishes leaves the batch (`DecodeBatch.remove`); the step already in flight keeps the lists
it was scheduled with (`StepRows`) and is applied row by row, and the next step takes its input ids from that step's
rows. A request reaching its length limit with the step in flight leaves the batch before the next step is scheduled
(`DecodeBatch.remove(..., voids_in_flight=False)`), so a finish costs no general step and no new batch.
`tests/test_decode_batch.py` compares every step's positions, slots, new blocks and commits with the per-sequence
path in six configurations (greedy, sampled, EOS stops, shared prefixes, preemption, no prefix caching).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core import SchedulerOutput, SequenceGroup
from .beam import track_sharing
from .grammar import GrammarJob
from .updates import unique_groups

__all__ = ["PipelinedDecode"]


_IN_FLIGHT = -1  # token id standing for a token a launched step has not delivered to the host yet


@dataclass
class _InFlight:
    """A launched plain decode step: its picks are on the device, on their way to `host` (done when `event` is)."""

    sched: SchedulerOutput
    tokens: torch.Tensor  # [n] int64 on the device: input of the next pipelined step
    host: torch.Tensor  # [n] int64 on the host (pinned on CUDA)
    event: torch.cuda.Event | None
    # structured outputs: the grammar ends its tokens brought ({id(seq): "grammar" | "grammar_rejected"}), once the
    # matchers have accepted them (`_accept_in_flight`); None before
    grammar_ends: dict | None = None
    host_list: list[int] | None = None  # `host` as a list, once read (`_host_tokens`)
    grammar_job: GrammarJob | None = None  # the worker threads advancing the matchers with `host` (if constrained)


class PipelinedDecode:
    """Launch / apply / drain of pipelined decode steps; a mixin of `Engine`."""

    def _can_pipeline(self, sched: SchedulerOutput, logits: torch.Tensor) -> bool:
        """A static-path decode step of plain requests (greedy or sampled on the device) covering every running
        request, none swapped and no admission due (requests may wait for an admission batch: see
        `Scheduler.admission_due`)."""
        scheduler = self.scheduler
        scheduled = sched.scheduled
        return (
            self.runner.last_static
            and not (scheduler.swapped or sched.copies or scheduler.admission_due())
            and logits.shape[0] == len(scheduled)
            and all(item.group.plain or item.group.masked for item in scheduled)
            and len({id(item.group) for item in scheduled}) == len(scheduler.running)
        )

    def _launch(self, sched: SchedulerOutput, logits: torch.Tensor) -> _InFlight:
        """Pick the step's tokens on the device and start their copy to the host; do not wait for it. Constrained
        rows: worker threads start advancing their matchers with the tokens as soon as they arrive.

        Each sequence counts its step as computed and holds `_IN_FLIGHT` where the token will go, so the scheduler
        can plan the next step (one more token for each) before the token is known.
        """
        tokens = self._share(self._pick(sched.scheduled, logits, sched.batch))
        n = tokens.shape[0]
        event = None
        if tokens.is_cuda:
            if not self._token_hosts or self._token_hosts[0].shape[0] < n:
                size = max(n, self.scheduler.max_num_seqs)
                self._token_hosts = [torch.empty(size, dtype=torch.long, pin_memory=True) for _ in range(2)]
            self._token_hosts.reverse()  # never the buffer of the step still in flight
            host = self._token_hosts[0][:n]
            host.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = tokens
        job = None
        if self.structured.active:
            job = self.structured.advance(sched, host, event)  # (its rows: before the placeholders go in)
        if sched.batch is not None:  # one token for each of the batch's sequences, in row order
            for seq in sched.batch.seqs:
                seq.num_computed += 1
                seq.token_ids.append(_IN_FLIGHT)
        else:
            for item in sched.scheduled:
                seq = item.seq
                seq.num_computed += item.num_tokens
                seq.token_ids.append(_IN_FLIGHT)
        return _InFlight(sched, tokens, host, event, grammar_job=job)

    def _schedule_next(self, current: _InFlight) -> SchedulerOutput | None:
        """The next decode step of every running request that `current` does not finish by length, if it fits."""
        scheduler = self.scheduler
        if scheduler.swapped:
            return None  # swaps need the normal scheduler: let the pipeline drain (so do admissions: see below)
        batch = current.sched.batch
        if batch is not None and batch is scheduler.decode_batch and batch.number == current.sched.batch_step:
            # the batch's length limits say which rows finish, on its arrays (usually none: no need to look)
            done = batch.finishing_groups() if batch.finishing() else frozenset()
        else:
            done = {id(item.group) for item in current.sched.scheduled
                    if len(item.seq.token_ids) - item.seq.prompt_len >= item.group.params.max_new_tokens}
        sched = scheduler.schedule_decode_step(done)
        if sched is None:
            return None  # an admission is due, or no room: nothing was reserved
        # cheap: a step of `schedule_decode_step` is marked a decode step, so the runner skips its per-item check
        assert self.runner.static_eligible(sched), "a batched decode step is always a static-path step"
        return sched

    def _advance_pipeline(self, current: _InFlight) -> tuple[list[SequenceGroup], list[SequenceGroup] | None]:
        """Launch the step after `current` (when it can), then wait for `current`'s tokens and apply them. Returns
        the groups that advanced and, when known without a look at each, those of them that finished (see `_apply`)."""
        sched = self._schedule_next(current)
        launched, failure, interrupt = None, None, None
        if sched is not None:
            try:
                self.runner.apply_block_ops(sched)
                track_sharing(self.stats, *self.block_manager.usage())
                source = (current.tokens, _source_rows(current.sched, sched))
                with torch.inference_mode():
                    logits, _ = self.runner.execute(sched, input_tokens=source)
                    if self.structured.active:  # the masks of constrained rows, filled while the forward runs
                        self._mask_next(current, sched, logits)
                    launched = self._launch(sched, logits)
            except Exception as error:
                failure = error
            except BaseException as error:
                interrupt = error
        try:
            advanced, finished = self._apply(current)
        except BaseException as error:  # tokens half applied: fail both steps' requests (StepRecovery.interrupted)
            if launched is not None and launched.grammar_job is not None:
                launched.grammar_job.wait()  # its workers hold matchers of the requests failed here
            failed = []
            for step in (sched, current.sched):
                if step is not None:
                    self._drop_in_flight(step)
                    failed += [g for g in self.recovery.fail(step, error, "sample") if g not in failed]
            if isinstance(error, Exception):
                return failed, None
            self.registry.unreported.extend(failed)
            raise
        self._track(current.sched)
        if failure is not None:  # the next step's forward failed: its requests fail, as in a normal step
            self._drop_in_flight(sched)
            failed = self.recovery.fail(sched, failure, "forward")
            advanced += [g for g in failed if g not in advanced]
            finished = None
        elif interrupt is not None:  # nothing of it was applied: requeue its requests, lose nothing
            self._drop_in_flight(sched)
            self.recovery.interrupted(sched, interrupt, "forward")  # requeued: nothing failed
            self.registry.unreported.extend(g for g in advanced if g.is_finished)  # the applied step's results
            raise interrupt
        elif launched is not None:
            self._in_flight = launched
            self.pipelined_steps += 1
        return advanced, finished

    def _apply(self, current: _InFlight) -> tuple[list[SequenceGroup], list[SequenceGroup] | None]:
        """Wait for a launched step's tokens; put each where `_IN_FLIGHT` stands, then apply the stop conditions.
        Returns the groups that advanced and, for a step of distinct groups, those of them that finished, in the same
        order (a finished row then means a finished group); else None (`Outputs._outputs` looks at each group).

        A request that stops here may already be in the next launched step: its token from that step is dropped
        (its blocks are freed now; the stream runs that step before any later use of them). A request aborted while
        its step was in flight keeps the tokens it had before that step.
        """
        if current.event is not None:
            current.event.synchronize()
        if self.structured.active:
            self._accept_in_flight(current)
        batch = current.sched.batch
        # (a batch keeps its last two steps: every step is applied before the one after it is scheduled)
        # (a step whose tokens ended grammars takes the general path: `_apply_with_stops` finishes those requests)
        rows = batch.rows_of(current.sched.batch_step) \
            if batch is not None and batch.token_stops_only and not current.grammar_ends else None
        if rows is not None:
            if batch.eos_ids is not None and batch is self.scheduler.decode_batch \
                    and batch.number - rows.number <= 1 and rows.generation == batch.generation:
                return self._apply_rows(current, batch, rows)
            return self._apply_batch(current, rows, current.host.tolist())
        tokens = _host_tokens(current)
        advanced, finished = [], []
        ends = current.grammar_ends
        for item, token in zip(current.sched.scheduled, tokens):
            seq = item.seq
            ids = seq.token_ids
            at = item.start + item.num_tokens  # where this step's token goes
            if seq.status.is_finished:  # stopped in the step before (reported then) or aborted (reported by abort)
                del ids[at:]
                continue
            group = item.group
            advanced.append(group)
            params = group.params
            produced = at + 1 - seq.prompt_len
            end = ends.get(id(seq)) if ends else None
            if end is None and len(ids) == at + 2 and not (
                    token in params.eos_token_id or produced >= params.max_new_tokens or params.stop_strings
                    or params.stopping_criteria):
                ids[at] = token  # the common case: no stop condition can hold (`_check_stop` would find none)
                continue
            if self._apply_with_stops(seq, params, at, token, group if end is not None else None, end):
                finished.append(group)
        if finished:
            self.scheduler.remove_finished(finished)
        if current.sched.distinct_groups:
            return advanced, finished
        return unique_groups(advanced), None

    def _apply_rows(self, current: _InFlight, batch, rows) -> tuple[list[SequenceGroup], list[SequenceGroup]]:
        """`_apply` for a step of a `DecodeBatch` that is still the scheduler's, at most one step further and of the
        same generation: no row stopped, was aborted or failed since the step was scheduled (a stop removes its row
        and starts a generation; an abort or a failure drops the batch; a row leaving at its length limit does
        neither, its last token being this step's), so every row is running and holds this step's placeholder. Every
        token goes in place; the rows that meet an EOS id or their length limit (found on the arrays, one comparison
        per EOS id) then take the full stop check, in row order."""
        tokens = current.host.numpy()
        stop = rows.starts >= rows.last_starts
        for eos in batch.eos_ids:
            stop |= tokens == eos
        at_list, token_list = (rows.starts + 1).tolist(), tokens.tolist()  # where each row's token goes
        seqs = rows.seqs
        for seq, position, token in zip(seqs, at_list, token_list):
            seq.token_ids[position] = token
        if not stop.any():
            return list(rows.groups), []
        groups, finished = rows.groups, []
        for k in np.flatnonzero(stop).tolist():
            if self._apply_with_stops(seqs[k], groups[k].params, at_list[k], token_list[k]):
                finished.append(groups[k])
        if finished:
            self.scheduler.remove_finished(finished)
        return list(groups), finished

    def _apply_batch(self, current: _InFlight, step, tokens: list[int]
                     ) -> tuple[list[SequenceGroup], list[SequenceGroup]]:
        """`_apply` for a step of a `DecodeBatch` (its rows: `step`) whose requests stop only on tokens (EOS ids,
        length), row by row: each row's token goes in place unless it is an EOS id or reaches the row's length limit,
        or the row's sequence stopped or changed meanwhile; those rows (a few a step at most) then take `_apply`'s
        full path, in row order."""
        rows = current.sched.scheduled
        seqs, groups, eos_lists = step.seqs, step.groups, step.eos  # the step's rows (`StepRows`)
        starts, last_starts = step.starts.tolist(), step.last_starts.tolist()
        others = []
        for k, (seq, start, token, eos, last_start) in enumerate(zip(seqs, starts, tokens, eos_lists, last_starts)):
            at = start + 1  # where this step's token goes (one token per row)
            ids = seq.token_ids
            if token in eos or at - 1 >= last_start or len(ids) != at + 2 or seq.status.is_finished:
                others.append(k)
            else:
                ids[at] = token
        if not others:
            return list(groups), []
        skipped, finished = set(), []
        for k in others:
            seq, item = seqs[k], rows[k]
            at = starts[k] + 1
            if seq.status.is_finished:  # stopped in the step before (reported then) or aborted (reported by abort)
                del seq.token_ids[at:]
                skipped.add(k)
            elif self._apply_with_stops(seq, item.group.params, at, tokens[k]):
                finished.append(item.group)
        if finished:
            self.scheduler.remove_finished(finished)
        return ([g for k, g in enumerate(groups) if k not in skipped] if skipped else list(groups)), finished

    def _apply_with_stops(self, seq, params, at: int, token: int, group: SequenceGroup | None = None,
                          grammar_end: str | None = None) -> bool:
        """Put `token` at `at` in `seq` and apply every stop condition (and `group`'s grammar end, if the token
        brought one); return whether the sequence finished.

        The next launched step's placeholder, if any, is set aside while the stop conditions read the tokens, and put
        back if the sequence goes on."""
        ids = seq.token_ids
        later = ids[at + 1 :]
        del ids[at:]
        ids.append(token)
        self._check_stop(seq, params)
        if grammar_end is not None and not seq.status.is_finished:
            self._finish_by_grammar(group, seq, grammar_end, token)
        if seq.status.is_finished:
            return True
        if later:
            ids.extend(later)
        return False

    def _accept_in_flight(self, current: _InFlight) -> None:
        """Advance the grammar matchers of `current`'s constrained rows with their tokens (waiting for them), once:
        collect the worker threads' job (`StructuredOutputs.collect`), or accept here if there is none; record the
        ends they bring for `_apply`."""
        if current.grammar_ends is not None:
            return
        if current.grammar_job is not None:  # advanced in worker threads (`StructuredOutputs.advance`)
            current.grammar_ends = self.structured.collect(current.grammar_job)
            return
        ends: dict[int, str] = {}
        current.grammar_ends = ends
        if current.sched.batch is not None:
            return
        if current.event is not None:
            current.event.synchronize()
        accept = self.structured.accept
        for item, token in zip(current.sched.scheduled, _host_tokens(current)):
            seq = item.seq
            if item.group.masked and not seq.status.is_finished:
                end = accept(item.group, seq, token)
                if end is not None:
                    ends[id(seq)] = end

    def _mask_next(self, current: _InFlight, sched: SchedulerOutput, logits: torch.Tensor) -> None:
        """The grammar masks of `sched`'s constrained rows, whose forward was just launched: wait for the matchers to
        have taken `current`'s tokens and the workers to have filled the masks (else fill them here), upload them and
        apply them on the device, before the picks are launched. A row whose grammar ended with `current`'s token is
        not masked (its pick is dropped)."""
        if not any(item.group.masked for item in sched.scheduled):
            return
        self._accept_in_flight(current)
        if current.grammar_job is not None:
            masks = self.structured.job_masks(current.grammar_job, sched)
        else:
            masks = self.structured.fill(sched, current.grammar_ends)
        if masks is not None:
            self.structured.apply(logits, masks)

    def _drop_in_flight(self, sched: SchedulerOutput) -> None:
        """Undo `_launch`'s bookkeeping of a step whose tokens will never arrive (its forward failed)."""
        for item in sched.scheduled:
            seq = item.seq
            del seq.token_ids[item.start + item.num_tokens :]
            seq.num_computed = min(seq.num_computed, item.start)

    def _drain(self) -> None:
        """Apply the launched step, if any, before the engine's state is read or changed outside a step."""
        current, self._in_flight = self._in_flight, None
        if current is not None:
            advanced, _ = self._apply(current)
            self._track(current.sched)
            self.registry.unreported.extend(g for g in advanced if g.is_finished)


def _host_tokens(current: _InFlight) -> list[int]:
    """A launched step's tokens as a list (after its event), converted once: a constrained step's matchers read them
    before `_apply` does."""
    if current.host_list is None:
        current.host_list = current.host.tolist()
    return current.host_list


def _source_rows(before: SchedulerOutput, step: SchedulerOutput) -> list[int]:
    """For each item of the step to launch, the row of its sequence in the step before (whose picked tokens are its
    input ids). Usually the same sequences in the same order (nothing finished, nothing admitted): known without a
    look when both steps are rows of one `DecodeBatch`, else checked in one pass, without the map."""
    if step.batch is not None and before.batch is step.batch:
        rows = step.batch.rows_of(step.batch_step)
        if rows is not None:
            return rows.source
    previous, scheduled = before.scheduled, step.scheduled
    if len(previous) == len(scheduled) and all(a.seq is b.seq for a, b in zip(previous, scheduled)):
        return list(range(len(scheduled)))
    rows = {id(item.seq): k for k, item in enumerate(previous)}
    return [rows[id(item.seq)] for item in scheduled]
