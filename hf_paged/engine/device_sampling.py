"""Token picks that stay on the device: greedy and plain sampled rows in one call, with per-row parameters.

A "plain" request (one sequence per sample, no logits processors, no repetition penalty, no `min_new_tokens`, no
scores, no beams) has its next token as a pure function of its logits row and five numbers: temperature (0 for
greedy), top-k, top-p, min-p and a seed, plus the position it draws for. `DevicePicker.pick` takes every such row of a
step at once: the parameters travel in one pinned upload, already in the kernel's form (inverse temperature, effective
top-k: computed on the host, bitwise as `hf_paged.kernels.sampling.sample_tokens` computes them on the device), the
draw is one kernel, nothing waits for the host, so sampled requests take the pipelined, graph-replayed decode path of
greedy ones. When every sampled row of a step has top-k on with k <= `TOP_K_MAX` (the bound is read off the host
columns as they are filled), the step takes the sampler's top-k fast path (`hf_paged.kernels.sampling`: the same
tokens from each row's largest logits; the rows those cannot decide fall back on the device).

Seeds: the draw of a token is a function of (seed, offset) only, where offset = the token's position in its
sequence plus the sample index of a parallel-sampling request shifted by 32 bits. So a seeded request gives the same
tokens whatever runs beside it, however it is preempted, and in every run. A request without a seed gets one from
the engine's own random stream (`Engine(seed=...)`) when it is added.
"""

from __future__ import annotations

import random
from operator import itemgetter

import numpy as np
import torch

from ..core import Sequence
from ..kernels.sampling import (
    effective_top_k,
    greedy_picker,
    inverse_temperature,
    log_min_p,
    sample_normalised,
    top_k_bound,
    warm_up_selection,
)
from ..runner import recording
from .params import SamplingParams

__all__ = ["DevicePicker", "device_params", "offset", "SAMPLE_INDEX_SHIFT"]

SAMPLE_INDEX_SHIFT = 32  # offset = position | sample_index << 32


def device_params(params: SamplingParams, seed: int) -> tuple[float, int, float, float, int] | None:
    """(temperature, top_k, top_p, min_p, seed) of a request whose picks can stay on the device, else None.

    Greedy requests have temperature 0. Requests that need host-side logits processing (repetition penalty, user
    logits processors, `min_new_tokens`), scores, logprobs, or beams return None.
    """
    if params.num_beams > 1 or params.needs_processing or params.output_scores or params.logprobs is not None:
        return None
    if not params.do_sample:
        return (0.0, 0, 1.0, 0.0, seed)
    return (float(params.temperature), int(params.top_k), float(params.top_p), float(params.min_p), seed)


