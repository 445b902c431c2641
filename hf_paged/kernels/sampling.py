"""`sample_tokens`: next token of every logits row on the device, greedy or sampled, with per-row parameters.

Backend: the Triton kernel (:mod:`hf_paged.kernels.triton_sampling`) on CUDA tensors when triton imports, the torch
reference (:mod:`hf_paged.kernels.reference_sampling`) otherwise; ``HF_PAGED_BACKEND`` overrides as for the other
kernels (``triton`` on CPU needs ``TRITON_INTERPRET=1``). Both give the same tokens for the same inputs.

Semantics (transformers' warpers, in their order): temperature, then top-k (``0`` or ``>= vocab``: off), then top-p
(``>= 1``: off), then min-p (``0``: off); temperature ``0`` means greedy (``argmax`` of the raw row). Ties at the
top-k / top-p boundary are kept together. The draw is exact sampling from the renormalised kept distribution, keyed
only on the row's (seed, offset), never on its batch. The preparation here is a handful of element-wise ops on
``[R]`` tensors (no host sync), so the call is safe under CUDA-graph capture on the Triton path.

Top-k fast path (``top_k_bound``): a caller that knows on the host that every sampled row has top-k on with
``k <= top_k_bound <= TOP_K_MAX`` (the engine's picker does: `top_k_bound` of its host columns) passes it, and the
call samples from each row's `candidate_count` largest logits (one selection, ``torch.topk`` or Triton's in
:mod:`hf_paged.kernels.triton_radix_select`, then one small kernel: :mod:`hf_paged.kernels.triton_topk_sampling`;
`reference_sampling.sample_top_k` on the CPU), the full sampler taking
only the rows those cannot decide. Same tokens. The bound only chooses the path: a row it does not hold for (or one
whose tie at the k-th value reaches past the list) is sampled by the full sampler, which the device decides (no sync:
the fast path's launches are the same whatever the logits, so it is as safe under CUDA-graph capture; the engine's
picker is not captured, it runs right after the step's graph).
"""

from __future__ import annotations

import numpy as np
import torch

from . import _check_tensor, _triton_module, get_backend, reference_sampling

__all__ = ["argmax_rows", "greedy_picker", "sample_tokens", "sample_normalised", "inverse_temperature",
           "effective_top_k", "log_min_p", "top_k_bound", "candidate_count", "warm_up_selection", "TOP_K_MAX"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)
# the largest top-k of the fast path. Its candidate lists (`candidate_count`: 2k, up to 512) fit one tile of the
# candidate kernel (one compiled variant); torch.topk's cost hardly depends on k at these sizes (a radix select over
# the row, then a sort of the selected), and k <= 256 covers the settings in use (transformers' default 50, Gemma's
# 64, Qwen's 20, 40-100 elsewhere). A larger k takes the full kernel, which is exact too.
TOP_K_MAX = 256
# candidates kept beyond k, at least: a tie at the k-th value must end inside the list. bf16 ties often: in 173 of 240
# flat bf16 rows of 262,144 tokens (bench_sampling's, T 1.0) the 64th and 65th values are equal, so a list of k + 1
# would leave most rows to the full kernel; with 2k (128) the list decided all 240, flat or peaked, and all of the
# Qwen shape's (k 20: 52 candidates) too (`reference_sampling.candidate_tokens` on the CPU: the same decisions)
_MARGIN = 32


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, *,
                  top_k_bound: int = 0) -> torch.Tensor:
    """Token ids ``[R]`` (int64, on the logits' device) of ``logits [R, V]``.

    Every other argument is a ``[R]`` tensor on the same device: ``temperature`` (float, 0 = greedy), ``top_k``
    (int), ``top_p`` and ``min_p`` (float), ``seed`` (int64, >= 0) and ``offset`` (int64, >= 0: where the row draws,
    e.g. its position). A row's token depends only on its logits and its own parameters. ``top_k_bound``: the top-k
    fast path's bound (module docstring; 0: none), the same tokens.
    """
    _check_tensor("logits", logits, 2, _FLOATS)
    dev = logits.device
    rows, vocab = logits.shape
    for name, t, dtypes in (("temperature", temperature, _FLOATS), ("top_k", top_k, _INTS), ("top_p", top_p, _FLOATS),
                            ("min_p", min_p, _FLOATS), ("seed", seed, _INTS), ("offset", offset, _INTS)):
        _check_tensor(name, t, 1, dtypes, dev)
        if t.shape[0] != rows:
            raise ValueError(f"{name} must have shape [{rows}] (one entry per logits row), got {tuple(t.shape)}")
    if vocab == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension")
    if vocab >= 2**31:
        raise ValueError(f"logits vocabulary {vocab} is too large (< 2**31)")
    if not isinstance(top_k_bound, int) or isinstance(top_k_bound, bool) or top_k_bound < 0:
        raise ValueError(f"top_k_bound must be an int >= 0, got {top_k_bound!r}")
    args = (inverse_temperature(temperature.float()), effective_top_k(top_k, vocab), top_p.float().contiguous(),
            log_min_p(min_p.float()), seed.long().contiguous(), offset.long().contiguous())
    return sample_normalised(logits, *args, top_k_bound=top_k_bound)


