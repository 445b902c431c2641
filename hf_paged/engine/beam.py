"""Beam search inside the engine, on shared KV blocks (PagedAttention paper §4.4), and sharing statistics.

A request with `num_beams=k > 1` is one `SequenceGroup` whose sequences are its *running* beams, in transformers'
beam-slot order. Every step that computes the last token of all of them runs `BeamSearch.step` for the group:

* the arithmetic is transformers 5.x `GenerationMixin._beam_search` (and its helpers `_get_top_k_continuations`,
  `_get_running_beams_for_next_iteration`, `_update_finished_beams`, `_check_early_stop_heuristic`,
  `_beam_search_has_unfinished_sequences`) for one batch item, op for op on float32 tensors on the logits' device:
  log-softmax, then the logits processors (repetition penalty, `min_new_tokens`, the user's), accumulated scores,
  the top `K = max(2, 1 + n_eos) * k` continuations over all beams, the best `k` that did not stop, and the merge of
  stopped candidates (length-penalised) into the `k` finished hypotheses. The first step expands beam 0 only
  (the other slots start at -1e9, as in transformers). One host transfer per engine step serves every beam group.
* the block tables follow the beams: a parent chosen by several new beams is forked (`BlockManager.fork`: ref counts
  up, no allocation), a beam nobody continues is freed (ref counts down). The next `append_slots` of each beam copies
  its last block only when that block is partial and still shared (copy-on-write, done by the model runner before
  the forward); full blocks are never copied.
* the group is done exactly when transformers would stop looking at it: no running beam can beat the worst finished
  hypothesis (the early-stop heuristic), or `early_stopping=True` and `k` hypotheses are finished, or
  `max_new_tokens` is reached. Its sequences are then replaced by the best `num_return_sequences` hypotheses
  (finished, holding no blocks), carrying their score in `Sequence.cumulative_logprob`.

The group is scheduled and preempted all-or-nothing by the scheduler. After a recompute preemption the beams are
prefilled separately (no sharing); if a step finishes some beams' prefill but not all, the finished ones give their
last token back (it is recomputed with the others next step) so that every beam of the group is scored in one step.
When the group is done, `CompletionOutput.score` is the hypothesis' score (transformers' `sequences_scores`).

Sharing statistics (`track_sharing`, `sharing_stats`): every step, after scheduling, the engine adds
`BlockStats.used_blocks` and `logical_blocks` (the blocks the tables would hold without sharing) to `engine.stats`;
`Engine.sharing_stats()` gives the live values and the run averages (`SharingStats`).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from ..core import Sequence, SequenceGroup, SequenceStatus
from .logits import _apply_repetition_penalty
from .params import validate_beam_params

__all__ = ["BeamSearch", "BeamState", "SharingStats", "validate_beam_params"]

BEAM_KEY = "beam"
_NEG = -1.0e9  # transformers' "very large negative" score


class BeamState:
    """transformers' per-batch-item beam tensors (`[1, ...]` rows) plus the finished hypotheses' tokens."""

    def __init__(self, params, device: torch.device) -> None:
        k = params.num_beams
        eos = () if params.ignore_eos else tuple(params.eos_token_id)
        self.num_beams = k
        self.beams_to_keep = max(2, 1 + len(eos)) * k
        self.eos = torch.tensor(eos, dtype=torch.long, device=device) if eos else None
        self.running_scores = torch.zeros((1, k), dtype=torch.float, device=device)
        self.running_scores[:, 1:] = _NEG
        self.beam_scores = torch.full((1, k), _NEG, dtype=torch.float, device=device)
        self.is_sent_finished = torch.zeros((1, k), dtype=torch.bool, device=device)
        self.unsatisfied = torch.ones((1, 1), dtype=torch.bool, device=device)
        self.top_mask = torch.cat(
            (torch.ones(k, dtype=torch.bool), torch.zeros(self.beams_to_keep - k, dtype=torch.bool))
        ).to(device)
        self.hyps: list[list[int]] = [[] for _ in range(k)]  # generated tokens of each finished-hypothesis slot
        self.step_scores: list[torch.Tensor] | None = [] if params.output_scores else None


class BeamSearch:
    """The engine's beam-search step (see the module docstring)."""

    def __init__(self, engine) -> None:
        # a weak reference: no engine <-> beam-search cycle, so a dropped engine (and its KV pool) is freed by
        # reference counting alone, even when `Engine.warm_up()` froze it out of the cycle collector's reach
        self.engine = weakref.proxy(engine)

    # ------------------------------------------------------------------ engine hook
    def step(self, entries, logits: torch.Tensor) -> list[SequenceGroup]:
        """`entries`: `(ScheduledSeq, logits row)` of every beam sequence that sampled this step."""
        by_group: dict[int, tuple[SequenceGroup, dict[int, int]]] = {}
        for item, row in entries:
            by_group.setdefault(id(item.group), (item.group, {}))[1][item.seq.seq_id] = row
        ready = []
        for group, rows in by_group.values():
            live = group.live_seqs()
            if len(rows) != len(live) or any(s.seq_id not in rows for s in live):
                self._defer(group, rows)  # some beams are still prefilling (after a recompute preemption)
                continue
            state = group.data.get(BEAM_KEY)
            if state is None:
                state = group.data[BEAM_KEY] = BeamState(group.params, logits.device)
            ready.append((group, state, [rows[s.seq_id] for s in group.seqs]))
        if not ready:
            return []
        log_probs, first_rows = self._log_probs(ready, logits)
        buckets: dict[tuple[int, int], list[int]] = {}
        for index, (_, state, _) in enumerate(ready):
            buckets.setdefault((state.num_beams, state.beams_to_keep), []).append(index)
        order, packed = [], []
        for members in buckets.values():
            packed.append(self._device_step([ready[i] for i in members], [first_rows[i] for i in members], log_probs))
            order.extend(members)
        # the one host sync of this step's beam groups; under tensor parallelism every rank takes the first rank's
        host = self.engine._share(torch.cat([p.flatten() for p in packed])).tolist()
        offset = 0
        for index in order:
            group, state, _ = ready[index]
            size = 2 * state.beams_to_keep + 3 * state.num_beams + 1
            self._host_step(group, state, host[offset : offset + size])
            offset += size
        return [group for group, _, _ in ready]

    def _defer(self, group: SequenceGroup, rows: dict[int, int]) -> None:
        bm = self.engine.block_manager
        if bm.state is not None:  # a recurrent state cannot give a token back: the scheduler never asks it to
            raise RuntimeError("beam search deferred a hybrid model's beam (its scheduler plans beams to finish "
                               "their prompts together)")
        for seq in group.seqs:
            if seq.seq_id in rows:
                seq.num_computed -= 1
                bm.truncate(seq.seq_id, seq.num_computed)

    # ------------------------------------------------------------------ device arithmetic (transformers, batched)
    def _log_probs(self, ready, logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Log-softmax of every ready beam row (one op; rows are independent), then each group's processors."""
        rows = [r for _, _, group_rows in ready for r in group_rows]
        if rows == list(range(rows[0], rows[0] + len(rows))):
            picked = logits[rows[0] : rows[0] + len(rows)]
        else:
            picked = logits.index_select(0, torch.tensor(rows, device=logits.device))
        # float32 result straight from the (bf16 / float32) logits: no float32 copy of the logits first
        log_probs = torch.nn.functional.log_softmax(picked, dim=-1, dtype=torch.float32)
        first_rows, offset = [], 0
        for group, state, group_rows in ready:
            n = len(group_rows)
            if n not in (1, state.num_beams):
                raise RuntimeError(f"beam group has {n} running beams, expected 1 or {state.num_beams}")
            first_rows.append(offset)
            p, seqs = group.params, group.seqs
            view = log_probs[offset : offset + n]
            processed = self._process(p, seqs, view, seqs[0].num_tokens - seqs[0].prompt_len)
            if processed is not view:
                view.copy_(processed)
            if state.step_scores is not None:  # first step: transformers' k slots all hold the prompt
                state.step_scores.append(view.expand(state.num_beams, -1).clone())
            offset += n
        return log_probs, first_rows

    def _device_step(self, ready, first_rows: list[int], log_probs: torch.Tensor) -> torch.Tensor:
        """One step of `_beam_search` for G groups of equal (k, K), as a `[G, ...]` batch (rows are independent)."""
        device = log_probs.device
        states = [state for _, state, _ in ready]
        params = [group.params for group, _, _ in ready]
        generated = [group.seqs[0].num_tokens - group.seqs[0].prompt_len for group, _, _ in ready]
        k, K = states[0].num_beams, states[0].beams_to_keep
        G, vocab = len(ready), log_probs.shape[-1]
        index = []
        for (_, _, rows), first in zip(ready, first_rows):
            # the first step expands beam 0 only: its row stands for all k slots (the others start at -1e9)
            index.extend(range(first, first + k) if len(rows) == k else [first] * k)
        if index == list(range(index[0], index[0] + len(index))):  # the steady state: rows already in order
            beam_log_probs = log_probs[index[0] : index[0] + len(index)].view(G, k, vocab)
        else:
            beam_log_probs = log_probs.index_select(0, torch.tensor(index, device=device)).view(G, k, vocab)
        running_scores = torch.cat([s.running_scores for s in states])
        beam_scores = torch.cat([s.beam_scores for s in states])
        is_sent_finished = torch.cat([s.is_sent_finished for s in states])
        unsatisfied = torch.cat([s.unsatisfied for s in states])
        early_true = torch.tensor([[p.early_stopping is True] for p in params], device=device)

        # _get_top_k_continuations
        accumulated = (beam_log_probs + running_scores[:, :, None]).reshape(G, k * vocab)
        topk_log_probs, topk_indices = torch.topk(accumulated, k=K)
        parents = topk_indices // vocab
        tokens = topk_indices % vocab
        # stopping criteria of the candidates: eos ids, max length
        hits = torch.tensor([[g + 1 >= p.max_new_tokens] for g, p in zip(generated, params)], device=device)
        hits = hits.expand(G, K)
        if any(s.eos is not None for s in states):
            width = max(len(s.eos) if s.eos is not None else 0 for s in states)
            table = torch.full((G, width), -1, dtype=torch.long, device=device)
            for g, s in enumerate(states):
                if s.eos is not None:
                    table[g, : len(s.eos)] = s.eos
            hits = hits | (tokens[:, :, None] == table[:, None, :]).any(dim=-1)

        # _get_running_beams_for_next_iteration
        running_log_probs = topk_log_probs + hits.to(torch.float32) * _NEG
        next_indices = torch.topk(running_log_probs, k=k)[1]
        running_scores = torch.take_along_dim(running_log_probs, next_indices, dim=1)

        # _update_finished_beams (the length penalty divides by a float32 copy of the Python float, as torch does)
        just_finished = hits & states[0].top_mask[None, :]
        penalty = torch.tensor([[(g + 1) ** p.length_penalty] for g, p in zip(generated, params)],
                               dtype=torch.float32, device=device)
        scores = topk_log_probs / penalty
        full = torch.all(is_sent_finished, axis=-1, keepdims=True) & early_true
        scores += full.to(torch.float32) * _NEG
        scores += (~unsatisfied).to(torch.float32) * _NEG
        scores += (~just_finished) * _NEG
        merged_scores = torch.cat((beam_scores, scores), dim=1)
        merged_indices = torch.topk(merged_scores, k=k)[1]
        beam_scores = torch.take_along_dim(merged_scores, merged_indices, dim=1)
        merged_finished = torch.cat((is_sent_finished, just_finished), dim=1)
        is_sent_finished = torch.take_along_dim(merged_finished, merged_indices, dim=1)

        # _check_early_stop_heuristic (cur_len advanced by one) and _beam_search_has_unfinished_sequences
        best = [p.max_new_tokens if p.early_stopping == "never" and p.length_penalty > 0.0 else g + 1
                for g, p in zip(generated, params)]
        best_penalty = torch.tensor([[b**p.length_penalty] for b, p in zip(best, params)], dtype=torch.float32,
                                    device=device)
        best_running = running_scores[:, :1] / best_penalty
        worst_finished = torch.where(is_sent_finished, torch.min(beam_scores, dim=1, keepdim=True)[0], _NEG)
        unsatisfied = unsatisfied & torch.any(best_running > worst_finished, dim=-1, keepdim=True)
        all_finished = torch.all(is_sent_finished, dim=-1, keepdim=True) & early_true
        done = ~unsatisfied | all_finished | torch.all(hits, dim=-1, keepdim=True)
        for g, state in enumerate(states):
            state.running_scores = running_scores[g : g + 1]
            state.beam_scores = beam_scores[g : g + 1]
            state.is_sent_finished = is_sent_finished[g : g + 1]
            state.unsatisfied = unsatisfied[g : g + 1]
        # float64 holds every index (< k * vocab) and every float32 score exactly: one transfer for all of it
        return torch.cat((parents.double(), tokens.double(), next_indices.double(), merged_indices.double(),
                          beam_scores.double(), done.double()), dim=1)

    @staticmethod
    def _process(p, seqs: list[Sequence], log_probs: torch.Tensor, generated: int) -> torch.Tensor:
        """transformers' processor order for beam search: repetition penalty, min_new_tokens, the user's."""
        rows = len(seqs)
        if p.repetition_penalty != 1.0:
            _apply_repetition_penalty(
                log_probs, list(range(rows)), [p.repetition_penalty] * rows, [s.token_ids for s in seqs],
                [p.extra.get("penalty_ids", ())] * rows,
            )
        if p.min_new_tokens > 0 and generated < p.min_new_tokens and p.eos_token_id:
            log_probs[:, list(p.eos_token_id)] = -math.inf
        if p.logits_processor is not None:
            ids = torch.tensor([s.token_ids for s in seqs], dtype=torch.long, device=log_probs.device)
            log_probs = p.logits_processor(ids, log_probs)
        return log_probs

    # ------------------------------------------------------------------ host bookkeeping (blocks follow the beams)
    def _host_step(self, group: SequenceGroup, state: BeamState, values: list[float]) -> None:
        k, K = state.num_beams, state.beams_to_keep
        parents = [int(v) for v in values[:K]]
        tokens = [int(v) for v in values[K : 2 * K]]
        next_indices = [int(v) for v in values[2 * K : 2 * K + k]]
        merged = [int(v) for v in values[2 * K + k : 2 * K + 2 * k]]
        beam_scores = values[2 * K + 2 * k : 2 * K + 3 * k]
        done = bool(values[-1])
        seqs = group.seqs

        def parent_of(candidate: int) -> Sequence:
            return seqs[parents[candidate]] if len(seqs) > 1 else seqs[0]

        # finished hypotheses (transformers keeps the merged top-k sequences, finished or not)
        state.hyps = [
            state.hyps[m] if m < k else parent_of(m - k).output_ids + [tokens[m - k]] for m in merged
        ]
        scheduler = self.engine.scheduler
        if done:
            self._finish(group, state, beam_scores)
            return

        # new running beams: slot j continues candidate next_indices[j]
        chosen = [(parent_of(c), tokens[c]) for c in next_indices]
        continued = {parent.seq_id for parent, _ in chosen}
        for seq in seqs:  # dropped beams first: their blocks (and a hybrid model's state slots) go to the forks
            if seq.seq_id not in continued:
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = "beam_dropped"
                scheduler.free_seq(seq)
        used: set[int] = set()
        new_seqs: list[Sequence] = []
        for parent, _ in chosen:
            if parent.seq_id in used:
                new_seqs.append(self._fork(parent))  # before the parent gets its new token
            else:
                used.add(parent.seq_id)
                new_seqs.append(parent)
        for seq, (_, token) in zip(new_seqs, chosen):
            seq.token_ids.append(token)
        group.seqs = new_seqs

    def _fork(self, parent: Sequence) -> Sequence:
        child = Sequence(token_ids=list(parent.token_ids), prompt_len=parent.prompt_len)
        child.num_computed = parent.num_computed
        child.status = SequenceStatus.RUNNING
        self.engine.block_manager.fork(parent.seq_id, child.seq_id)
        return child

    def _finish(self, group: SequenceGroup, state: BeamState, beam_scores: list[float]) -> None:
        """Free every running beam; the group's sequences become its best `num_return_sequences` hypotheses."""
        p = group.params
        scheduler = self.engine.scheduler
        for seq in group.seqs:
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = "beam_done"
            scheduler.free_seq(seq)
        prompt = group.seqs[0].token_ids[: group.seqs[0].prompt_len]
        eos = set(() if p.ignore_eos else p.eos_token_id)
        step_scores = None
        if state.step_scores is not None:
            step_scores = [s.to("cpu") for s in state.step_scores]
        hyps = []
        for slot in range(p.num_return_sequences):
            tokens = state.hyps[slot]
            seq = Sequence(token_ids=prompt + tokens, prompt_len=len(prompt))
            seq.num_computed = seq.num_tokens
            if tokens and tokens[-1] in eos:
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, "eos"
            else:
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_LENGTH, "length"
            seq.cumulative_logprob = beam_scores[slot]
            if step_scores is not None:
                group.data[seq.seq_id] = step_scores
            hyps.append(seq)
        group.seqs = hyps
        group.data.pop(BEAM_KEY, None)


# ---------------------------------------------------------------------------------------------- sharing statistics


@dataclass
class SharingStats:
    """Blocks actually used vs blocks that would be used without sharing (paper §6.3, Fig. 15).

    `saving` = blocks saved by sharing / blocks without sharing = `1 - used / logical`. The run figures are sampled
    once per engine step, after scheduling (the blocks the step's forward holds, copy-on-write copies included):
    `mean_saving` is `1 - sum(used) / sum(logical)` (time-averaged blocks), `mean_step_saving` the mean of the
    per-step ratios.
    """

    used_blocks: int
    logical_blocks: int
    saving: float
    steps: int
    mean_used_blocks: float
    mean_logical_blocks: float
    mean_saving: float
    mean_step_saving: float
    peak_used_blocks: int
    peak_logical_blocks: int

    @property
    def saved_blocks(self) -> int:
        return self.logical_blocks - self.used_blocks


def track_sharing(stats: dict, used: int, logical: int) -> None:
    """Accumulate one step's block usage (`BlockManager.usage()`: O(1)) into the engine's `stats` dict."""
    stats["sharing_steps"] = stats.get("sharing_steps", 0) + 1
    stats["used_blocks_sum"] = stats.get("used_blocks_sum", 0) + used
    stats["logical_blocks_sum"] = stats.get("logical_blocks_sum", 0) + logical
    stats["step_saving_sum"] = stats.get("step_saving_sum", 0.0) + (1.0 - used / logical if logical else 0.0)
    stats["peak_used_blocks"] = max(stats.get("peak_used_blocks", 0), used)
    stats["peak_logical_blocks"] = max(stats.get("peak_logical_blocks", 0), logical)


def sharing_stats(stats: dict, block_stats) -> SharingStats:
    steps = stats.get("sharing_steps", 0)
    used_sum, logical_sum = stats.get("used_blocks_sum", 0), stats.get("logical_blocks_sum", 0)
    return SharingStats(
        used_blocks=block_stats.used_blocks,
        logical_blocks=block_stats.logical_blocks,
        saving=block_stats.sharing_saving,
        steps=steps,
        mean_used_blocks=used_sum / steps if steps else 0.0,
        mean_logical_blocks=logical_sum / steps if steps else 0.0,
        mean_saving=1.0 - used_sum / logical_sum if logical_sum else 0.0,
        mean_step_saving=stats.get("step_saving_sum", 0.0) / steps if steps else 0.0,
        peak_used_blocks=stats.get("peak_used_blocks", 0),
        peak_logical_blocks=stats.get("peak_logical_blocks", 0),
    )
