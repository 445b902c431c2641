"""Argument checks shared by the kernel dispatchers (`hf_paged.kernels`): shapes, dtypes and devices only.

They never read tensor values (no device sync), so the dispatchers stay safe on the decode hot path and under
CUDA-graph capture. A failed check is a `TypeError` or `ValueError` that names the argument.
"""

from __future__ import annotations

import torch

from .interpreter import triton_interpreting

FP8_DTYPE = torch.float8_e4m3fn  # the quantised cache's storage (see `hf_paged.kernels` for the contract)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CACHE_DTYPES = _FLOAT_DTYPES + (FP8_DTYPE,)
_INT_DTYPES = (torch.int32, torch.int64)


def _check_tensor(name: str, t, ndim: int, dtypes, device: torch.device | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (same device as the other inputs)")


def _check_caches(key_cache, value_cache, device, same_head_dim: bool = True) -> tuple:
    _check_tensor("key_cache", key_cache, 4, _CACHE_DTYPES, device)
    _check_tensor("value_cache", value_cache, 4, _CACHE_DTYPES, device)
    k_shape = key_cache.shape if same_head_dim else key_cache.shape[:-1]
    v_shape = value_cache.shape if same_head_dim else value_cache.shape[:-1]
    if k_shape != v_shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must have the same shape"
        )
    if key_cache.dtype != value_cache.dtype:
        raise TypeError(f"key_cache ({key_cache.dtype}) and value_cache ({value_cache.dtype}) must share a dtype")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("key_cache / value_cache must be contiguous in head_dim (stride(-1) == 1)")
    return tuple(key_cache.shape)


def _check_scales(key_cache: torch.Tensor, k_scale, v_scale) -> None:
    """An FP8 cache needs `k_scale` and `v_scale`: float32 tensors of one value or one per KV head, on its device, all
    positive (not checked: a value); a 16/32-bit cache takes none."""
    if key_cache.dtype != FP8_DTYPE:
        if k_scale is not None or v_scale is not None:
            raise TypeError(f"k_scale / v_scale are for a {FP8_DTYPE} cache, this one is {key_cache.dtype}")
        return
    hkv = key_cache.shape[1]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise TypeError(f"a {FP8_DTYPE} cache needs {name} (float32, one value or one per KV head)")
        _check_tensor(name, scale, 1, (torch.float32,), key_cache.device)
        if scale.shape[0] not in (1, hkv) or scale.stride(0) != 1:
            raise ValueError(f"{name} must hold 1 or {hkv} (KV heads) contiguous values, got shape {tuple(scale.shape)}")


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


# The widest key / value head the Triton attention kernels take. Heads up to TRITON_NARROW_HEAD_DIM are one padded
# register tile (`triton_dims`); wider ones (MLA's 576-value latent, Gemma 4's 512) run in kernels of their own that
# take a key head in two tiles and a block of query heads per program (`triton_wide`).
TRITON_MAX_HEAD_DIM = 1024
TRITON_NARROW_HEAD_DIM = 256
# the heads over 256 that the narrow kernels take in small tiles instead (`small_tile_heads`)
TRITON_SMALL_TILE_HEAD_DIM = 576
TRITON_SMALL_TILE_GROUP = 32


def triton_wide_heads(head_dim: int, head_dim_v: int | None = None) -> bool:
    """Whether keys of `head_dim` / values of `head_dim_v` values take the wide kernels (`triton_wide`)."""
    return max(head_dim, head_dim_v or head_dim) > TRITON_NARROW_HEAD_DIM


def triton_dims_refusal(head_dim: int, group: int = 1, element_size: int = 2) -> str | None:
    """Why the Triton kernels cannot take heads of `head_dim` values (None when they can). Any number of query heads
    per KV head (`group`) and any element size are taken: a wide head's program holds a block of 16 query heads,
    and its tiles shrink for float32 (`triton_decode_wide`, `triton_prefill_wide`); the arguments let a caller (the
    MLA adapter) ask before it builds anything."""
    if not 1 <= head_dim <= TRITON_MAX_HEAD_DIM:  # any size: one that is no power of two is computed padded
        return f"Triton kernels support head_dim from 1 to {TRITON_MAX_HEAD_DIM}, got {head_dim}"
    return None


