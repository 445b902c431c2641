"""Paged-KV kernels: public dispatchers.

The contract (each function's docstring has its details):

* Pool layout: a layer's caches are ``key_cache [num_blocks, num_kv_heads, block_size, head_dim]`` and
  ``value_cache [num_blocks, num_kv_heads, block_size, head_dim_v]`` (the same tensor where the values are the keys);
  a cache of layers of one shape keeps them in one tensor ``pool[num_layers, 2, num_blocks, ...]``, K at ``pool[l, 0]``
  and V at ``pool[l, 1]`` (`hf_paged.cache.kv_pool` groups layers of other shapes). Token slot ``block_id * block_size + offset``; slot -1 means
  "do not write".
* Types: float32 / float16 / bfloat16, accumulated in float32; int tensors int32 (int64 accepted). A cache may also
  be ``float8_e4m3fn`` (an FP8 KV cache: half a bf16 cache's bytes), with ``k_scale`` / ``v_scale``: float32 device
  tensors of one value or one per KV head (``[1]`` or ``[Hkv]``). A write stores ``clamp(x / scale, -448, 448)``
  rounded to nearest even (`triton_fp8`); the attention kernels read ``stored * scale``, exactly, as 16-bit dot
  operands (the decode kernels' conversion: `triton_fp8.READ_MODE`; the key scale joins the logit scale, the value
  scale multiplies the output, both in float32). The query and the new
  K/V may then be any float type; the output takes the query's. Scales are read on the device: CUDA graphs keep
  them, and a caller may set them in place (`hf_paged.cache.kv_quant` calibrates them once). GQA: query head
  ``h`` reads KV head ``h // (Hq // Hkv)``. The Triton kernels take any head dim from 1 to 1,024 (K and V alike); one
  that is no power of two (Phi-3's 96, Phi-2's 80, MLA's 192) runs in the next power-of-two tile with the extra lanes
  masked (:mod:`hf_paged.kernels.triton_dims`). Heads over 256 (MLA's 576-value latent, Gemma 4's 512) run in wide
  kernels (:mod:`hf_paged.kernels.triton_wide`: a key head in two tiles, at most 16 query heads per decode program,
  the latent read once when ``value_cache`` is ``key_cache`` or a view of its first columns), except the case the
  narrow kernels' small tiles were measured on (`checks.small_tile_heads`: MLA's latent in 16-bit types for at most
  32 query heads per KV head).
* :func:`write_kv` ``(key [T,Hkv,D], value [T,Hkv,Dv], key_cache, value_cache, slot_mapping [T])``: in place, slot
  < 0 skipped; value and value_cache None for a layer whose values are its keys.
* :func:`paged_decode` ``(query [B,Hq,D], key_cache, value_cache, block_tables [B,max_blocks], seq_lens [B], scale,
  kv_start [B] | None, *, split_counters=None, ...) -> [B,Hq,Dv]``: one query token per sequence at position
  ``seq_lens[b] - 1`` over keys ``[kv_start[b], seq_lens[b])``; an empty range gives zeros (never NaN). Split-K on
  the Triton path: the grid's split count comes from the batch's power of two, the KV heads and the SMs
  (``triton_decode.choose_num_splits``: 4 to 64, none from 32 programs per SM), and each sequence cuts its *own*
  keys into at most that many runs of at least 256 keys (the best single setting for 1, 2, 4 and 8 KV heads,
  ``benchmarks/results/h100_2026-11-27g/``), so a graph step (batch padded to its bucket) and an eager step of the
  same sequences give the same bits. :mod:`hf_paged.kernels.triton_decode` says why.
* :func:`write_and_paged_decode`: ``write_kv`` then ``paged_decode``, bit for bit, in one launch on the Triton path
  (the program that reads position ``seq_lens[b] - 1`` stores the step's K/V first, then a CTA barrier). With
  ``split_counters`` (int32 zeros, ``>= B * Hkv``, owned by one stream of launches: the runner's ``"counters"``
  buffer, passed in ``StepMetadata.split_counters``) the last split of a (sequence, KV head) to finish combines the
  partials (an acq_rel counter, loads past L1) and resets its counter, so no combine kernel is launched; the combine
  is one helper shared with the combine kernel (:mod:`hf_paged.kernels.triton_attention_end`), hence the same bits.
  The compiled step's decode-only steps use it (two kernels fewer per layer).
* :func:`paged_prefill` ``(query [T,Hq,D], key_cache, value_cache, block_tables [S,max_blocks], cu_seqlens_q [S+1],
  seq_lens [S], scale, max_seqlen_q, kv_start [S] | None) -> [T,Hq,Dv]``: sequence ``s`` owns rows
  ``[cu[s], cu[s+1])``, its row ``i`` sits at ``p = seq_lens[s] - q_len_s + i`` (own K/V already written) and attends
  ``[kv_start[s], p]`` causally, cached prefix included. Its tile is chosen by the padded head dim, the element size
  and, at head dim 256, the device's shared memory (``triton_prefill._config``); key tiles every row of a query tile
  sees whole run without masks (``triton_prefill._whole_tiles``).
* :func:`copy_blocks` ``(pool, src [N], dst [N])``: ``pool[..., dst[i], :, :, :] = pool[..., src[i], :, :, :]`` for
  every leading index (the block dim is ``pool.dim() - 4``), one launch for all layers; copy-on-write and swap use it.
* Per-call attention options on both attention kernels: ``sliding_window``, ``softcap``, ``sinks``, ``chunk_size``,
  ``alibi_slopes``.
* :mod:`hf_paged.kernels.sampling`: ``sample_tokens`` (the device sampler; ``top_k_bound``: its top-k fast path,
  :mod:`~.triton_topk_sampling`, its candidate lists from ``torch.topk`` or :mod:`~.triton_radix_select`) and ``argmax_rows`` (torch's
  ``argmax(dim=-1)``, bit for bit; a Triton kernel on CUDA while the rows are no more than the SMs);
  ``greedy_picker(device)`` resolves backend, SM count and scratch once, for the engine's picker, which calls it
  every all-greedy step.
* :mod:`hf_paged.kernels.moe`: ``fused_experts`` (a mixture-of-experts layer: routing slots sorted by expert, two
  grouped GEMMs with the activation and the routing weights fused, a top-k combine; :mod:`~.triton_moe`) and its two
  halves ``experts_up`` / ``experts_down``, with the same backend choice (:mod:`~.reference_moe` elsewhere).

Backend: Triton when the tensors are on CUDA and triton imports, the plain-torch
reference (:mod:`hf_paged.kernels.reference`) otherwise. The environment variable
``HF_PAGED_BACKEND=triton|torch`` overrides the choice (``triton`` on CPU tensors
needs ``TRITON_INTERPRET=1`` set before the first kernel call). Triton is imported
lazily, so ``import hf_paged.kernels`` works without it.

The dispatchers only look at shapes / dtypes / devices (no device syncs), so they are
safe on the decode hot path and under CUDA-graph capture.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence

import torch

from . import reference, reference_sparse
from .checks import (
    _FLOAT_DTYPES,
    _INT_DTYPES,
    FP8_DTYPE,
    _check_attention_common,
    _check_caches,
    _check_options,
    _check_scales,
    _check_tensor,
    _check_triton_device,
    _check_triton_dims,
    _last_contig,
    small_tile_heads,
    triton_wide_heads,
)

__all__ = [
    "FP8_DTYPE",
    "write_kv",
    "paged_decode",
    "write_and_paged_decode",
    "paged_prefill",
    "paged_sparse_attention",
    "copy_blocks",
    "decode_variant",
    "prefill_tile_lengths",
    "prefill_query_tile",
    "get_backend",
    "triton_available",
]

_TRITON_OK: bool | None = None


def triton_available() -> bool:
    """True when ``triton`` imports (cached)."""
    global _TRITON_OK
    if _TRITON_OK is None:
        try:
            importlib.import_module("triton")
            importlib.import_module("triton.language")
            _TRITON_OK = True
        except Exception:  # ImportError, or a broken install
            _TRITON_OK = False
    return _TRITON_OK


def get_backend(device: torch.device | str | None = None) -> str:
    """``"triton"`` or ``"torch"`` for tensors on ``device`` (honours ``HF_PAGED_BACKEND``)."""
    env = os.environ.get("HF_PAGED_BACKEND", "").strip().lower()
    if env in ("torch", "triton"):
        if env == "triton" and not triton_available():
            raise RuntimeError("HF_PAGED_BACKEND=triton but triton cannot be imported")
        return env
    if env not in ("", "auto"):
        raise ValueError(f"HF_PAGED_BACKEND must be 'triton', 'torch' or 'auto', got {env!r}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and triton_available():
        return "triton"
    return "torch"


def _triton_module(name: str):
    return importlib.import_module(f"{__name__}.{name}")


# --------------------------------------------------------------------------- #
# public API
# --------------------------------------------------------------------------- #
def write_kv(
    key: torch.Tensor,
    value: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key [T, Hkv, D]`` / ``value [T, Hkv, Dv]`` into the caches at ``slot_mapping [T]`` (slot < 0 skipped).

    ``slot = block_id * block_size + offset``. One fused launch for K and V on the Triton path when ``Dv == D`` (one
    launch each otherwise). ``value`` and ``value_cache`` both None: a layer whose values are its keys (stored once,
    `hf_paged.cache.kv_pool`), only the keys are written. An FP8 cache stores ``clamp(key / k_scale, -448, 448)``
    rounded to nearest even (and V alike); its key / value may be any float type.
    """
    _check_tensor("key", key, 3, _FLOAT_DTYPES)
    dev = key.device
    if (value is None) != (value_cache is None):
        raise ValueError("value and value_cache must both be given, or both be None (values are the keys)")
    if value is None:
        _check_caches(key_cache, key_cache, dev)
    else:
        _check_tensor("value", value, 3, _FLOAT_DTYPES, dev)
        _check_caches(key_cache, value_cache, dev, same_head_dim=False)
        if value.shape[:2] != key.shape[:2] or value.shape[-1] != value_cache.shape[-1]:
            raise ValueError(f"key/value: value must be [{key.shape[0]}, {key.shape[1]}, {value_cache.shape[-1]}] to "
                             f"match key and value_cache, got {tuple(value.shape)}")
    _, hkv, bs, d = key_cache.shape
    _check_scales(key_cache, k_scale, v_scale)
    if key.shape[1:] != (hkv, d):
        raise ValueError(f"key/value must be [T, {hkv}, {d}] to match the cache, got key {tuple(key.shape)}")
    _check_tensor("slot_mapping", slot_mapping, 1, _INT_DTYPES, dev)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must have shape [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if key.shape[0] == 0:
        return
    if get_backend(dev) == "triton":
        _check_triton_dims(d, bs, value.shape[-1] if value is not None else None)
        _check_triton_device(key)
        mod, slots = _triton_module("triton_cache"), slot_mapping.contiguous()
        if value is not None and value.shape[-1] == d:
            mod.write_kv(_last_contig(key), _last_contig(value), key_cache, value_cache, slots, k_scale, v_scale)
            return
        mod.write_kv(_last_contig(key), None, key_cache, None, slots, k_scale, None)
        if value is not None:
            mod.write_kv(_last_contig(value), None, value_cache, None, slots, v_scale, None)
    else:
        reference.write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_start: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    split_counters: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    _num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention: ``query [B, Hq, D]`` (one token per sequence) -> ``out [B, Hq, Dv]``.

    Sequence ``b`` attends keys ``[kv_start[b], seq_lens[b])`` read through
    ``block_tables [B, max_blocks]``; query head ``h`` uses kv head ``h // (Hq // Hkv)``.
    Empty ranges give zeros. ``_num_splits`` (private) forces the Triton split-K count.

    Options (transformers' conventions, positions are cache indices, the query at ``seq_len - 1``):

    * ``sliding_window`` W: keys with ``q - k < W`` only (``kv > q - W`` in ``masking_utils``); blocks wholly
      before the window are not read.
    * ``chunk_size`` C: keys in the query's chunk, ``(k - kv_start) // C == (q - kv_start) // C`` (Llama 4).
    * ``softcap``: logits ``softcap * tanh(scale * q.k / softcap)`` before masking (Gemma 2/3).
    * ``sinks [Hq]``: one learned logit per head added to the softmax denominator only (gpt-oss ``s_aux``).
    * ``alibi_slopes [Hq]``: ALiBi, ``slope[h] * (k - q)`` added to the scaled (capped) logits of head ``h`` (BLOOM,
      MPT, Falcon-RW; a family's bias ``slope * k`` differs from it by a constant per row, which softmax ignores).

    ``value_cache`` may have a head dim ``Dv`` different from the key's (MLA-style); the output has ``Dv``.

    ``split_counters`` (int32 zeros, at least ``B * Hkv``, private to the caller's stream of launches): on the
    Triton path, the last split of a sequence to finish combines the splits, instead of a second kernel over every
    split; the launch leaves them at zero. Same result, bit for bit.

    `k_scale` / `v_scale`: an FP8 cache's scales (see the module docstring).
    """
    opts = dict(sliding_window=sliding_window, softcap=softcap, sinks=sinks, chunk_size=chunk_size,
                alibi_slopes=alibi_slopes)
    return _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, kv_start, opts, num_splits=_num_splits,
                   split_counters=split_counters, scales=(k_scale, v_scale))


def _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, kv_start, opts: dict, num_splits=None,
            new_kv: tuple | None = None, split_counters: torch.Tensor | None = None,
            scales: tuple = (None, None)) -> torch.Tensor:
    """`paged_decode`'s checks and dispatch, shared with `write_and_paged_decode` (`new_kv`: the step's key, value and
    slot mapping; the torch backend writes them first, and ignores `split_counters`; `scales`: an FP8 cache's)."""
    bs, d = _check_attention_common(query, key_cache, value_cache, block_tables, seq_lens, scale, kv_start, "seq_lens",
                                    *scales)
    batch, dev = query.shape[0], query.device
    if batch != seq_lens.shape[0]:
        raise ValueError(f"query has batch {batch} but seq_lens has {seq_lens.shape[0]} entries")
    if new_kv is not None:
        key, value, slot_mapping = new_kv
        _check_tensor("key", key, 3, _FLOAT_DTYPES, dev)
        _check_tensor("value", value, 3, _FLOAT_DTYPES, dev)
        hkv = key_cache.shape[1]
        if tuple(key.shape) != (batch, hkv, d) or tuple(value.shape) != (batch, hkv, value_cache.shape[-1]):
            raise ValueError(f"key/value must be [{batch}, {hkv}, head_dim] to match query and the cache, got "
                             f"{tuple(key.shape)} and {tuple(value.shape)}")
        _check_tensor("slot_mapping", slot_mapping, 1, _INT_DTYPES, dev)
        if slot_mapping.shape[0] != batch:
            raise ValueError(f"slot_mapping must have shape [{batch}], got {tuple(slot_mapping.shape)}")
    if split_counters is not None:
        _check_tensor("split_counters", split_counters, 1, (torch.int32,), dev)
        if split_counters.numel() < batch * key_cache.shape[1]:
            raise ValueError(f"split_counters must hold at least batch * KV heads = {batch * key_cache.shape[1]} "
                             f"counters, got {split_counters.numel()}")
    _check_options(query.shape[1], query.device, **opts)
    if get_backend(query.device) == "triton":
        _check_triton_dims(d, bs, value_cache.shape[-1], query.shape[1] // key_cache.shape[1], query.element_size())
        _check_triton_device(query)
        if new_kv is not None:
            new_kv = (_last_contig(new_kv[0]), _last_contig(new_kv[1]), new_kv[2].contiguous())
        wide = _wide(d, value_cache.shape[-1], query.shape[1] // key_cache.shape[1], query.element_size())
        return _triton_module("triton_decode_wide" if wide else "triton_decode").paged_decode(
            _last_contig(query),
            key_cache,
            value_cache,
            _last_contig(block_tables),
            seq_lens.contiguous(),
            float(scale),
            kv_start.contiguous() if kv_start is not None else None,
            num_splits=num_splits,
            new_kv=new_kv,
            split_counters=split_counters,
            k_scale=scales[0],
            v_scale=scales[1],
            **opts,
        )
    if new_kv is not None:
        reference.write_kv(*new_kv[:2], key_cache, value_cache, new_kv[2], k_scale=scales[0], v_scale=scales[1])
    return reference.paged_decode(query, key_cache, value_cache, block_tables, seq_lens, float(scale), kv_start,
                                  k_scale=scales[0], v_scale=scales[1], **opts)


def write_and_paged_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_start: torch.Tensor | None = None,
    *,
    split_counters: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`write_kv(key, value, ..., slot_mapping)` then `paged_decode(query, ...)`, in one launch on the Triton path.

    `key`/`value [B, Hkv, D]` are the decode step's own tokens: sequence ``b``'s sits at position ``seq_lens[b] - 1``
    and goes to slot ``slot_mapping[b]`` (skipped when < 0). Why: the write was a kernel
    of its own in every layer of a decode step, about 1.5 us plus a launch gap on an H100 (2-3 % of a small batch's
    step). `split_counters` (int32 zeros, at least ``B * Hkv``, private to the caller's stream of launches) lets the
    kernel also combine its KV splits itself, saving the combine kernel; the launch leaves them at zero.
    Same result as the two calls, bit for bit."""
    opts = dict(sliding_window=sliding_window, softcap=softcap, sinks=sinks, chunk_size=chunk_size,
                alibi_slopes=alibi_slopes)
    return _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, kv_start, opts,
                   new_kv=(key, value, slot_mapping), split_counters=split_counters, scales=(k_scale, v_scale))


def paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    kv_start: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal prefill over the paged cache: ``query [T, Hq, D]`` -> ``out [T, Hq, Dv]``.

    Options and an FP8 cache's `k_scale` / `v_scale` as in :func:`paged_decode` (per query row at its own position).

    Sequence ``s`` owns rows ``[cu_seqlens_q[s], cu_seqlens_q[s+1])``; its row ``i`` sits at
    position ``seq_lens[s] - q_len_s + i`` (own K/V already written) and attends keys
    ``[kv_start[s], position]``. Rows outside every sequence / with an empty range get zeros.
    ``max_seqlen_q`` is a Python int upper bound on ``q_len_s`` (no device sync needed).
    """
    bs, d = _check_attention_common(query, key_cache, value_cache, block_tables, seq_lens, scale, kv_start, "seq_lens",
                                    k_scale, v_scale)
    _check_tensor("cu_seqlens_q", cu_seqlens_q, 1, _INT_DTYPES, query.device)
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens_q must have shape [{seq_lens.shape[0] + 1}] (S+1), got {tuple(cu_seqlens_q.shape)}"
        )
    if not isinstance(max_seqlen_q, int) or isinstance(max_seqlen_q, bool):
        raise TypeError(f"max_seqlen_q must be a Python int, got {type(max_seqlen_q).__name__}")
    if max_seqlen_q < 0:
        raise ValueError(f"max_seqlen_q must be >= 0, got {max_seqlen_q}")
    opts = dict(sliding_window=sliding_window, softcap=softcap, sinks=sinks, chunk_size=chunk_size,
                alibi_slopes=alibi_slopes)
    _check_options(query.shape[1], query.device, **opts)
    if get_backend(query.device) == "triton":
        _check_triton_dims(d, bs, value_cache.shape[-1], query.shape[1] // key_cache.shape[1], query.element_size())
        _check_triton_device(query)
        wide = _wide(d, value_cache.shape[-1], query.shape[1] // key_cache.shape[1], query.element_size())
        return _triton_module("triton_prefill_wide" if wide else "triton_prefill").paged_prefill(
            _last_contig(query),
            key_cache,
            value_cache,
            _last_contig(block_tables),
            cu_seqlens_q.contiguous(),
            seq_lens.contiguous(),
            float(scale),
            max_seqlen_q,
            kv_start.contiguous() if kv_start is not None else None,
            k_scale=k_scale,
            v_scale=v_scale,
            **opts,
        )
    return reference.paged_prefill(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, float(scale), max_seqlen_q, kv_start,
        k_scale=k_scale, v_scale=v_scale, **opts,
    )


def paged_sparse_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, scale: float,
                           **opts) -> torch.Tensor:
    """Learned sparse attention over the paged cache: ``query [N, Hq, D]``, query ``n`` reads sequence
    ``rows[n]``'s table and attends exactly its positions ``positions[n] [K]`` (``-1``: none) -> ``[N, Hq, Dv]``.
    Options: ``softcap``, ``sinks``, ``k_scale`` / ``v_scale``. The torch reference on every backend for now
    (:mod:`hf_paged.kernels.reference_sparse`: the seam where a Triton kernel goes)."""
    _check_tensor("rows", rows, 1, _INT_DTYPES, query.device)
    _check_tensor("positions", positions, 2, _INT_DTYPES, query.device)
    if rows.shape[0] != query.shape[0] or positions.shape[0] != query.shape[0]:
        raise ValueError(f"rows {tuple(rows.shape)} and positions {tuple(positions.shape)} must have one row per "
                         f"query token ({query.shape[0]})")
    return reference_sparse.paged_sparse_attention(query, key_cache, value_cache, block_tables, rows, positions,
                                                   float(scale), **opts)


def _wide(head_dim: int, head_dim_v: int | None, group: int, element_size: int) -> bool:
    """Whether a launch takes the wide kernels (`triton_wide`): heads over 256, but for the case the narrow kernels'
    small tiles take (`checks.small_tile_heads`). Every launch and warm-up helper asks this one question."""
    return triton_wide_heads(head_dim, head_dim_v) and not small_tile_heads(head_dim, head_dim_v, group, element_size)


def prefill_tile_lengths(num_q_heads: int, num_kv_heads: int, head_dim: int, max_q: int,
                         device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> list[int]:
    """Query lengths (powers of two, 2..min(max_q, 512)) whose prefill steps together use every kernel variant the
    prefill kernel can pick for this head layout and cache `dtype`: one per tile shape and whole-tile mode (what a JIT
    warm-up must run, with every sequence of a step that long). On the torch backend nothing is compiled, so the
    shortest length alone."""
    lengths = [2 ** i for i in range(1, 10) if 2 ** i <= max(2, max_q)]
    if get_backend(torch.device(device)) != "triton":
        return lengths[:1]
    group = max(1, num_q_heads // max(1, num_kv_heads))
    module = _triton_module("triton_prefill_wide" if _wide(head_dim, None, group, dtype.itemsize) else "triton_prefill")
    on_cuda = torch.device(device).type == "cuda"
    seen, picked = set(), []
    elem = dtype.itemsize
    for q_len in lengths:
        key = (module._config(group, head_dim, q_len, on_cuda, elem), module._whole_tiles(head_dim, q_len, False))
        if key not in seen:
            seen.add(key)
            picked.append(q_len)
    return picked


def prefill_query_tile(num_q_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str,
                       dtype: torch.dtype = torch.bfloat16) -> int:
    """Query tokens one program of the prefill kernel takes at most (its tile for long queries of a `dtype` cache): a
    caller that cuts sequences into pieces of this many queries gets one program per piece
    (`hf_paged.runner.ragged_graphs`). 32 on the torch backend, which has no tiles."""
    if get_backend(torch.device(device)) != "triton":
        return 32
    group = max(1, num_q_heads // max(1, num_kv_heads))
    elem = dtype.itemsize
    module = _triton_module("triton_prefill_wide" if _wide(head_dim, None, group, elem) else "triton_prefill")
    block_m = module._config(group, head_dim, 1 << 16, torch.device(device).type == "cuda", elem)[0]
    return max(1, block_m // group)


def decode_variant(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_context: int,
                   device: torch.device | str, head_dim_v: int | None = None) -> tuple:
    """A key that two `paged_decode` calls (default options, tables of `max_context` keys) share when they launch
    the same compiled kernels, for batches of `batch` sequences: a JIT warm-up runs one batch per key
    (`hf_paged.runner.warm_up`). One key for every batch on the torch backend."""
    if get_backend(torch.device(device)) != "triton":
        return ()
    group = max(1, num_q_heads // max(1, num_kv_heads))
    module = _triton_module("triton_decode_wide" if _wide(head_dim, head_dim_v, group, 2) else "triton_decode")
    return module.launch_variant(batch, num_q_heads, num_kv_heads, head_dim, head_dim_v or head_dim, max_context,
                                 device)


def copy_blocks(
    pool: torch.Tensor,
    src: torch.Tensor | Sequence[int],
    dst: torch.Tensor | Sequence[int],
) -> None:
    """``pool[..., dst[i], :, :, :] = pool[..., src[i], :, :, :]`` for all i (block dim ``pool.dim()-4``).

    One launch for every layer and K/V. ``dst`` must not overlap ``src`` (copy-on-write / swap
    targets are fresh blocks). ``src`` / ``dst`` may be Python sequences of ints.
    """
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"pool must be a torch.Tensor, got {type(pool).__name__}")
    if pool.dim() < 4:
        raise ValueError(
            f"pool must have at least 4 dims [..., num_blocks, Hkv, block_size, D], got {tuple(pool.shape)}"
        )
    if not isinstance(src, torch.Tensor):
        src = torch.as_tensor(list(src), dtype=torch.int64, device=pool.device)
    if not isinstance(dst, torch.Tensor):
        dst = torch.as_tensor(list(dst), dtype=torch.int64, device=pool.device)
    _check_tensor("src", src, 1, _INT_DTYPES, pool.device)
    _check_tensor("dst", dst, 1, _INT_DTYPES, pool.device)
    if src.shape != dst.shape:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must have the same length")
    if src.shape[0] == 0:
        return
    if get_backend(pool.device) == "triton":
        _check_triton_device(pool)
        mod = _triton_module("triton_cache")
        if mod.copy_blocks_supported(pool):
            mod.copy_blocks(pool, src.contiguous(), dst.contiguous())
            return
    reference.copy_blocks(pool, src, dst)
