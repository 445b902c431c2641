"""Route transformers' attention through the paged kernels.

`register()` adds one attention function and one mask function under the name `hf_paged` to transformers'
`AttentionInterface` / `AttentionMaskInterface`. The model's own modeling code stays untouched: it calls
`past_key_values.update(...)`, gets back the layer's block pools (tagged with their `PagedCache`), then calls our
attention function, which reads the current step's block tables from that cache.

The mask function builds no 4D mask: it hands the 2D padding mask through (or None), and the attention function turns
left padding into a per-row `kv_start`. Any other padding pattern, and calls without a `PagedCache` (e.g.
`use_cache=False`), take an exact dense path so results never silently change.

Per-layer attention options reach the kernels from what transformers' attention modules pass (see
`layer_options`): `sliding_window` (kwarg: Mistral, Phi-3, Qwen2, Starcoder2, Gemma 2/3, gpt-oss, Cohere 2, OLMo 3),
`softcap` (kwarg: Gemma 2), `s_aux` (kwarg: gpt-oss sinks), `alibi_slopes` (kwarg: passed by the ALiBi families'
attention adapters, `hf_paged.attention.adapters`), `scaling`, and chunked attention from the module's
config (`layer_types[layer_idx] == "chunked_attention"` with `attention_chunk_size`: Llama 4). Since the mask
function builds no 4D mask, the kernels apply windows and chunks themselves on every path.

What transformers' modeling code hands this function (read from transformers 5.17 for the nine families of
`hf_paged.testing` and checked at run time with a spy attention and mask function on their tiny models, under
`generate()` on a left-padded batch; the sweep of `hf_paged.model_zoo` checks the rest):

* The attention module computes projections, then RoPE (Qwen3 first applies its per-head `q_norm` / `k_norm`), then
  `key, value = past_key_values.update(key, value, self.layer_idx)`, then calls
  `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)(self, query, key,
  value, attention_mask, dropout=..., scaling=..., [sliding_window=...,] **kwargs)`. The K/V returned by `update()`
  arrive unchanged (the same tensor objects), so the pool handles `PagedCache.update()` returns survive to this call,
  and nothing touches K/V after `update()`. Shapes: `query [B, Hq, q, D]`, K/V whatever `update()` returned; the
  function returns `(out [B, q, Hq, D], weights | None)` and the caller reshapes to `[B, q, -1]`. `dropout` is 0.0 in
  eval mode.
* Always use the `scaling` kwarg; never recompute `head_dim**-0.5`: OPT passes 1.0 (its query is pre-scaled before
  `update()`), GPT-2 with `scale_attn_by_inverse_layer_idx` divides by `layer_idx + 1` (a different value per layer),
  Granite passes `attention_multiplier` (1/head_dim in real checkpoints). Qwen3 and Gemma set `head_dim` explicitly
  (different from hidden / heads).
* `sliding_window` arrives as a kwarg from Mistral (`MistralConfig` defaults to 4096: every layer slides), Phi-3
  (Phi-3-mini-4k ships 2047), Qwen2 / Qwen3 (None unless that layer slides: `use_sliding_window`, then layers
  `i >= max_window_layers`), and the windowed families named above.
* The mask is built once per forward by `masking_utils.create_causal_mask(config, inputs_embeds, attention_mask,
  past_key_values, position_ids)` (OPT calls it without `position_ids`), sized by the cache's `get_mask_sizes()` /
  `get_query_offset()`, through `ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]`: an implementation not
  registered there gets `attention_mask=None` and loses the padding, hence `paged_mask`. With `config.is_causal`
  False (Gemma's `use_bidirectional_attention`) it builds a bidirectional mask: refused by the support check. When
  `past_key_values.is_compileable`, `generate()` pre-builds a 4D mask that `create_causal_mask` returns as is.
* Positions: under `generate()`, every family's forward gets `position_ids` (`attention_mask.cumsum(-1) - 1`, pads
  at 0, then `last + 1` per step, `[B, q]`), so a left-padded row's RoPE or learned position is its index among
  real tokens; they reach this function in `kwargs["position_ids"]`, already applied. Called without them, Llama-like
  families and GPT-2 use `arange(q) + cache.get_seq_length()` (`[1, q]`, the same for every row) and OPT derives them
  from the 2D mask (learned positions with offset 2), so the engine's ragged `[1, T]` batch always passes
  `position_ids`. `get_seq_length()` of the cache is read by every forward and by `generate()`.
* RoPE variants that depend on `max(position_ids)` over the whole batch (`dynamic`, Phi-3's `longrope`) make a
  sequence's outputs depend on which sequences share its forward once one passes
  `original_max_position_embeddings`; `default`, `llama3`, `linear` and `yarn` are position-wise.
* `use_cache=True` without `past_key_values` makes the model build `DynamicCache(config=...)` itself (with sliding
  layers when the config says so); GPT-2 with `add_cross_attention` wraps the cache in an `EncoderDecoderCache`
  (refused). GPT-2's `reorder_and_upcast_attn` only affects its `eager` attention.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from .. import kernels
from ..kernels.reference import dequantize, masked_attention
from . import experts
from .adapters import needs_mask_tensor, route_through
from .compiled_op import active_deferred_cache, fused_decode_attention, window_starts
from .support import UNSUPPORTED_ATTENTION_KWARGS

ATTENTION_NAME = "hf_paged"

__all__ = ["ATTENTION_NAME", "register", "paged_attention_forward", "paged_mask", "layer_options", "HANDLED_KWARGS"]

_UNSUPPORTED_KWARGS = tuple(sorted(UNSUPPORTED_ATTENTION_KWARGS))
# attention kwargs (besides `scaling` / `dropout`) the kernels handle, and the config-driven chunked layers
HANDLED_KWARGS = ("sliding_window", "softcap", "s_aux", "alibi_slopes", "cache_window")


def layer_options(module: torch.nn.Module, kwargs: dict) -> dict:
    """Kernel options of this layer: `sliding_window`, `softcap`, `sinks`, `chunk_size`, `alibi_slopes` (None when
    unused).

    `sliding_window` / `softcap` / `s_aux` come as kwargs (transformers passes them per layer, None on full
    layers); chunked attention is not a kwarg: Llama 4 builds a chunked mask for the layers whose
    `config.layer_types[i]` is "chunked_attention", so the size is read from the module's config.
    """
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    chunk = None
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    layer_idx = getattr(module, "layer_idx", None)
    # `layer_types[layer_idx]` only where a layer can be chunked: in a regionally compiled layer `layer_idx` is
    # symbolic, and indexing a list with it would compile one graph per layer
    if layer_types is not None and "chunked_attention" in layer_types and isinstance(layer_idx, int) \
            and layer_idx < len(layer_types):
        if layer_types[layer_idx] == "chunked_attention":
            chunk = getattr(config, "attention_chunk_size", None)
    for name, val in (("sliding_window", window), ("attention_chunk_size", chunk)):
        if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val <= 0):
            raise ValueError(f"hf_paged attention: {type(module).__name__} passed {name}={val!r}, expected a positive int")
    if softcap is not None:
        if not isinstance(softcap, (int, float)) or isinstance(softcap, bool):
            raise ValueError(f"hf_paged attention: {type(module).__name__} passed softcap={softcap!r}, expected a float")
        softcap = float(softcap) if softcap > 0 else None  # 0 / negative means "off" in some configs
    alibi = kwargs.get("alibi_slopes")
    for name, val in (("s_aux", sinks), ("alibi_slopes", alibi)):
        if val is not None and not isinstance(val, torch.Tensor):
            raise ValueError(f"hf_paged attention: {type(module).__name__} passed {name} of type {type(val).__name__}")
    return dict(sliding_window=window, softcap=softcap, sinks=sinks, chunk_size=chunk, alibi_slopes=alibi)


def paged_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask function: pass the 2D padding mask (cut to the key length) through; never materialise `[B,1,q,kv]`.

    No padding mask gives None, except to a model whose code needs a tensor (an adapted family,
    `adapters.needs_mask_tensor`), which gets an all-true `[B, kv]` one."""
    if attention_mask is None:
        if needs_mask_tensor(kwargs.get("config")):
            return torch.ones((batch_size, kv_length), dtype=torch.bool, device=kwargs.get("device"))
        return None
    if attention_mask.dim() != 2:
        return attention_mask
    return attention_mask[:, -kv_length:] if attention_mask.shape[1] > kv_length else attention_mask


