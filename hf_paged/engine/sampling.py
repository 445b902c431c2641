"""Batched sampling on the logits' device, with per-request parameters and generators.

Greedy is the special case `do_sample=False`. Processing order follows transformers' `generate()`: repetition
penalty, user `LogitsProcessor`s and `min_new_tokens` first, then (sampling only) temperature, top-k, top-p, min-p.
Sampling draws with the exponential-race trick (`argmax(p / E)`, `E ~ Exp(1)`), which equals multinomial sampling and
lets every seeded request use its own generator without leaving the device.
"""

from __future__ import annotations

import math

import torch

from .logits import _apply_repetition_penalty
from .params import SamplingParams

__all__ = ["Sampler", "sample_next_tokens"]


def _make_generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Batched next-token selection with per-request parameters and per-request generators."""

    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        self.generator = _make_generator(seed if seed is not None else torch.initial_seed() % 2**63, device)
        self._generators: dict[object, torch.Generator] = {}

    def forget(self, key) -> None:
        self._generators.pop(key, None)

    def _generator_for(self, key, seed: int | None) -> torch.Generator:
        if seed is None:
            return self.generator
        gen = self._generators.get(key)
        if gen is None:
            gen = self._generators[key] = _make_generator(seed, self.device)
        return gen

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        token_ids: list[list[int]],
        num_outputs: list[int],
        keys: list[object],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (`tokens [R]` on the device, processed scores `[R, V]`).

        `logits [R, V]` holds one row per sampling sequence; `token_ids[i]` its prompt + output so far,
        `num_outputs[i]` how many tokens it generated, `keys[i]` identifies its generator (seeded requests).
        """
        return sample_next_tokens(logits, params, token_ids, num_outputs, keys, self)


def sample_next_tokens(logits, params, token_ids, num_outputs, keys, sampler: Sampler):
    if not any(p.do_sample or p.needs_processing or p.output_scores for p in params):
        return logits.argmax(dim=-1), logits  # plain greedy: no float copy of the logits, no per-row work
    scores = logits.float()
    rows_penalty = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rows_penalty:
        _apply_repetition_penalty(
            scores, rows_penalty, [params[i].repetition_penalty for i in rows_penalty], token_ids,
            [params[i].extra.get("penalty_ids", ()) for i in rows_penalty],
        )
    for i, p in enumerate(params):
        if p.logits_processor is not None:
            ids = torch.tensor([token_ids[i]], dtype=torch.long, device=scores.device)
            scores[i : i + 1] = p.logits_processor(ids, scores[i : i + 1])
        if p.min_new_tokens > 0 and num_outputs[i] < p.min_new_tokens and p.eos_token_id:
            scores[i, list(p.eos_token_id)] = -math.inf

    tokens = scores.argmax(dim=-1)
    sample_rows = [i for i, p in enumerate(params) if p.do_sample]
    if not sample_rows:
        return tokens, scores
    index = torch.tensor(sample_rows, device=scores.device)
    sub = scores.index_select(0, index)
    temps = torch.tensor([params[i].temperature for i in sample_rows], device=scores.device, dtype=sub.dtype)
    sub = sub / temps[:, None]
    top_k = [params[i].top_k for i in sample_rows]
    if any(k > 0 for k in top_k):
        vocab = sub.shape[-1]
        ks = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=sub.device)
        sorted_desc = sub.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (ks - 1)[:, None])
        sub = sub.masked_fill(sub < kth, -math.inf)
    top_p = [params[i].top_p for i in sample_rows]
    if any(p < 1.0 for p in top_p):
        ps = torch.tensor(top_p, device=sub.device, dtype=sub.dtype)
        sorted_logits, order = sub.sort(dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - ps)[:, None]
        remove_sorted[:, -1] = False  # keep at least one token
        remove = remove_sorted.scatter(1, order, remove_sorted)
        sub = sub.masked_fill(remove, -math.inf)
    min_p = [params[i].min_p for i in sample_rows]
    if any(m > 0 for m in min_p):
        ms = torch.tensor(min_p, device=sub.device, dtype=sub.dtype)
        probs = sub.softmax(dim=-1)
        threshold = ms[:, None] * probs.max(dim=-1, keepdim=True).values
        sub = sub.masked_fill(probs < threshold, -math.inf)
    probs = sub.softmax(dim=-1)
    noise = torch.empty_like(probs)
    shared = [j for j, i in enumerate(sample_rows) if params[i].seed is None]
    if shared:
        noise[shared] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_(
            generator=sampler.generator
        )
    for j, i in enumerate(sample_rows):
        if params[i].seed is not None:
            gen = sampler._generator_for(keys[i], params[i].seed)
            noise[j] = torch.empty(probs.shape[1], device=probs.device).exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    tokens = tokens.index_copy(0, index, sampled)
    if any(p.output_scores for p in params):
        scores = scores.index_copy(0, index, sub)
    return tokens, scores
