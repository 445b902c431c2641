"""Plain-torch reference of `hf_paged.kernels.sampling.sample_tokens` (CPU, and the check for the Triton kernel).

It does exactly what the Triton kernel does (the same integer arithmetic and float operations), so both give the
same tokens for the same inputs (floating-point sums may round differently; a decision can only differ when a sum lands
on a threshold within rounding, which the tests never meet):

Rows are processed together in chunks (the work is vectorised over rows; the decisions are per row).

1. ``x = logits * inv_t`` (``inv_t = 1 / temperature``, 0 for greedy rows: those take ``argmax(logits)``), ``m = max x``.
2. top-k: the k-th largest value ``t_k``, found by a multi-way bisection on the order-preserving int32 key of the
   float (no sort): each round evaluates ``NC`` candidate thresholds at once (count of keys ``>=`` each).
3. top-p: ``Z_k = sum exp(x - m)`` over ``x >= t_k``; the largest key ``t_p`` whose mass ``sum exp(x - m)`` over
   ``x >= t_p`` is still ``>= p * Z_k`` (the same search, on masses). This keeps a token iff the mass of the strictly
   larger tokens is ``< p`` (transformers' rule; tied tokens are kept or dropped together).
4. min-p: keep ``x - m >= log(min_p)`` (``p_i >= min_p * p_max``).
5. draw: ``argmax(x_i + G_i)`` over kept tokens, ``G_i = -log(-log(u_i))`` (Gumbel-max: exact sampling from the
   renormalised kept distribution, no cumsum), with ``u_i`` a counter-based hash of (seed, offset, i).

`sample_top_k` is the top-k fast path (see `candidate_tokens`): the same tokens, read off each row's largest
``count`` logits, the rows it cannot decide exactly from them passed to `sample_tokens`.
"""

from __future__ import annotations

import torch

__all__ = ["sample_tokens", "sample_top_k", "candidate_tokens", "kept_threshold", "uniform_bits", "NUM_CANDIDATES"]

NUM_CANDIDATES = 16
_CHUNK_ELEMENTS = 1 << 22
_M32 = 0xFFFFFFFF


