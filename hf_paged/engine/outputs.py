"""What the engine reports: `RequestOutput` / `CompletionOutput`, built from sequence groups after each step, and the
registry of requests they are built from (`RequestRegistry`, a part of `Engine`). The dataclasses are public
(`hf_paged.RequestOutput`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ..core import SequenceGroup, SequenceStatus
from .prompt_logprobs import PROMPT_SCORING

__all__ = ["CompletionOutput", "RequestOutput", "RequestRegistry", "stamp_first_token"]


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    finish_reason: str | None
    text: str | None = None
    scores: list[torch.Tensor] | None = None
    score: float | None = None  # beam search: the hypothesis' score (transformers' `sequences_scores`)
    # `SamplingParams.logprobs`: per output token, (its log-probability, [(token id, log-probability)] of the top
    # `logprobs` tokens), from the model's raw next-token distribution (before temperature / top-p)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class RequestOutput:
    """State of one request after a step: cumulative tokens of each of its sequences."""

    request_id: object
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_preemptions: int = 0
    error: BaseException | None = None
    # perf_counter() timestamps: arrival_time, first_token_time (first output token on the host), finished_time
    metrics: dict = field(default_factory=dict)
    # `SamplingParams.prompt_logprobs_start`: per prompt token from that index on, (its log-probability given the
    # tokens before it, whether it is the most likely token there), float32 log-softmax of the raw logits
    prompt_logprobs: list[tuple[float, bool]] | None = None
    # `SamplingParams.prompt_top_logprobs`: per scored prompt token, (its rank, [(token id, log-probability)] of the
    # most likely tokens there)
    prompt_top_logprobs: list[tuple[int, list[tuple[int, float]]]] | None = None


class RequestRegistry:
    """The engine's requests by id until their final output is reported, and the outputs built from them.

    `groups`: request id -> its `SequenceGroup` (added by `Engine.add_request`, dropped when its final output is
    built); `unreported`: requests finished outside a step (aborted, closed, failed by an interrupt), reported by the
    next step or at the end of `stream()`; `handed_back`: other callers' outputs a `generate()` call stepped past.
    A finished request's sampler state and grammar matcher go with its final output (`sampler`, `structured`);
    `tokenizer()` gives the engine's tokenizer of the moment (the server may set one later) for the finished texts.
    """

    def __init__(self, sampler, structured, tokenizer: Callable[[], object]) -> None:
        self.groups: dict[object, SequenceGroup] = {}
        self.unreported: list[SequenceGroup] = []
        self.handed_back: list[RequestOutput] = []
        self._sampler = sampler
        self._structured = structured
        self._tokenizer = tokenizer

    def outputs(self, advanced: list[SequenceGroup], finished_only: bool,
                finished: list[SequenceGroup] | None = None) -> list[RequestOutput]:
        """Outputs of the groups that advanced (only the finished ones if asked: `finished` when the caller knows
        them, in `advanced`'s order), then of those finished outside a step."""
        if finished_only:
            advanced = finished if finished is not None else [g for g in advanced if g.is_finished]
        return [self.output(g) for g in advanced] + self.collect_finished(exclude=advanced)

    def collect_finished(self, exclude: Iterable[SequenceGroup] = ()) -> list[RequestOutput]:
        """Outputs of the requests finished outside a step (aborted, closed) that were not reported yet, after those
        a `generate()` call stepped to completion for other callers (handed back, see `Engine.generate`)."""
        handed, self.handed_back = self.handed_back, []
        if not self.unreported:
            return handed
        skip = {id(g) for g in exclude}
        done, self.unreported = self.unreported, []
        # `is g`: an id may already belong to a new request (ids are reusable once reported)
        return handed + [self.output(g) for g in done if id(g) not in skip and self.groups.get(g.request_id) is g]

    def output(self, group: SequenceGroup) -> RequestOutput:
        finished = group.is_finished
        if finished:
            self.groups.pop(group.request_id, None)
            self._sampler.forget(group.request_id)
            self._structured.finished(group)
        tokenizer = self._tokenizer() if finished else None
        outputs = []
        for index, seq in enumerate(group.seqs):
            reason = seq.stop_reason if seq.status.is_finished else None
            if seq.status == SequenceStatus.FINISHED_ABORTED:
                reason = "abort"
            elif seq.status == SequenceStatus.FINISHED_ERROR:
                reason = "error"
            text = None
            if tokenizer is not None:
                text = tokenizer.decode(seq.output_ids, skip_special_tokens=True)
            beam_done = finished and getattr(group.params, "num_beams", 1) > 1 and reason in ("eos", "length")
            score = seq.cumulative_logprob if beam_done else None
            scores = group.data.get(seq.seq_id)
            logprobs = group.data.get(("logprobs", seq.seq_id))
            ids = seq.output_ids  # a copy
            if ids and ids[-1] < 0:  # the placeholder of a pipelined step in flight (`pipelined._IN_FLIGHT`)
                ids.pop()
            outputs.append(CompletionOutput(index, ids, reason, text, scores, score,
                                            None if logprobs is None else list(logprobs)))
        scoring = group.data.get(PROMPT_SCORING)
        prompt = group.seqs[0].token_ids[: group.seqs[0].prompt_len] if scoring is None else list(scoring.prompt)
        if finished and "finished_time" not in group.metrics:
            group.metrics["finished_time"] = time.perf_counter()
        return RequestOutput(group.request_id, prompt, outputs, finished, group.num_preemptions, group.error,
                             dict(group.metrics), None if scoring is None else list(scoring.values),
                             list(scoring.tops) if scoring is not None and scoring.top else None)


def stamp_first_token(groups: list[SequenceGroup]) -> list[SequenceGroup]:
    """Record when each group's first output token reached the host (time to first token); returns `groups`."""
    now = None
    for group in groups:
        if "first_token_time" not in group.metrics:
            if now is None:
                now = time.perf_counter()
            group.metrics["first_token_time"] = now
    return groups