def sample_normalised(logits: torch.Tensor, inv_t: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      log_min_p: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, *,
                      top_k_bound: int = 0) -> torch.Tensor:
    """`sample_tokens` for parameters already in the kernels' form: ``inv_t`` (float32, 0 for greedy), ``top_k``
    (int32, 0 when off), ``top_p`` (float32), ``log_min_p`` (float32, -inf when off), ``seed`` and ``offset``
    (int64), all contiguous ``[R]`` on the logits' device.

    Why: the engine's picker computes that form on the host while it fills its upload (`inverse_temperature`,
    `effective_top_k`), so a sampled step spends no dozen element-wise launches on it. Nothing is checked here.
    ``top_k_bound``: `sample_tokens`'; the fast path runs when it is in ``1..TOP_K_MAX``."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    args = (logits, inv_t, top_k, top_p, log_min_p, seed, offset)
    fast = 0 < top_k_bound <= TOP_K_MAX and logits.shape[1] > 1
    if get_backend(logits.device) == "triton":
        if fast:
            return _triton_module("triton_topk_sampling").sample_top_k(
                *args, candidate_count(top_k_bound, logits.shape[1]))
        return _triton_module("triton_sampling").sample_tokens(*args)
    if fast:
        return reference_sampling.sample_top_k(*args, candidate_count(top_k_bound, logits.shape[1])).to(logits.device)
    return reference_sampling.sample_tokens(*args).to(logits.device)


def candidate_count(bound: int, vocab: int) -> int:
    """How many of a row's largest logits the fast path reads for top-k up to `bound`: ``2 * bound``, at least
    ``bound + 32`` (a tie at the k-th value must end inside the list for the list to decide the row), at most the
    vocabulary. 512 at `TOP_K_MAX`."""
    return min(vocab, bound + max(bound, _MARGIN))


def warm_up_selection(vocab: int, dtype: torch.dtype, device: torch.device) -> list[int]:
    """Compile the fast path's selection for every top-k bound up to `TOP_K_MAX` when it is Triton's radix select
    (`triton_topk_sampling.TOPK_SELECT`, ``HF_PAGED_TOPK_SELECT=radix``), for rows of `vocab` logits of `dtype`: its
    sizes are compile-time constants of the candidate count, so a request with another top-k would compile kernels in
    a served step. Returns the candidate counts it ran (one per variant); [] for ``torch.topk`` (nothing to
    compile) or off the Triton backend."""
    if get_backend(torch.device(device)) != "triton" or vocab <= 1:
        return []
    module = _triton_module("triton_topk_sampling")
    if module.TOPK_SELECT != "radix":
        return []
    counts = [candidate_count(bound, vocab) for bound in range(1, TOP_K_MAX + 1)]
    return module.triton_radix_select.warm_up(vocab, dtype, torch.device(device), counts)


def top_k_bound(inv_t: np.ndarray, top_k: np.ndarray) -> int:
    """The fast path's bound of a call, on the host: the largest top-k of its sampled rows (``inv_t > 0``) when every
    one of them has top-k on and at most `TOP_K_MAX`, else 0 (also when no row samples). ``inv_t`` and ``top_k``:
    the normalised columns (`inverse_temperature`, `effective_top_k`)."""
    k = np.asarray(top_k)[np.asarray(inv_t) > 0]
    if k.size == 0 or int(k.min()) <= 0:
        return 0
    bound = int(k.max())
    return bound if bound <= TOP_K_MAX else 0


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of ``logits [R, V]``: the greedy pick of every row, as int64 ``[R]``.

    Same result on either backend (the first index of the maximum; the first NaN of a row with one). On CUDA, with
    no more rows than SMs, a Triton kernel spreads the rows over every SM, where torch's reduction gives each row one
    block (:mod:`hf_paged.kernels.triton_argmax`). No device sync: safe under CUDA-graph capture."""
    _check_tensor("logits", logits, 2, _FLOATS)
    if logits.shape[1] == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension")
    if logits.shape[1] >= 2**31:
        raise ValueError(f"logits vocabulary {logits.shape[1]} is too large (< 2**31)")
    return greedy_picker(logits.device)(logits)


def greedy_picker(device: torch.device | str):
    """`argmax_rows` for logits on `device`, resolved once: the backend chosen now, the Triton path's scratch kept
    between calls, no argument checks. For a caller that picks every step (an engine's picker, whose calls run one
    after another on one stream) and hands it `[R, V]` float logits."""
    if get_backend(device) != "triton":
        return _torch_argmax
    return _triton_module("triton_argmax").GreedyPick(torch.device(device))


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def inverse_temperature(temperature):
    """``1 / temperature`` where it is > 0, else 0 (greedy), in float32: of a tensor (on its device) or of a numpy
    array (on the host). Both round the one IEEE division the same way (correctly), so a picker that computes it on
    the host draws exactly the tokens `sample_tokens` draws."""
    if isinstance(temperature, torch.Tensor):
        return torch.where(temperature > 0, 1.0 / temperature.clamp_min(1e-30),
                           torch.zeros_like(temperature)).contiguous()
    t = np.asarray(temperature, dtype=np.float32)
    return np.where(t > 0, np.float32(1.0) / np.maximum(t, np.float32(1e-30)), np.float32(0.0)).astype(np.float32)


def effective_top_k(top_k, vocab: int):
    """The top-k rule: ``k`` where ``0 < k < vocab``, else 0 (off); int32, of a tensor (on its device) or of a numpy
    array (on the host)."""
    if isinstance(top_k, torch.Tensor):
        return torch.where((top_k > 0) & (top_k < vocab), top_k, torch.zeros_like(top_k)).to(torch.int32).contiguous()
    k = np.asarray(top_k)
    return np.where((k > 0) & (k < vocab), k, 0).astype(np.int32)


def log_min_p(min_p: torch.Tensor) -> torch.Tensor:
    """``log(min_p)`` where min-p is on (> 0), else -inf: on the device (float32), where the kernel reads it. The
    picker runs it only for steps with a min-p row, and uploads -inf otherwise."""
    return torch.where(min_p > 0, torch.log(min_p.clamp_min(1e-38)), torch.full_like(min_p, float("-inf"))).contiguous()