def _h(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on int64 tensors holding uint32 values (wrapping multiplies keep the low 32 bits)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_keys(seed: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two uint32 keys (as int64) of each row's (seed, offset): its stream depends on nothing else."""
    seed, offset = seed.long(), offset.long()
    k = _h((offset >> 32) & _M32 ^ 0x9E3779B9)
    k = _h((offset & _M32) ^ k)
    k = _h(((seed >> 32) & _M32) ^ k)
    k1 = _h((seed & _M32) ^ k)
    return k1, _h(k1 ^ 0x85EBCA6B)


def uniform_bits(k1: torch.Tensor, k2: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """uint32 random bits (int64) of token `index` in the stream of keys (k1, k2)."""
    return _h(_h(index ^ k1) ^ k2)


def gumbel(k1: torch.Tensor, k2: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gumbel noise ``-log(-log(u))``, ``u = (bits >> 9 + 0.5) / 2**23``: 24 significant bits, so every value is exact
    in float32 and ``u`` stays in (0, 1). (With 24 random bits, ``2**24 - 0.5`` rounded to ``2**24``: ``u = 1`` gave
    ``G = inf``, and one draw in ``2**24 / V`` took a token at random whatever its probability, or a masked one.)"""
    u = ((uniform_bits(k1, k2, index) >> 9).float() + 0.5) * (1.0 / 8388608.0)
    return -torch.log(-torch.log(u))


def float_key(x: torch.Tensor) -> torch.Tensor:
    """Order-preserving int64 key of float32 values (int32 bits, negative magnitudes flipped)."""
    bits = x.float().contiguous().view(torch.int32).long()
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def search(keys: torch.Tensor, weights: torch.Tensor | None, lo: torch.Tensor, hi: torch.Tensor,
           target: torch.Tensor) -> torch.Tensor:
    """Per row, the largest key ``t`` in ``[lo, hi]`` with ``stat(t) >= target``, ``stat(t)`` = count (``weights``
    None) or sum of ``weights`` over ``keys >= t``; ``stat(lo) >= target`` is assumed. ``keys [R, V]``, the rest
    ``[R]``. NC-way bisection, as the kernel does it (rows already converged stay put)."""
    j = torch.arange(1, NUM_CANDIDATES + 1, dtype=torch.long)
    while bool((lo < hi).any()):
        span = (hi - lo)[:, None]
        cands = lo[:, None] + (span * j + NUM_CANDIDATES - 1) // NUM_CANDIDATES
        ge = keys[:, :, None] >= cands[:, None, :]
        if weights is None:
            stat = ge.sum(1).float()
        else:
            stat = torch.where(ge, weights[:, :, None], 0.0).sum(1)
        ok = stat >= target[:, None]
        new_lo = torch.where(ok, cands, lo[:, None]).amax(1)
        new_hi = torch.where(ok, hi[:, None], cands - 1).amin(1)
        active = lo < hi
        lo, hi = torch.where(active, new_lo, lo), torch.where(active, new_hi, hi)
    return lo


def sample_tokens(logits: torch.Tensor, inv_t: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  log_min_p: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Token ids ``[R]`` (int64, on the CPU). Parameters are the dispatcher's normalised ones: ``inv_t`` 0 for greedy,
    ``top_k`` 0 when off, ``top_p`` >= 1 when off, ``log_min_p`` -inf when off."""
    logits = logits.cpu()
    out = logits.argmax(dim=-1)
    inv_t, top_k, top_p, log_min_p = (t.cpu() for t in (inv_t, top_k, top_p, log_min_p))
    rows = torch.nonzero(inv_t > 0).flatten()
    if rows.numel() == 0:
        return out
    chunk = max(1, _CHUNK_ELEMENTS // (logits.shape[1] * NUM_CANDIDATES))  # bounds the [rows, V, NC] temporaries
    seed, offset = seed.cpu(), offset.cpu()
    for start in range(0, rows.numel(), chunk):
        sel = rows[start : start + chunk]
        out[sel] = _sample_rows(logits[sel].float(), inv_t[sel], top_k[sel], top_p[sel], log_min_p[sel],
                                seed[sel], offset[sel])
    return out


def kept_threshold(logits: torch.Tensor, inv_t: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per sampled row (``inv_t > 0``, on the CPU), the int key ``t`` of its top-k / top-p threshold: the row keeps the
    tokens whose scaled logit has key ``>= t`` (min-p aside). Only the set it selects is defined: any key between the
    kept tokens' least key and the next lower token's key selects the same tokens."""
    x = logits.float() * inv_t[:, None]
    m = x.amax(1, keepdim=True)
    return _threshold(x, m, float_key(x), top_k, top_p)


def _threshold(x, m, keys, top_k, top_p) -> torch.Tensor:
    """`kept_threshold` of the scaled rows `x`, their max `m` and keys `keys` (computed once by the caller)."""
    vocab = x.shape[1]
    lo, hi = keys.amin(1), float_key(m)[:, 0]
    k, p = top_k, top_p
    use_k = (k > 0) & (k < vocab)
    if bool(use_k.any()):
        sel = torch.nonzero(use_k).flatten()
        lo[sel] = search(keys[sel], None, lo[sel], hi[sel], k[sel].float())
    use_p = p < 1.0
    if bool(use_p.any()):
        sel = torch.nonzero(use_p).flatten()
        e = torch.exp(x[sel] - m[sel])
        z = torch.where(keys[sel] >= lo[sel, None], e, 0.0).sum(1)
        lo[sel] = search(keys[sel], e, lo[sel], hi[sel], p[sel] * z)
    return lo


def _sample_rows(logits, inv_t, top_k, top_p, log_min_p, seed, offset) -> torch.Tensor:
    """Sampled rows only (``inv_t > 0``), every tensor on the CPU."""
    vocab = logits.shape[1]
    k1, k2 = row_keys(seed, offset)
    x = logits * inv_t[:, None]
    m = x.amax(1, keepdim=True)
    keys = float_key(x)
    lo = _threshold(x, m, keys, top_k, top_p)
    keep = (keys >= lo[:, None]) & ((x - m) >= log_min_p[:, None])
    index = torch.arange(vocab, dtype=torch.long)[None, :]
    score = torch.where(keep, x + gumbel(k1[:, None], k2[:, None], index), -float("inf"))
    return score.argmax(1)


def sample_top_k(logits: torch.Tensor, inv_t: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 log_min_p: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, count: int) -> torch.Tensor:
    """`sample_tokens`' tokens (int64, on the CPU) from each row's ``count`` largest logits (`candidate_tokens`);
    the rows those cannot decide (a tie reaching past them, top-k off or >= count, non-finite or zero values) go
    through `sample_tokens`."""
    logits = logits.cpu()
    params = [t.cpu() for t in (inv_t, top_k, top_p, log_min_p, seed, offset)]
    values, indices = logits.topk(min(count, logits.shape[1]), dim=1)
    out = candidate_tokens(values, indices, logits.shape[1], *params)
    rest = torch.nonzero(out < 0).flatten()
    if rest.numel():
        out[rest] = sample_tokens(logits[rest], *(t[rest] for t in params))
    return out


def candidate_tokens(values: torch.Tensor, indices: torch.Tensor, vocab: int, inv_t: torch.Tensor,
                     top_k: torch.Tensor, top_p: torch.Tensor, log_min_p: torch.Tensor, seed: torch.Tensor,
                     offset: torch.Tensor) -> torch.Tensor:
    """Each row's token, as `sample_tokens` picks it, from its ``L`` largest logits sorted (``values, indices [R, L]``
    of ``topk(L)`` of a row of ``vocab``), or -1 where they do not decide it. The Triton fast path's candidate kernel
    (`triton_topk_sampling`) does the same, row by row.

    Why they decide it: scaling by ``inv_t > 0`` keeps the order (it may merge neighbours into ties), so the sorted
    candidates give the row's sorted scaled values from the top. The top-k set is every token whose key is >= the k-th
    largest, ``x[k-1]``: when ``x[k-1] > x[L-1]`` (or ``L = vocab``) no token outside the list reaches it, and the set
    is the list's first ``n >= k`` entries, ties at the boundary included. Where the set holds no zero (the one value
    whose two keys, -0 and +0, compare equal as floats) and no NaN, keys and floats order it alike: top-p keeps the
    values ``>= x[j]``, ``j`` the first rank whose running mass ``sum exp(x - m)`` reaches ``p * Z``, ``Z`` the set's
    mass (the reference's threshold: the mass of the keys >= ``x[j]`` reaches the target, that of the keys above it
    does not); min-p and the Gumbel-max draw (same noise for the same token index, the least index among equal scores)
    follow. A greedy row (``inv_t = 0``) takes the least index of the values equal to the first, when the list holds
    all of them (a value past the list's last). Undecided: a tie reaching the list's end, ``k`` off or ``>= L``, a
    non-finite maximum, a zero or NaN in the kept set."""
    rows, count = values.shape
    v = values.float()
    idx = indices.long()
    full = count >= vocab
    none = torch.full((rows,), vocab, dtype=torch.long)
    # greedy rows
    top = v[:, 0]
    greedy_ok = (top == top) & (full | (v[:, -1] < top))
    greedy = torch.where(v == top[:, None], idx, none[:, None]).amin(1)
    # sampled rows
    x = v * inv_t[:, None]
    k = top_k.long()
    m = x[:, :1]
    kth = x.gather(1, (k - 1).clamp(0, count - 1)[:, None])
    in_k = x >= kth
    bad = (in_k & ((x == 0) | (x != x))).any(1)
    ok = (k >= 1) & (k < count) & (m[:, 0] < float("inf")) & (kth[:, 0] == kth[:, 0]) & ~bad
    ok &= full | (kth[:, 0] > x[:, -1])
    e = torch.where(in_k, torch.exp(x - m), 0.0)
    running = e.cumsum(1)
    reach = in_k & (running >= top_p[:, None] * running[:, -1:])
    j = torch.where(reach, torch.arange(count)[None, :], count).amin(1)
    thr = torch.where((top_p < 1.0) & (j < count), x.gather(1, j.clamp(max=count - 1)[:, None])[:, 0], kth[:, 0])
    keep = in_k & (x >= thr[:, None]) & ((x - m) >= log_min_p[:, None])
    k1, k2 = row_keys(seed, offset)
    score = torch.where(keep, x + gumbel(k1[:, None], k2[:, None], idx), -float("inf"))
    best = score.amax(1, keepdim=True)
    sampled = torch.where(keep & (score == best), idx, none[:, None]).amin(1)
    return torch.where(inv_t > 0, torch.where(ok, sampled, -1), torch.where(greedy_ok, greedy, -1))
