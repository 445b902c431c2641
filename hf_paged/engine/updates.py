"""Applying a step's picks: sample (or argmax) the next tokens, append them, fork parallel samples, run beam
search, and check stop conditions. A mixin of `Engine`.

Parallel sampling (`num_return_sequences=n` with `do_sample=True`): once the prompt's last token is computed, the
step samples n tokens and forks n - 1 sequences from the prompt's table (`BlockManager.fork`: reference counts up, no
copy). Plain greedy requests (`SequenceGroup.plain`: one sequence, no logits processing, no scores) take the argmax
fast path of `_update_plain`. Beam groups go to `hf_paged.engine.beam.BeamSearch`.
"""

from __future__ import annotations

from collections import Counter

import torch

from ..core import SchedulerOutput, Sequence, SequenceGroup, SequenceStatus
from .criteria import criteria_hit
from .device_sampling import offset
from .grammar import GRAMMAR
from .params import SamplingParams

__all__ = ["TokenUpdates", "unique_groups"]


def unique_groups(groups: list[SequenceGroup]) -> list[SequenceGroup]:
    """Each group once, in order: the samples of a forked parallel-sampling group are scheduled as several plain
    rows, and a group must be reported once per step."""
    unique = {id(group): group for group in groups}
    return groups if len(unique) == len(groups) else list(unique.values())


