"""Token picks that stay on the device: greedy and plain sampled rows in one call, with per-row parameters.

A "plain" request (one sequence per sample, no logits processors, no repetition penalty, no `min_new_tokens`, no
scores, no beams) has its next token as a pure function of its logits row and five numbers: temperature (0 for
greedy), top-k, top-p, min-p and a seed, plus the position it draws for. `DevicePicker.pick` takes every such row of a
step at once: the parameters travel in one pinned upload, the draw is one kernel (`hf_paged.kernels.sampling.sample_tokens`),
nothing waits for the host, so sampled requests take the pipelined, graph-replayed decode path of greedy ones.

Seeds: the draw of a token is a function of (seed, offset) only, where offset = the token's position in its
sequence plus the sample index of a parallel-sampling request shifted by 32 bits. So a seeded request gives the same
tokens whatever runs beside it, however it is preempted, and in every run. A request without a seed gets one from
the engine's own random stream (`Engine(seed=...)`) when it is added.
"""

from __future__ import annotations

import random

import torch

from ..core import Sequence
from ..kernels.sampling import sample_tokens
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
    step before may still read the other), then one `kernels.sample_tokens` call for the whole step."""

    def __init__(self, device: torch.device, max_rows: int, seed: int | None) -> None:
        self.device = device
        self._rng = random.Random(seed if seed is not None else torch.initial_seed())
        pin = device.type == "cuda"
        self._host = [(torch.zeros((3, max_rows), dtype=torch.float32, pin_memory=pin),
                       torch.zeros((3, max_rows), dtype=torch.long, pin_memory=pin)) for _ in range(2)]
        self._dev_f = torch.zeros((3, max_rows), dtype=torch.float32, device=device)
        self._dev_i = torch.zeros((3, max_rows), dtype=torch.long, device=device)

    def warm_up(self, vocab: int, dtype: torch.dtype) -> None:
        """Compile the sampling kernel for `[rows, vocab]` logits of `dtype` now (2-3 s on a cold cache, 0.1 s from
        Triton's on-disk cache) rather than in the first sampled step. Only CUDA compiles anything."""
        if self.device.type != "cuda" or vocab <= 0:
            return
        logits = torch.zeros((1, vocab), dtype=dtype, device=self.device)
        self.pick(logits, [(1.0, 2, 0.5, 0.0, 0)], [0])
        torch.cuda.synchronize(self.device)

    def request_seed(self, seed: int | None) -> int:
        """The seed a request draws with: its own, or the next one of the engine's random stream."""
        return seed if seed is not None else self._rng.getrandbits(62)

    def _grow(self, rows: int) -> None:
        if rows > self._dev_f.shape[1]:
            size = max(rows, 2 * self._dev_f.shape[1])
            pin = self.device.type == "cuda"
            self._host = [(torch.zeros((3, size), dtype=torch.float32, pin_memory=pin),
                           torch.zeros((3, size), dtype=torch.long, pin_memory=pin)) for _ in range(2)]
            self._dev_f = torch.zeros((3, size), dtype=torch.float32, device=self.device)
            self._dev_i = torch.zeros((3, size), dtype=torch.long, device=self.device)

    def pick(self, logits: torch.Tensor, specs: list[tuple], offsets: list[int]) -> torch.Tensor:
        """Next token of every row of `logits` `[R, V]`, on the device: row i draws with `specs[i]` (from
        `device_params`) at `offsets[i]` (see `offset`)."""
        if not any(spec[0] for spec in specs):
            return logits.argmax(dim=-1)  # all greedy: no parameters to upload
        n = len(specs)
        self._grow(n)
        self._host.reverse()
        host_f, host_i = self._host[0]
        f, i = host_f.numpy(), host_i.numpy()
        temperature, top_k, top_p, min_p, seed = zip(*specs)
        f[0, :n], f[1, :n], f[2, :n] = temperature, top_p, min_p
        i[0, :n], i[1, :n], i[2, :n] = top_k, seed, offsets
        dev_f, dev_i = self._dev_f, self._dev_i
        dev_f.copy_(host_f, non_blocking=True)
        dev_i.copy_(host_i, non_blocking=True)
        return sample_tokens(logits, dev_f[0, :n], dev_i[0, :n], dev_f[1, :n], dev_f[2, :n], dev_i[1, :n],
                             dev_i[2, :n])


def offset(seq: Sequence, sample_index: int | None = None) -> int:
    """Where `seq` draws its next token: its position, and its sample index (parallel sampling) in the high bits."""
    index = seq.sample_index if sample_index is None else sample_index
    return len(seq.token_ids) | (index << SAMPLE_INDEX_SHIFT)