class DevicePicker:
    """Per-row parameters uploaded through pinned buffers (two sets, alternated: a pipelined step fills one while the
    step before may still read the other), then one sampling call for the whole step. `top_k_fast_path` (default on)
    lets steps whose sampled rows all have a small top-k take the sampler's fast path (same tokens)."""

    top_k_fast_path = True

    def __init__(self, device: torch.device, max_rows: int, seed: int | None) -> None:
        self.device = device
        self._rng = random.Random(seed if seed is not None else torch.initial_seed())
        self._sampled: tuple[list | None, bool] = (None, False)
        self._argmax = greedy_picker(device)  # the greedy pick, resolved once (it runs every greedy step)
        self._allocate(max_rows)

    def _allocate(self, rows: int) -> None:
        """Host (pinned on CUDA, two sets) and device buffers for `rows` rows: float32 [inverse temperature, top-p,
        min-p or its log], int64 [seed, offset], int32 [effective top-k]."""
        pin = self.device.type == "cuda"
        shapes = (((3, rows), torch.float32), ((2, rows), torch.long), ((1, rows), torch.int32))
        self._host = [tuple(torch.zeros(shape, dtype=dtype, pin_memory=pin) for shape, dtype in shapes)
                      for _ in range(2)]
        self._dev = tuple(torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in shapes)
        # per host set: the spec list whose parameter columns it holds, whether one of them has min-p, and the top-k
        # fast path's bound (`top_k_bound`) (a `DecodeBatch` passes one list for all its steps: its columns are filled
        # once per set); the list itself is kept, so its id cannot be reused
        self._filled: list[tuple[list, bool, int] | None] = [None, None]
        # the spec list (and row count) whose float and top-k columns the device buffers hold now, and the device
        # rows of the last row count: a `DecodeBatch`'s steps upload only their offsets, and slice nothing again
        self._uploaded: tuple[list, int] | None = None
        self._views: tuple | None = None

    def any_sampled(self, specs: list[tuple]) -> bool:
        """Whether some row samples (else every pick is an argmax); remembered for the last list asked about."""
        last, answer = self._sampled
        if specs is not last:
            answer = any(spec[0] for spec in specs)
            self._sampled = (specs, answer)
        return answer

    def warm_up(self, vocab: int, dtype: torch.dtype) -> None:
        """Compile the sampling kernel for `[rows, vocab]` logits of `dtype` now (2-3 s on a cold cache, 0.1 s from
        Triton's on-disk cache) rather than in the first sampled step, and the greedy pick's kernel for `dtype` and
        float32 (models that upcast their logits) rather than in the first greedy step. Only CUDA compiles anything."""
        if self.device.type != "cuda" or vocab <= 0:
            return
        logits = torch.zeros((1, vocab), dtype=dtype, device=self.device)
        self.pick(logits, [(1.0, 2, 0.5, 0.0, 0)], [0])  # the top-k fast path (the tied row falls back: every kernel)
        self.pick(logits, [(1.0, 0, 0.5, 0.0, 0)], [0])  # the full kernel alone
        if self.top_k_fast_path:
            warm_up_selection(vocab, dtype, self.device)  # Triton's radix select, if chosen: every top-k's variant
        warm_greedy = getattr(self._argmax, "warm_up", None)  # the Triton pick's two paths; torch's argmax has one
        for pick_dtype in {dtype, torch.float32}:
            if warm_greedy is not None:
                warm_greedy(vocab, pick_dtype)
            else:
                self.pick(logits.to(pick_dtype), [(0.0, 0, 1.0, 0.0, 0)], [0])
        recording.device_synchronize(self.device)

    def request_seed(self, seed: int | None) -> int:
        """The seed a request draws with: its own, or the next one of the engine's random stream."""
        return seed if seed is not None else self._rng.getrandbits(62)

    def pick(self, logits: torch.Tensor, specs: list[tuple], offsets: list[int]) -> torch.Tensor:
        """Next token of every row of `logits` `[R, V]`, on the device: row i draws with `specs[i]` (from
        `device_params`) at `offsets[i]` (see `offset`)."""
        if not self.any_sampled(specs):
            return self._argmax(logits)  # all greedy: no parameters to upload
        n = len(specs)
        if n > self._dev[0].shape[1]:
            self._allocate(max(n, 2 * self._dev[0].shape[1]))
        self._host.reverse()  # never the set a step still in flight may be reading
        self._filled.reverse()
        host = self._host[0]
        f, i, k = (t.numpy() for t in host)
        filled = self._filled[0]
        if filled is not None and filled[0] is specs:
            _, with_min_p, bound = filled
        else:  # this set holds other rows' columns: fill them
            f[0, :n] = inverse_temperature(_column(specs, 0, np.float32))
            f[1, :n] = _column(specs, 2, np.float32)
            f[2, :n] = _column(specs, 3, np.float32)
            with_min_p = bool((f[2, :n] > 0).any())
            if not with_min_p:
                f[2, :n] = -np.inf  # log_min_p of rows without min-p
            i[0, :n] = _column(specs, 4, np.int64)
            k[0, :n] = effective_top_k(_column(specs, 1, np.int64), logits.shape[1])
            bound = top_k_bound(f[0, :n], k[0, :n])
            self._filled[0] = (specs, with_min_p, bound)
        i[1, :n] = offsets
        dev_f, dev_i, dev_k = self._dev
        dev_i.copy_(host[1], non_blocking=True)  # seeds and offsets
        if self._uploaded is None or self._uploaded[0] is not specs or self._uploaded[1] != n:
            dev_f.copy_(host[0], non_blocking=True)
            dev_k.copy_(host[2], non_blocking=True)
            self._uploaded = (specs, n)  # (kept: its id cannot be reused while it is compared)
        views = self._views
        if views is None or views[0] != n:
            views = self._views = (n, dev_f[0, :n], dev_k[0, :n], dev_f[1, :n], dev_f[2, :n], dev_i[0, :n],
                                   dev_i[1, :n])
        _, inv_t, top_k, top_p, min_p, seeds, draws = views
        return sample_normalised(logits, inv_t, top_k, top_p, log_min_p(min_p) if with_min_p else min_p, seeds,
                                 draws, top_k_bound=bound if self.top_k_fast_path else 0)


def _column(specs: list[tuple], index: int, dtype) -> np.ndarray:
    """Field `index` of every spec, as an array. Not `zip(*specs)`: its one iterator per row woke the cycle
    collector every step (a full collection every few hundred steps)."""
    return np.fromiter(map(itemgetter(index), specs), dtype, len(specs))


def offset(seq: Sequence, sample_index: int | None = None) -> int:
    """Where `seq` draws its next token: its position, and its sample index (parallel sampling) in the high bits."""
    index = seq.sample_index if sample_index is None else sample_index
    return len(seq.token_ids) | (index << SAMPLE_INDEX_SHIFT)