class TokenUpdates:
    """Token selection and per-sequence updates after a forward; a mixin of `Engine`."""

    def _share(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tensor parallelism: every rank takes the first rank's picks (no-op in a single process)."""
        return tokens if self.tp is None else self.tp.share(tokens)

    def _sample_and_update(self, sched: SchedulerOutput, logits: torch.Tensor) -> list[SequenceGroup]:
        """Pick the next tokens, append them, apply stop conditions and forks; return the groups that advanced."""
        scheduled = sched.scheduled
        if logits.shape[0] == len(scheduled) and all(item.group.plain for item in scheduled):
            return self._update_plain(scheduled, logits)
        rows, params, histories, num_out, keys, owners = [], [], [], [], [], []
        device_rows, device_specs, device_offsets, device_owners = [], [], [], []
        beam_entries = []
        logit_row = 0
        for item in scheduled:
            item.seq.num_computed += item.num_tokens
            if not item.sample:
                continue
            p = item.group.params
            if p.num_beams > 1:  # beam groups are scored together by hf_paged.engine.beam
                beam_entries.append((item, logit_row))
                logit_row += 1
                continue
            copies = p.num_return_sequences if (len(item.group.seqs) == 1 and not item.seq.output_ids) else 1
            spec = item.group.data.get("device_params")
            if spec is not None:  # drawn on the device as in a plain step (the same tokens whatever the neighbours)
                for j in range(copies):
                    device_rows.append(logit_row)
                    device_specs.append(spec)
                    device_offsets.append(offset(item.seq, j if copies > 1 else None))
                    device_owners.append(item)
                logit_row += 1
                continue
            for _ in range(copies):
                rows.append(logit_row)
                params.append(p)
                histories.append(item.seq.token_ids)
                num_out.append(item.seq.num_tokens - item.seq.prompt_len)
                keys.append(item.group.request_id)
                owners.append(item)
            logit_row += 1
        advanced: dict[int, SequenceGroup] = {}
        if device_rows:
            picked = logits.index_select(0, torch.tensor(device_rows, device=logits.device))
            tokens = self._share(self.picker.pick(picked, device_specs, device_offsets)).tolist()
            self._append_picks(device_owners, tokens, None, advanced)
        if rows:
            if rows == list(range(logits.shape[0])):
                picked = logits  # one row per sampling sequence, in order: no gather, no index upload
            else:
                picked = logits.index_select(0, torch.tensor(rows, device=logits.device))
            tokens, scores = self.sampler(picked, params, histories, num_out, keys)
            self._append_picks(owners, self._share(tokens).tolist(), scores, advanced, picked)
        if beam_entries:
            for group in self.beam_search.step(beam_entries, logits):
                advanced.setdefault(id(group), group)
        groups = list(advanced.values())
        for group in groups:
            for seq in group.seqs:
                if seq.status.is_finished:
                    self.scheduler.free_seq(seq)
        self.scheduler.remove_finished(groups)
        return groups

    def _pick(self, scheduled, logits: torch.Tensor, batch=None) -> torch.Tensor:
        """The next token of every scheduled plain sequence (one logits row each), picked on the device. A
        `DecodeBatch` step takes its rows' parameters from the batch (one list for all its steps) and their offsets
        from its positions: one sequence per group (sample index 0), whose tokens end at its position."""
        if batch is not None:
            specs = batch.specs
            return self.picker.pick(logits, specs, batch.offsets() if self.picker.any_sampled(specs) else [])
        specs = [item.group.data["device_params"] for item in scheduled]
        offsets = [offset(item.seq) for item in scheduled] if any(spec[0] for spec in specs) else []
        return self.picker.pick(logits, specs, offsets)

    def _append_picks(self, owners, tokens: list[int], scores, advanced: dict, logits=None) -> None:
        """Append each picked token to its sequence; the 2nd.. picks of one item are new parallel samples (forks).

        `logits`: the rows the tokens were picked from (one per pick); requests asking for `logprobs` record theirs.
        """
        forks: dict[int, int] = {}
        constrained = self.structured.active
        if constrained:  # parallel samples drawn from one row: one grammar matcher each, from the row's state
            picks = Counter(id(item) for item in owners)
            for item in {id(item): item for item in owners}.values():
                if picks[id(item)] > 1:
                    self.structured.fork_samples(item.group, picks[id(item)])
        for j, (item, token) in enumerate(zip(owners, tokens)):
            seq = item.seq
            if forks.get(id(item), 0) > 0:
                seq = self._fork(item)
            forks[id(item)] = forks.get(id(item), 0) + 1
            seq.token_ids.append(int(token))
            if scores is not None and item.group.params.output_scores:
                item.group.data.setdefault(seq.seq_id, []).append(scores[j].detach().to("cpu"))
            if logits is not None and item.group.params.logprobs is not None:
                item.group.data.setdefault(("logprobs", seq.seq_id), []).append(
                    _token_logprobs(logits[j], int(token), item.group.params.logprobs))
            grammar_end = self.structured.accept(item.group, seq, int(token)) if constrained else None
            self._check_stop(seq, item.group.params)
            if grammar_end is not None and not seq.status.is_finished:
                self._finish_by_grammar(item.group, seq, grammar_end, int(token))
            advanced.setdefault(id(item.group), item.group)
        for item in owners:
            group = item.group
            if len(group.seqs) > 1 and group.data.get("device_params") is not None and GRAMMAR not in group.data:
                group.plain = True  # forked: each sample now draws alone, on the device

    def _update_plain(self, scheduled, logits: torch.Tensor) -> list[SequenceGroup]:
        """The hot path: every scheduled sequence is a plain one (greedy or sampled on the device) that samples."""
        tokens = self._share(self._pick(scheduled, logits)).tolist()  # the step's one host sync
        check_stop = self._check_stop
        finished = []
        for item, token in zip(scheduled, tokens):
            seq = item.seq
            seq.num_computed += item.num_tokens
            seq.token_ids.append(token)
            check_stop(seq, item.group.params)
            if seq.status.is_finished:
                finished.append(item.group)
        if finished:
            self.scheduler.remove_finished(finished)
        return unique_groups([item.group for item in scheduled])

    @staticmethod
    def _finish_by_grammar(group: SequenceGroup, seq: Sequence, end: str, token: int) -> None:
        """The grammar ended the sequence (complete and closed: stop reason "grammar"), or refused its token (every
        token was masked, or the mask and the matcher disagree: the request fails, naming the token)."""
        if end == "grammar":
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, "grammar"
            return
        seq.status = SequenceStatus.FINISHED_ERROR
        group.error = RuntimeError(f"the grammar refused token {token} (request {group.request_id!r})")

    def _fork(self, item) -> Sequence:
        """Parallel sampling: a new sample shares every block of the prompt (ref counts, copy-on-write later)."""
        parent = item.seq
        child = Sequence(token_ids=parent.token_ids[: parent.num_computed], prompt_len=parent.prompt_len,
                         sample_index=len(item.group.seqs))
        child.num_computed = parent.num_computed
        child.status = SequenceStatus.RUNNING
        self.block_manager.fork(parent.seq_id, child.seq_id)
        item.group.seqs.append(child)
        return child

    def _check_stop(self, seq: Sequence, p: SamplingParams) -> None:
        # `PipelinedDecode._apply` skips this call for a token that is no EOS, under max_new_tokens, of a request
        # without stop strings or criteria: a new condition here must be added to its pre-check too
        token_ids = seq.token_ids
        produced = len(token_ids) - seq.prompt_len
        if not p.ignore_eos and token_ids[-1] in p.eos_token_id and produced >= p.min_new_tokens:
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, "eos"
        elif produced >= p.max_new_tokens:
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_LENGTH, "length"
        elif p.stop_strings and self._hits_stop_string(seq, p):
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, "stop_string"
        elif p.stopping_criteria and criteria_hit(token_ids, p.stopping_criteria):
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, "stopping_criteria"

    def _hits_stop_string(self, seq: Sequence, p: SamplingParams) -> bool:
        window = max(len(s) for s in p.stop_strings) + 8
        text = self.tokenizer.decode(seq.output_ids[-window:], skip_special_tokens=False)
        return any(s in text for s in p.stop_strings)


def _token_logprobs(row: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of `token` under the raw distribution of `row`, and the `top` most likely tokens'."""
    logprobs = row.float().log_softmax(-1)
    alternatives = []
    if top:
        values, ids = logprobs.topk(top)
        alternatives = list(zip(ids.tolist(), values.tolist()))
    return float(logprobs[token]), alternatives