def _cache_layer(cache, layer: int | None, key: torch.Tensor) -> int | None:
    """The cache layer whose pool views `key` is (what `update()` returned, tagged by `PagedCache._tag_layers`): the
    module's own `layer_idx` when those are its views (a shared-KV layer reads its source's through its own index),
    else the layer the views belong to: a module that writes a cache layer other than its `layer_idx` (Zamba's
    shared attention block at each of its depths, HRM's layers once per cycle) is told apart by the views it got."""
    tagged = getattr(key, "_hf_paged_layer", None)
    if tagged is None or tagged == layer:
        return layer
    if not isinstance(layer, int):  # (Zamba's block has none of its own)
        return tagged
    try:
        own = cache.layer_caches(layer)[0]
    except (ValueError, IndexError):  # the module's own index keeps no K/V
        own = None
    return layer if own is key else tagged


def _cache_window(module: torch.nn.Module, kwargs: dict) -> int | None:
    """`cache_window`: a window transformers applies through its cache only (Moshi, `adapters.moshi`): a forward that
    starts at position `c` reads the keys from `c - W + 1` on (all of a prompt prefilled in one forward)."""
    window = kwargs.get("cache_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise ValueError(f"hf_paged attention: {type(module).__name__} passed cache_window={window!r}, expected a "
                         "positive int")
    return window


