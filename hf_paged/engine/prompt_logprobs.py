"""Prompt log-probabilities (`SamplingParams.prompt_logprobs_start`): scoring prompt tokens during the prefill.

What lm-eval's loglikelihood needs: the log-probability of each continuation token given everything before it, and
whether it is the argmax. A request asking for the scores of its prompt tokens from index `s` on needs the logits of
positions `s - 1 .. n - 2`. The prefill computes them anyway; the runner keeps them as extra rows of the step's
`logits_to_keep` (after the sampling rows), and this module turns them into float32 log-softmax scores, chunk by chunk
(a long prompt is prefilled over several steps).

Two things keep the scores exact and complete:

* The prefix cache may serve the context (that is the sharing: many continuations of one context compute it once),
  but not a position whose logits are still wanted: the group's `max_cached_prefix` caps its prefix hit at the next
  position to score, also when it is recomputed after a preemption (rows already scored are not scored again).
* A scoring-only request (`max_new_tokens=0`) is queued without its last prompt token (that token is only a
  target: its K/V is never needed), so the prefill ends at position `n - 2`, the last scored one, and the request
  finishes there without sampling. So a prompt of `max_position_embeddings + 1` tokens (lm-eval's full windows)
  fits, as it does in transformers' forward over `prompt[:-1]`.

Steps that carry scored rows run eagerly (the static / CUDA-graph path keeps one row per sequence), so they are
never pipelined either (`PipelinedDecode` only pipelines static steps).

How: before a step's forward, `score_rows` lists per scheduled chunk the wanted positions it computes; the runner
keeps them as extra rows after the sampling rows (`ModelRunner.execute(extra_rows=...)`), and they become float32
`log_softmax` scores of the next prompt token plus an argmax flag, appended to the group's `PromptScoring`, which
`RequestOutput.prompt_logprobs` reports. A recompute after a preemption resumes at `PromptScoring.next_position`, so
no row is scored twice. A scoring-only request finishes in `finish_scoring_only`, its blocks freed to the prefix
cache; its `RequestOutput.prompt_token_ids` is the whole prompt. The lm-eval backend
(`hf_paged.integrations.lm_eval`) scores its log-likelihood requests this way; tests: `tests/test_prompt_logprobs.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..core import Scheduler, SchedulerOutput, SequenceGroup, SequenceStatus

__all__ = ["PROMPT_SCORING", "PromptScoring", "finish_scoring_only", "record_prompt_logprobs", "score_rows"]

PROMPT_SCORING = "prompt_scoring"  # key of a group's `PromptScoring` in `SequenceGroup.data`
_ROWS_PER_CHUNK = 1024  # rows converted to float32 at once: bounds the scoring's memory on long prompts


@dataclass
class PromptScoring:
    """The prompt scores one request asked for, filled in as its prefill runs.

    `prompt` is the whole prompt (a scoring-only request's sequence lacks its last token, which is still a target);
    `values[i]` is (log-probability, is argmax) of `prompt[start + i]`.
    """

    prompt: list[int]
    start: int
    values: list[tuple[float, bool]] = field(default_factory=list)
    top: int = 0  # alternatives wanted per scored token (`SamplingParams.prompt_top_logprobs`)
    tops: list[tuple[int, list[tuple[int, float]]]] = field(default_factory=list)  # (rank, top alternatives) each

    @property
    def next_position(self) -> int:
        """The next position whose logits are wanted (scores token `next_position + 1`)."""
        return self.start - 1 + len(self.values)

    @property
    def done(self) -> bool:
        return len(self.values) == len(self.prompt) - self.start

    def rows_in(self, start: int, num_tokens: int) -> tuple[int, int]:
        """(offset in the chunk, count) of the wanted positions among a chunk's positions `[start, start + n)`."""
        if start > self.next_position:  # `max_cached_prefix` keeps admissions from skipping wanted positions
            raise RuntimeError(f"prompt logprobs: position {self.next_position} was skipped (chunk starts at "
                               f"{start}); this is a bug, please report it")
        first = max(start, self.next_position)
        last = min(start + num_tokens, len(self.prompt) - 1)  # exclusive: position n - 2 scores the last token
        return first - start, max(0, last - first)


def start_scoring(group: SequenceGroup, prompt: list[int], start: int, top: int = 0) -> None:
    """Attach a `PromptScoring` to a new group and keep the prefix cache off the positions it needs."""
    group.data[PROMPT_SCORING] = PromptScoring(list(prompt), start, top=top)
    group.max_cached_prefix = start - 1


def score_rows(sched: SchedulerOutput) -> list[tuple[int, int, int]]:
    """The step's wanted prompt positions: (index in `sched.scheduled`, offset in its chunk, count) per item."""
    rows, seen = [], set()
    for k, item in enumerate(sched.scheduled):
        scoring = item.group.data.get(PROMPT_SCORING)
        if scoring is None or scoring.done or id(scoring) in seen:
            continue  # (a group's samples share one prompt: its first scheduled sequence is scored)
        seen.add(id(scoring))
        offset, count = scoring.rows_in(item.start, item.num_tokens)
        if count:
            rows.append((k, offset, count))
    return rows


def record_prompt_logprobs(sched: SchedulerOutput, rows: list[tuple[int, int, int]], logits: torch.Tensor,
                           num_sampling: int) -> torch.Tensor:
    """Score the extra rows (after the `num_sampling` sampling rows of `logits`); return the sampling rows."""
    extra = logits[num_sampling:]
    targets = []
    for k, offset, count in rows:
        item = sched.scheduled[k]
        first = item.start + offset + 1
        targets.extend(item.group.data[PROMPT_SCORING].prompt[first : first + count])
    target_ids = torch.tensor(targets, dtype=torch.long, device=extra.device)
    values = _score(extra, target_ids)
    top = max(sched.scheduled[k].group.data[PROMPT_SCORING].top for k, _, _ in rows)
    tops = _top(extra, target_ids, top) if top else None
    at = 0
    for k, _, count in rows:
        group = sched.scheduled[k].group
        scoring = group.data[PROMPT_SCORING]
        scoring.values.extend(values[at : at + count])
        if scoring.top:
            scoring.tops.extend((rank, alternatives[: scoring.top]) for rank, alternatives in tops[at : at + count])
        at += count
        group.max_cached_prefix = None if scoring.done else scoring.next_position
    return logits[:num_sampling]


def finish_scoring_only(sched: SchedulerOutput, logits: torch.Tensor, scheduler: Scheduler
                        ) -> tuple[SchedulerOutput, torch.Tensor, list[SequenceGroup]]:
    """Finish the scoring-only requests (`max_new_tokens=0`) whose prefill ends in this step, without sampling
    (`scheduler` frees their blocks).

    Returns the step without them, its sampling logits without their rows, and the finished groups.
    """
    kept, kept_rows, done = [], [], []
    row = 0
    for item in sched.scheduled:
        if item.sample and item.group.params.max_new_tokens == 0:
            item.seq.num_computed += item.num_tokens
            item.seq.status, item.seq.stop_reason = SequenceStatus.FINISHED_LENGTH, "length"
            done.append(item.group)
        else:
            kept.append(item)
            if item.sample:
                kept_rows.append(row)
        row += item.sample
    if not done:
        return sched, logits, []
    scheduler.remove_finished(done)  # frees the blocks; their full ones stay in the prefix cache
    if len(kept_rows) != logits.shape[0]:
        logits = logits.index_select(0, torch.tensor(kept_rows, dtype=torch.long, device=logits.device))
    return replace(sched, scheduled=kept), logits, done


def _score(rows: torch.Tensor, targets: torch.Tensor) -> list[tuple[float, bool]]:
    """(log-probability of `targets[i]` under `rows[i]`, whether it is the argmax), in float32, as lm-eval does."""
    logprobs, greedy = [], []
    for begin in range(0, rows.shape[0], _ROWS_PER_CHUNK):
        chunk = rows[begin : begin + _ROWS_PER_CHUNK].float().log_softmax(-1)
        target = targets[begin : begin + _ROWS_PER_CHUNK]
        logprobs.append(chunk.gather(1, target[:, None])[:, 0])
        greedy.append(chunk.argmax(-1) == target)
    if not logprobs:
        return []
    return list(zip(torch.cat(logprobs).tolist(), torch.cat(greedy).tolist()))


def _top(rows: torch.Tensor, targets: torch.Tensor, k: int) -> list[tuple[int, list[tuple[int, float]]]]:
    """Per row: the rank of `targets[i]` (1: the most likely) and the `k` most likely tokens with their
    log-probabilities (float32 log-softmax, as `_score`)."""
    out = []
    for begin in range(0, rows.shape[0], _ROWS_PER_CHUNK):
        chunk = rows[begin : begin + _ROWS_PER_CHUNK].float().log_softmax(-1)
        target = targets[begin : begin + _ROWS_PER_CHUNK]
        chosen = chunk.gather(1, target[:, None])
        ranks = (chunk > chosen).sum(1) + 1
        values, ids = chunk.topk(k, dim=-1)
        for rank, v, i in zip(ranks.tolist(), values.tolist(), ids.tolist()):
            out.append((rank, list(zip(i, v))))
    return out
