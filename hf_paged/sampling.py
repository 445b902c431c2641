"""Per-request sampling parameters and batched sampling on the logits' device.

Greedy is the special case `do_sample=False`. Processing order follows transformers' `generate()`: repetition
penalty, user `LogitsProcessor`s and `min_new_tokens` first, then (sampling only) temperature, top-k, top-p, min-p.
Sampling draws with the exponential-race trick (`argmax(p / E)`, `E ~ Exp(1)`), which equals multinomial sampling and
lets every seeded request use its own generator without leaving the device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field, fields

import torch

__all__ = ["SamplingParams", "sample_next_tokens"]


def _as_token_list(value, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a list of ints, got {value!r}")
    if isinstance(value, int):
        return (value,)
    if isinstance(value, SequenceABC) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise TypeError(f"{name} must be an int or a list of ints, got {value!r}")


@dataclass
class SamplingParams:
    """What one request asks for. Validation errors name the offending argument."""

    max_new_tokens: int = 20
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    eos_token_id: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    num_return_sequences: int = 1
    logits_processor: object = None
    output_scores: bool = False
    num_beams: int = 1  # > 1: beam search (hf_paged.beam), transformers' arithmetic
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.eos_token_id = _as_token_list(self.eos_token_id, "eos_token_id")
        if isinstance(self.stop_strings, str):
            self.stop_strings = (self.stop_strings,)
        self.stop_strings = tuple(self.stop_strings or ())
        self.validate()

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in fields(cls)} - {"extra"}

    def validate(self) -> None:
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.max_new_tokens):
            raise TypeError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if not is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be a non-negative int, got {self.min_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise TypeError(f"temperature must be a number, got {self.temperature!r}")
        if self.do_sample and not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative int (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and not is_int(self.seed):
            raise TypeError(f"seed must be an int, got {self.seed!r}")
        if not is_int(self.num_return_sequences) or self.num_return_sequences < 1:
            raise ValueError(f"num_return_sequences must be a positive int, got {self.num_return_sequences!r}")
        from .beam import validate_beam_params

        validate_beam_params(self)
        if self.num_return_sequences > 1 and not self.do_sample and self.num_beams == 1:
            raise ValueError(
                "num_return_sequences > 1 needs do_sample=True (greedy would return identical copies) or num_beams"
            )
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise TypeError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")

    @property
    def needs_processing(self) -> bool:
        return self.repetition_penalty != 1.0 or self.logits_processor is not None or self.min_new_tokens > 0


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


def _apply_repetition_penalty(scores: torch.Tensor, rows: list[int], penalties: list[float], token_ids, extras) -> None:
    """transformers' rule over the set of ids seen (plus `extra['penalty_ids']`, e.g. pads of a padded batch)."""
    for row, penalty, extra in zip(rows, penalties, extras):
        ids = torch.tensor(sorted(set(token_ids[row]) | set(extra)), dtype=torch.long, device=scores.device)
        picked = scores[row].index_select(0, ids)
        picked = torch.where(picked < 0, picked * penalty, picked / penalty)
        scores[row].index_copy_(0, ids, picked)


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