# the float32 scores one query chunk of `_dense_feature_attention` may hold at once (several tensors of that size
# live during its softmax): a long prompt's [heads, q, kv] scores would otherwise take tens of GiB (gpt-oss-20b's
# 64 heads at 8,192 tokens: 16 GiB each, in the engine's memory-profiling forward)
DENSE_SCORES_BYTES = 256 << 20


def _dense_feature_attention(query, keys, values, mask_2d, scale: float, opts: dict,
                             selected: torch.Tensor | None = None) -> torch.Tensor:
    """Exact dense attention with the layer's options: `query [B, Hq, q, D]`, keys/values `[B, Hkv, kv, D]`;
    `selected` (boolean `[B, 1, q, kv]`): the keys a sparse selection leaves each query, ANDed in.

    Fallback for calls without a paged cache or with non-left padding: causal AND padding AND window AND chunk
    (chunks counted from the row's first non-padding key, as transformers' `chunked_overlay`), ALiBi as
    `slope * (key - query)`. Queries go in chunks whose scores fit `DENSE_SCORES_BYTES` (each row's result does not
    depend on the others). Returns `[B, q, Hq, Dv]`.
    """
    B, Hq, q_len, _ = query.shape
    kv_len = keys.shape[2]
    dev = query.device
    q_pos = torch.arange(kv_len - q_len, kv_len, device=dev)[None, :, None]
    k_pos = torch.arange(kv_len, device=dev)[None, None, :]
    mask = (k_pos <= q_pos).expand(B, q_len, kv_len)
    lead = torch.zeros(B, 1, 1, dtype=torch.long, device=dev)
    if mask_2d is not None:
        pad = mask_2d.to(device=dev, dtype=torch.bool)[:, -kv_len:]
        mask = mask & pad[:, None, :]
        lead = (pad.to(torch.long).cumsum(-1) == 0).sum(-1).reshape(B, 1, 1)
    if opts["sliding_window"] is not None:
        mask = mask & (k_pos > q_pos - opts["sliding_window"])
    if opts["chunk_size"] is not None:
        c = opts["chunk_size"]
        mask = mask & (torch.div(k_pos - lead, c, rounding_mode="floor") == torch.div(q_pos - lead, c, rounding_mode="floor"))
    groups = Hq // keys.shape[1]
    keys = keys.repeat_interleave(groups, dim=1)
    values = values.repeat_interleave(groups, dim=1)
    mask = mask[:, None]
    if selected is not None:
        mask = mask & selected
    sink_col = opts["sinks"].reshape(1, Hq, 1, 1) if opts["sinks"] is not None else None
    bias = None
    if opts["alibi_slopes"] is not None:
        bias = opts["alibi_slopes"].float().reshape(1, Hq, 1, 1) * (k_pos - q_pos).float()[:, None]
    keys, values = keys.to(query.dtype), values.to(query.dtype)
    rows = max(1, DENSE_SCORES_BYTES // max(1, B * Hq * kv_len * 4))
    out = torch.cat([masked_attention(query[:, :, at : at + rows], keys, values, mask[:, :, at : at + rows], scale,
                                      opts["softcap"], sink_col, None if bias is None else bias[:, :, at : at + rows])
                     for at in range(0, q_len, rows)], dim=2) if rows < q_len else \
        masked_attention(query, keys, values, mask, scale, opts["softcap"], sink_col, bias)
    out = torch.where(mask.any(-1, keepdim=True), out, 0)
    return out.transpose(1, 2)


def _dense_mask(mask_2d: torch.Tensor | None, q_len: int, kv_len: int, device) -> torch.Tensor | None:
    """Causal (query i sits at position kv_len - q_len + i) AND padding, as a boolean `[B, 1, q, kv]` mask."""
    if mask_2d is None:
        return None
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    k_pos = torch.arange(kv_len, device=device)
    causal = k_pos[None, :] <= q_pos[:, None]
    return causal[None, None] & mask_2d.to(device=device, dtype=torch.bool)[:, None, None, :]


def _left_padding_starts(step, mask_2d: torch.Tensor | None, kv_len: int) -> tuple[bool, torch.Tensor | None]:
    """(is left padding only, per-row first valid key or None). Computed once per forward, cached on the step."""
    if step.kv_start_ready:
        return step.extra["left_padded"], step.kv_start
    left_padded, kv_start = True, None
    if mask_2d is not None:
        valid = mask_2d.to(torch.bool)
        if valid.shape[1] != kv_len:
            left_padded = False
        else:
            has_any = valid.any(dim=1)
            first = valid.to(torch.int32).argmax(dim=1)
            expected = torch.arange(kv_len, device=valid.device)[None, :] >= first[:, None]
            ok = ((expected == valid) | ~has_any[:, None]).all()
            starts = torch.where(has_any, first, torch.full_like(first, kv_len)).to(torch.int32)
            flags = torch.stack([ok.to(torch.int32), starts.max()]).tolist()  # one host sync per forward
            left_padded = bool(flags[0])
            if left_padded and flags[1] > 0:
                kv_start = starts.to(step.seq_lens.device)
    step.extra["left_padded"] = left_padded
    step.kv_start = kv_start
    step.kv_start_ready = True
    return left_padded, kv_start


def _gather_dense(cache_tensor: torch.Tensor, block_tables: torch.Tensor, kv_len: int, scale: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """`[B, H, kv_len, D]` copy of every row's first kv_len tokens (exact fallback for unusual padding), in `dtype`
    (an FP8 pool's dequantised with its `scale`)."""
    block_size = cache_tensor.shape[2]
    pos = torch.arange(kv_len, device=cache_tensor.device)
    blocks = block_tables.long()[:, pos // block_size]  # [B, kv_len]
    data = cache_tensor.view(torch.uint8) if scale is not None else cache_tensor  # (fp8: indexed as its bytes)
    gathered = data[blocks, :, (pos % block_size)[None, :].expand_as(blocks), :].view(cache_tensor.dtype)
    return dequantize(gathered.transpose(1, 2), scale, dtype)  # [B, kv_len, H, D] -> [B, H, kv_len, D]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: `query [B, Hq, q, D]`, returns `([B, q, Hq, D], None)`."""
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"hf_paged attention does not support `{name}` (model passed {name}={kwargs[name]!r})")
    opts = layer_options(module, kwargs)
    cache_window = _cache_window(module, kwargs)
    if cache_window is not None and opts["sliding_window"] is not None:
        raise ValueError(f"hf_paged attention: {type(module).__name__} passed both sliding_window and cache_window")
    has_opts = any(v is not None for v in opts.values())
    indices = kwargs.get("indices")  # learned sparse attention: each query's selected key positions
    if indices is not None and not isinstance(indices, torch.Tensor):
        raise ValueError(f"hf_paged attention: {type(module).__name__} passed indices of type {type(indices).__name__}")
    if torch.compiler.is_dynamo_compiling():
        # inside hf_paged's compiled decode step (`compile_decode`): the cache deferred the K/V write to one fused op
        active = active_deferred_cache()
        if active is not None:
            scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
            return fused_decode_attention(module, query, key, value, scale, active.compute_dtype, **opts,
                                          cache_window=cache_window), None
    cache_ref = getattr(key, "_hf_paged_cache", None)
    cache = cache_ref() if cache_ref is not None else None
    if cache is None and indices is not None:  # a sparse selection without a paged cache: folded into the mask
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        mask_2d = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        selected = _fold_selection(attention_mask if mask_2d is None else None, indices, query.shape[2], key.shape[2])
        return _dense_feature_attention(query, key, value, mask_2d, scale, opts, selected), None
    if cache is None:
        # No paged cache in this forward (use_cache=False, DynamicCache, ...): exact dense attention. (Grouped K/V
        # of a module that does not say its grouping, as adapted ones: the dense path groups by shape.)
        if has_opts or key.shape[1] * getattr(module, "num_key_value_groups", 1) != query.shape[1]:
            scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
            mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
            if attention_mask is not None and attention_mask.dim() != 2:
                raise ValueError("hf_paged attention: a 4D attention mask with sliding_window / softcap / s_aux / "
                                 "chunked attention / ALiBi is not supported (pass a 2D padding mask)")
            return _dense_feature_attention(query, key, value, mask, scale, opts), None
        mask = attention_mask
        if mask is not None and mask.dim() == 2:
            mask = _dense_mask(mask, query.shape[2], key.shape[2], query.device)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)

    # the cache layer these K/V are (a module run at several depths writes several: Zamba, HRM)
    layer_idx = _cache_layer(cache, getattr(module, "layer_idx", None), key)
    if layer_idx is not None:  # what this layer's window is (the engine releases blocks no layer reads any more)
        cache.layer_windows[layer_idx] = opts["sliding_window"] or cache_window
    step = cache._step.for_group(getattr(key, "_hf_paged_group", 0))  # a grouped cache: the layer group's tables
    k_scale, v_scale = getattr(key, "_hf_paged_scales", (None, None))  # an FP8 pool's (`PagedCache._tag_layers`)
    fp8 = dict(k_scale=k_scale, v_scale=v_scale)
    if query.requires_grad:  # gradients stop at the paged cache (see hf_paged.cache.paged_cache._cut_gradients)
        query = query.detach()
    batch, num_heads, q_len, head_dim = query.shape
    scale = float(scaling) if scaling is not None else head_dim**-0.5
    if indices is not None:
        return _sparse_paged_attention(module, query, key, value, step, indices, scale, opts, fp8), None
    if step.layout == "ragged":
        flat = query[0].transpose(0, 1).contiguous()  # [T, Hq, D]
        if step.decode_only:
            opts["sliding_window"] = opts["sliding_window"] or cache_window  # (one query: the same window)
            out = kernels.paged_decode(flat, key, value, step.block_tables, step.seq_lens, scale,
                                       split_counters=step.split_counters, **fp8, **opts)
        else:
            # (a window of the cache: each sequence's first key is its cached length before this step - W + 1)
            first = window_starts(step, cache_window) if cache_window is not None else None
            out = kernels.paged_prefill(
                flat, key, value, step.block_tables, step.cu_seqlens_q, step.seq_lens, scale, step.max_seqlen_q,
                first, **fp8, **opts,
            )
        return out.unsqueeze(0), None

    kv_len = cache.get_seq_length()
    left_padded, kv_start = _left_padding_starts(step, attention_mask, kv_len)
    if cache_window is not None:
        if q_len == 1:
            opts["sliding_window"], has_opts = cache_window, True
        elif kv_len - q_len - cache_window + 1 > 0:  # keys cached before this forward, out of the window
            first = kv_len - q_len - cache_window + 1
            if left_padded:
                start = kv_start if kv_start is not None else step.seq_lens.new_zeros(batch, dtype=torch.int32)
                kv_start = start.clamp(min=first)
            else:
                mask = attention_mask if attention_mask is not None else torch.ones(
                    (batch, kv_len), dtype=torch.bool, device=query.device)
                attention_mask = mask.clone()
                attention_mask[:, -kv_len:][:, :first] = 0
    if not left_padded:
        keys = _gather_dense(key, step.block_tables, kv_len, k_scale, query.dtype)
        values = _gather_dense(value, step.block_tables, kv_len, v_scale, query.dtype)
        if has_opts:
            return _dense_feature_attention(query, keys, values, attention_mask, scale, opts), None
        mask = _dense_mask(attention_mask, q_len, kv_len, query.device)
        return sdpa_attention_forward(module, query, keys, values, mask, dropout=0.0, scaling=scaling)
    if q_len == 1:
        out = kernels.paged_decode(
            query[:, :, 0, :].contiguous(), key, value, step.block_tables, step.seq_lens, scale, kv_start, **fp8, **opts
        )
        return out.unsqueeze(1), None
    flat = query.transpose(1, 2).reshape(batch * q_len, num_heads, head_dim)
    out = kernels.paged_prefill(
        flat, key, value, step.block_tables, step.cu_seqlens_q, step.seq_lens, scale, q_len, kv_start, **fp8, **opts
    )
    return out.view(batch, q_len, num_heads, out.shape[-1]), None


def _fold_selection(mask: torch.Tensor | None, indices: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """A boolean `[B, 1, q, kv]` mask: `mask` (4D boolean or additive, or None: causal) AND the selected positions
    `indices [B, q, K]` (-1: none), as transformers' eager / SDPA paths fold a sparse selection into their mask."""
    batch, device = indices.shape[0], indices.device
    # (an entry of -1 goes to a spare last column, dropped: scattered onto position 0 it could unselect a real pick)
    spare = torch.where(indices >= 0, indices.long(), kv_len)
    selected = torch.zeros(batch, q_len, kv_len + 1, dtype=torch.bool, device=device).scatter_(-1, spare, True)
    selected = selected[..., :kv_len]
    if mask is None:
        base = _dense_mask(torch.ones(batch, kv_len, dtype=torch.bool, device=device), q_len, kv_len, device)
    elif mask.dtype == torch.bool:
        base = mask
    else:
        base = mask > torch.finfo(mask.dtype).min / 2
    return base & selected[:, None]


def _query_rows(step, batch: int, q_len: int, device) -> torch.Tensor:
    """Which block-table row each query token of the step reads (its sequence's), `[batch * q_len]`; computed once
    per forward (cached on the step)."""
    rows = step.extra.get("query_rows")
    if rows is None:
        if step.layout == "ragged":  # (rows past the last sequence, a padded step's, read row 0 and select nothing)
            counts = step.cu_seqlens_q.diff().long()
            rows = torch.repeat_interleave(torch.arange(counts.shape[0], device=device), counts)
            rows = torch.nn.functional.pad(rows, (0, batch * q_len - rows.shape[0]))
        else:
            rows = torch.arange(batch, device=device).repeat_interleave(q_len)
        step.extra["query_rows"] = rows
    return rows


def _sparse_paged_attention(module, query, key, value, step, indices: torch.Tensor, scale: float, opts: dict,
                            fp8: dict) -> torch.Tensor:
    """Learned sparse attention over the pool: query token `n` attends exactly the positions `indices[.., n, :]` of
    its own sequence (positions in the sequence, -1: none; the padded layout's row positions, left padding
    included), as `hf_paged.attention.adapters.dsa` selects them. `kernels.paged_sparse_attention` gathers those
    K/V by the sequence's block table. Returns `[B, q, Hq, Dv]`."""
    for name in ("sliding_window", "chunk_size", "alibi_slopes"):
        if opts[name] is not None:
            raise ValueError(f"hf_paged attention: {type(module).__name__} passed indices (sparse attention) with "
                             f"{name}, which the sparse path does not take")
    batch, num_heads, q_len, head_dim = query.shape
    if indices.dim() != 3 or indices.shape[:2] != (batch, q_len):
        raise ValueError(f"hf_paged attention: indices must be [{batch}, {q_len}, top-k], got {tuple(indices.shape)}")
    flat = query.transpose(1, 2).reshape(batch * q_len, num_heads, head_dim)
    rows = _query_rows(step, batch, q_len, query.device)
    out = kernels.paged_sparse_attention(flat, key, value, step.block_tables, rows, indices.reshape(batch * q_len, -1),
                                         scale, softcap=opts["softcap"], sinks=opts["sinks"], **fp8)
    return out.view(batch, q_len, num_heads, out.shape[-1])


_registered = False


def register() -> str:
    """Register the attention and mask functions, and the experts function (`hf_paged.attention.experts`), all
    under one name (idempotent); returns the name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
        AttentionMaskInterface.register(ATTENTION_NAME, paged_mask)
        experts.register()
        route_through(ATTENTION_NAME)  # installed attention adapters route their modules here
        _registered = True
    return ATTENTION_NAME