def small_tile_heads(head_dim: int, head_dim_v: int | None, group: int, element_size: int) -> bool:
    """Whether heads over 256 run in the narrow kernels' small tiles rather than the wide kernels: multi-head latent
    attention's latent (257-576 values, a 1,024-lane tile, `triton_decode._CONFIGS[1024]`, `triton_prefill._config`)
    in 16-bit types for at most 32 query heads per KV head. That case was measured on an H200 (bf16, 16 / 20 / 32
    query heads: equal to the torch reference, 0.376 ms for 64 x 4,096 keys against 0.647 ms over expanded K/V);
    the wide kernels (every other head over 256) have been checked under Triton's interpreter only."""
    widest = max(head_dim, head_dim_v or head_dim)
    return 512 < widest <= TRITON_SMALL_TILE_HEAD_DIM and group <= TRITON_SMALL_TILE_GROUP and element_size <= 2


def _check_triton_dims(head_dim: int, block_size: int, head_dim_v: int | None = None, group: int = 1,
                       element_size: int = 2) -> None:
    for name, d in (("head_dim", head_dim), ("value head_dim", head_dim_v if head_dim_v is not None else head_dim)):
        reason = triton_dims_refusal(d, group, element_size)
        if reason is not None:
            raise ValueError(reason.replace("head_dim", name))
    if not (_is_pow2(block_size) and 8 <= block_size <= 256):
        raise ValueError(f"Triton kernels support block_size a power of two in [8, 256], got {block_size}")


def _check_triton_device(t: torch.Tensor) -> None:
    if not t.is_cuda and not triton_interpreting():
        raise RuntimeError(
            "the Triton backend needs CUDA tensors (or TRITON_INTERPRET=1 set before the first kernel call); "
            "unset HF_PAGED_BACKEND or use HF_PAGED_BACKEND=torch"
        )


def _last_contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_options(hq: int, device, sliding_window, softcap, sinks, chunk_size, alibi_slopes=None) -> None:
    """Per-call attention options: positive ints / floats, ``sinks`` and ``alibi_slopes`` ``[Hq]`` float tensors on the
    query's device."""
    for name, val in (("sliding_window", sliding_window), ("chunk_size", chunk_size)):
        if val is None:
            continue
        if not isinstance(val, int) or isinstance(val, bool):
            raise TypeError(f"{name} must be a Python int or None, got {type(val).__name__}")
        if val <= 0:
            raise ValueError(f"{name} must be > 0, got {val}")
    if softcap is not None:
        if not isinstance(softcap, (float, int)) or isinstance(softcap, bool):
            raise TypeError(f"softcap must be a Python float or None, got {type(softcap).__name__}")
        if not softcap > 0:
            raise ValueError(f"softcap must be > 0, got {softcap}")
    for name, val in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
        if val is not None:
            _check_tensor(name, val, 1, _FLOAT_DTYPES, device)
            if val.shape[0] != hq:
                raise ValueError(f"{name} must have shape [{hq}] (one per query head), got {tuple(val.shape)}")


def _check_attention_common(query, key_cache, value_cache, block_tables, seq_lens, scale, kv_start, n_seq_name,
                            k_scale=None, v_scale=None):
    _check_tensor("query", query, 3, _FLOAT_DTYPES)
    dev = query.device
    nb, hkv, bs, d = _check_caches(key_cache, value_cache, dev, same_head_dim=False)
    _, hq, qd = query.shape
    if query.dtype != key_cache.dtype and key_cache.dtype != FP8_DTYPE:  # an FP8 cache is read in the query's dtype
        raise TypeError(f"query dtype {query.dtype} must match the cache dtype {key_cache.dtype}")
    _check_scales(key_cache, k_scale, v_scale)
    if qd != d:
        raise ValueError(f"query head_dim {qd} != cache head_dim {d}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of the cache's kv heads ({hkv})")
    _check_tensor("block_tables", block_tables, 2, _INT_DTYPES, dev)
    _check_tensor("seq_lens", seq_lens, 1, _INT_DTYPES, dev)
    n = seq_lens.shape[0]
    if block_tables.shape[0] != n:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but {n_seq_name} has {n} sequences")
    if kv_start is not None:
        _check_tensor("kv_start", kv_start, 1, _INT_DTYPES, dev)
        if kv_start.shape[0] != n:
            raise ValueError(f"kv_start must have shape [{n}], got {tuple(kv_start.shape)}")
    if not isinstance(scale, (float, int)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    return bs, d
