"""DeepSeek Sparse Attention (DSA): multi-head latent attention whose queries each read only the keys an indexer picks.

Families: DeepSeek-V3.2 (`deepseek_v32`), GLM-5 (`glm_moe_dsa`), HY-V4 (`hy_v4`), A.X K2 (`axk2`). Their attention
module is DeepSeek-V3's MLA (`adapters.mla`) plus an *indexer* (`...Indexer`) with its own small projections: every
token gets one index key (`wk`, `k_norm`, rotary), cached through `past_key_values.update_indexer(k, layer_idx)`;
every query gets per-head index queries (`wq_b` on the attention's `q_resid`) and head weights (`weights_proj`), scores
all cached index keys (`relu(q . k)` weighted over heads, float32), and keeps its top `index_topk` positions.
transformers then folds that selection into the eager / SDPA mask, or hands it to the attention function as
`indices=` (`[B, q, topk]`). Differences between the families are the adapter's business only where the attention
module computes something itself: GLM-5 and HY-V4 let "shared" layers (`config.indexer_types`) reuse the previous
layer's selection (their attention returns it, the decoder layer hands it on as `prev_topk_indices`); HY-V4 rotates
halves (not interleaved pairs), gates the output per head (`gate_proj`) and has attention sinks; A.X K2 projects query
and gate together (`q_gate_proj` on `[q_resid, q_a_proj(x)]`) and gates the flattened output in float32.

What the adapter does on a `PagedCache` (every other cache gets the module's own forward, with a 4D mask):

* K/V: the latent in the pool, attention absorbed into the query, exactly as `adapters.mla` does (transformers
  caches the *expanded* per-head K/V of these models, `num_heads * (qk_head_dim + v_head_dim)` values a token: about
  70 times DeepSeek-V3.2's 576-value latent; vLLM also keeps the latent);
* index keys: in the pool beside the latent, under the same blocks (`cache.index_keys`, `KVShape.index_dim`);
* selection (:func:`select_positions`): the module's *own* indexer (its forward, weights, norm, rotary, scoring and
  `topk`, unchanged) is called on pieces of the step where each query sees only its own sequence. The drop-in
  cache's padded batch is one call (the cache's `update_indexer` returns each row's keys `[B, kv_len, D]` as
  transformers' cache does, and the mask is causal AND padding). An engine step (`[1, T]`, many sequences) is cut
  into one call for all its decode rows (`[S, 1]` queries against each sequence's keys, padded to the longest and
  masked) and one call per prefill sequence (`[1, q]` against its `[1, ctx]` keys, causal), each through a small
  view (`_SequenceKeys`) whose `update_indexer` writes the piece's keys at its slots and returns its sequences' keys.
  So no query ever scores another sequence's keys: the scores take `sum(q_s * ctx_s)` for the prefills and
  `decode rows * the longest context` for the decodes (times the index heads), never `T * sum(ctx)`;
* the selection handed on is positions in the query's sequence (`[B, q, K]`, `-1` where a query has fewer than
  `K` visible keys: its masked picks, which transformers' mask also drops); the attention function
  (`functions._sparse_paged_attention`, `kernels.paged_sparse_attention`) gathers exactly those latents through the
  sequence's block table. Where every query's selection holds all its causal positions (no sequence of the step is
  longer than `index_topk`), the attention takes the ordinary dense kernels instead (`indices=None`): the same set.

The selection is planned on the host (each sequence's new tokens and length, read once per forward), so the engine
runs these models' steps eagerly: no CUDA graphs, no `compile_decode` (`engine.defaults.sparse_step_modes` refuses
asking for them). A fused top-k kernel over the paged index keys, and a Triton sparse attention behind
`kernels.paged_sparse_attention`, are where that would change.

Equality with transformers: the scores are the indexer's own float32 arithmetic on the same keys and queries, and
`topk` runs over a query's visible positions of its own sequence; transformers ranks the same finite scores (its
masked positions are -inf, or the dtype's minimum added), so the kept set is the same up to exact ties at the cut.
"""

from __future__ import annotations

import torch

from ...cache import PagedCache
from ...cache.index_keys import gather_index_keys
from .mla import _refuse as _mla_refuse
from .mla import absorbed_weights, holds_latent
from .registry import Adapter, attend, family_module, register

__all__ = ["dsa_forward", "select_positions", "causal_index_mask"]


def _refuse(module: torch.nn.Module) -> str | None:
    if getattr(module, "q_a_proj", None) is None:
        return "no q_a_proj (q_lora_rank=None): the indexer reads the query's low-rank residual"
    return _mla_refuse(module)


def causal_index_mask(mask_2d: torch.Tensor | None, batch: int, q_len: int, kv_len: int,
                      device: torch.device) -> torch.Tensor:
    """`[B, q, kv]` boolean: query `i` (at position `kv_len - q_len + i`) sees key `j <= ` its position, AND the 2D
    padding mask `[B, kv]` where there is one."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    mask = (torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]).expand(batch, q_len, kv_len)
    if mask_2d is not None:
        mask = mask & mask_2d.to(device=device, dtype=torch.bool)[:, -kv_len:][:, None, :]
    return mask


class _SequenceKeys:
    """What a piece of an engine step shows the indexer as its cache: `update_indexer(k [B', q', D], layer)` writes
    the piece's keys at `slots` (row-major) and returns its sequences' keys `[B', length, D]` (`tables`' rows)."""

    def __init__(self, cache: PagedCache, slots: torch.Tensor, tables: torch.Tensor, length: int) -> None:
        self.cache, self.slots, self.tables, self.length = cache, slots, tables, length

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self.cache.write_index_keys(layer_idx, indexer_key_states.reshape(-1, indexer_key_states.shape[-1]),
                                    self.slots)
        keys = gather_index_keys(self.cache.index_pool(layer_idx), self.tables, self.length)
        return keys.to(indexer_key_states.dtype)


def _run_indexer(indexer, hidden, q_resid, position_embeddings, mask: torch.Tensor, cache) -> torch.Tensor:
    """The indexer's own forward; its picks that `mask` hides (a query with fewer visible keys than top-k) -> -1."""
    picked = indexer(hidden, q_resid, position_embeddings, mask, None, past_key_values=cache).long()
    return torch.where(mask.gather(-1, picked), picked, -1)


def _step_plan(step) -> tuple[list[int], list[int]]:
    """(new tokens, length after the step) of each sequence of an engine step, on the host (once per forward)."""
    plan = step.extra.get("sparse_plan")
    if plan is None:
        q_lens = step.cu_seqlens_q.diff().tolist()
        plan = step.extra["sparse_plan"] = (q_lens, step.seq_lens[:len(q_lens)].tolist())
    return plan


def _ragged_selection(indexer, hidden, q_resid, position_embeddings, cache: PagedCache, step) -> torch.Tensor:
    """`[1, T, K]`: an engine step's selection, each query against its own sequence only (module docstring)."""
    q_lens, lens = _step_plan(step)
    topk = min(indexer.index_topk, max(lens, default=1))
    total = hidden.shape[1]
    selection = torch.full((total, topk), -1, dtype=torch.long, device=hidden.device)
    cos, sin = position_embeddings
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)

    def piece(rows: torch.Tensor, seqs: list[int], q_len: int, length: int, mask: torch.Tensor) -> None:
        batch = len(seqs)
        view = _SequenceKeys(cache, step.slot_mapping[rows], step.block_tables[torch.tensor(seqs, device=rows.device)],
                             length)
        shaped = [t[0, rows].reshape(batch, q_len, -1) for t in (hidden, q_resid, cos, sin)]
        picked = _run_indexer(indexer, shaped[0], shaped[1], (shaped[2], shaped[3]), mask, view)
        selection[rows, :picked.shape[-1]] = picked.reshape(batch * q_len, -1)

    decode = [s for s, n in enumerate(q_lens) if n == 1]
    if decode:  # every decode row in one call: keys padded to the longest sequence, masked past each one's length
        longest = max(lens[s] for s in decode)
        own = torch.tensor([lens[s] for s in decode], device=hidden.device)
        mask = (torch.arange(longest, device=hidden.device)[None, :] < own[:, None])[:, None, :]
        piece(torch.tensor([starts[s] for s in decode], device=hidden.device), decode, 1, longest, mask)
    for s, n in enumerate(q_lens):
        if n > 1:  # a prefill (or a chunk of one): its queries against its own keys, causally
            mask = causal_index_mask(None, 1, n, lens[s], hidden.device)
            piece(torch.arange(starts[s], starts[s] + n, device=hidden.device), [s], n, lens[s], mask)
    return selection[None]


def select_positions(indexer, hidden, q_resid, position_embeddings, attention_mask, cache) -> torch.Tensor:
    """Each query's selected positions `[B, q, K]` (-1: none) through the module's own indexer, its index keys
    written to `cache` first: a `PagedCache` step (padded or ragged) or a cache of transformers' API (the run-time
    probe's), whose `update_indexer` returns `[B, kv, D]`."""
    batch, q_len = hidden.shape[:2]
    if isinstance(cache, PagedCache) and cache._step.layout == "ragged":
        return _ragged_selection(indexer, hidden, q_resid, position_embeddings, cache, cache._step)
    if attention_mask is not None and attention_mask.dim() == 4:  # (the probe's own SDPA mask)
        mask = attention_mask[:, 0].to(torch.bool)
    else:  # (the layer's update() ran: its length counts this forward's tokens)
        kv_len = attention_mask.shape[-1] if attention_mask is not None else cache.get_seq_length(indexer.layer_idx)
        mask = causal_index_mask(attention_mask, batch, q_len, kv_len, hidden.device)
    return _run_indexer(indexer, hidden, q_resid, position_embeddings, mask, cache)


def _holds_every_position(module, cache) -> bool:
    """Whether every query's selection holds all its causal positions (no sequence longer than `index_topk`)."""
    topk = module.config.index_topk
    if not isinstance(cache, PagedCache):
        return False
    step = cache._step
    if step.layout == "padded":
        return cache.get_seq_length() <= topk
    return max(_step_plan(step)[1], default=0) <= topk


# the families whose attention rotates halves of the rotary dims (the others rotate interleaved pairs; each family's
# indexer applies its own convention inside its own forward)
_ROTARY_HALVES = frozenset({"HYV4Attention"})


def _query(module, hidden: torch.Tensor):
    """(q_nope, q_pe `[B, H, q, *]`, q_resid, gate or None) as the family projects them."""
    batch, length = hidden.shape[:2]
    if hasattr(module, "q_gate_proj"):  # A.X K2: query and gate from [q_resid, q_a_proj(x)] in one projection
        compressed = module.q_a_proj(hidden)
        q_resid = module.q_a_layernorm(compressed)
        fused = module.q_gate_proj(torch.cat([q_resid, compressed], dim=-1))
        query, gate = torch.split(fused.view(batch, length, -1, module.qk_head_dim + module.v_head_dim),
                                  [module.qk_head_dim, module.v_head_dim], dim=-1)
        gate = gate.reshape(batch, length, -1)
    else:
        q_resid = module.q_a_layernorm(module.q_a_proj(hidden))
        query = module.q_b_proj(q_resid).view(batch, length, -1, module.qk_head_dim)
        gate = None
        if hasattr(module, "gate_proj"):  # HY-V4: a per-head gate on the output
            gate = module.gate_proj(hidden).view(batch, length, -1, module.gate_projection_size)
    q_nope, q_pe = torch.split(query.transpose(1, 2), [module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    return q_nope, q_pe, q_resid, gate


def _latent_sparse_attention(module, hidden, position_embeddings, attention_mask, cache, prev_selection):
    """The module's attention through the latent pool and the selection; returns (output after `o_proj`, the
    selection it used, for a following "shared" layer)."""
    batch, length = hidden.shape[:2]
    rank, rope = module.kv_lora_rank, module.qk_rope_head_dim
    q_nope, q_pe, q_resid, gate = _query(module, hidden)
    c_kv, k_pe = torch.split(module.kv_a_proj_with_mqa(hidden), [rank, rope], dim=-1)
    c_kv = module.kv_a_layernorm(c_kv).view(batch, 1, length, rank)
    k_pe = k_pe.view(batch, 1, length, rope)
    cos, sin = position_embeddings
    family = family_module(module)
    halves = type(module).__name__ in _ROTARY_HALVES
    rotary = family.apply_rotary_pos_emb if halves else family.apply_rotary_pos_emb_interleave
    q_pe, k_pe = rotary(q_pe, k_pe, cos, sin)
    latent = torch.cat((c_kv, k_pe.to(c_kv.dtype)), dim=-1)  # [B, 1, q, r + rope]
    keys, values = cache.update(latent, latent, module.layer_idx)
    if module.indexer is not None:
        selection = select_positions(module.indexer, hidden, q_resid, position_embeddings, attention_mask, cache)
    elif prev_selection is None:
        raise ValueError(f"layer {module.layer_idx} shares the previous layer's top-k but was given none")
    else:
        selection = prev_selection
    indices = None if _holds_every_position(module, cache) else selection
    w_uk, w_uv = absorbed_weights(module)
    q_latent = torch.einsum("bhqn,hnr->bhqr", q_nope, w_uk.to(q_nope.dtype))
    query = torch.cat((q_latent, q_pe.to(q_latent.dtype)), dim=-1)  # [B, H, q, r + rope]
    out = attend(module, query, keys, values, attention_mask, module.scaling, indices=indices,
                 s_aux=getattr(module, "sinks", None))  # [B, q, H, r + rope]
    out = torch.einsum("bqhr,hvr->bqhv", out[..., :rank], w_uv.to(out.dtype))
    if gate is not None and gate.dim() == 4:  # HY-V4
        out = out * torch.sigmoid(gate)
    out = out.reshape(batch, length, module.num_heads * module.v_head_dim)
    if gate is not None and gate.dim() == 3:  # A.X K2 (in float32, as the module does)
        out = (out * torch.sigmoid(gate.float())).to(out.dtype)
    return module.o_proj(out), selection


def _four_d_mask(module, hidden, attention_mask, cache) -> torch.Tensor:
    """The `[B, 1, q, kv]` mask the family's own forward indexes (`attention_mask[:, 0]`), from hf-paged's 2D one
    (which spans the keys) or, without one, this layer's cached length (before its update) and the new tokens."""
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    batch, q_len = hidden.shape[:2]
    if attention_mask is not None:
        kv_len = attention_mask.shape[1]
    else:
        kv_len = (cache.get_seq_length(module.layer_idx) if cache is not None else 0) + q_len
    return causal_index_mask(attention_mask, batch, q_len, kv_len, hidden.device)[:, None]


def dsa_forward(module, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                position_ids=None, prev_topk_indices=None, **kwargs):
    """`forward(hidden_states, position_embeddings, attention_mask, past_key_values, position_ids, [prev_topk_indices],
    **kwargs)` of the four families; returns `(output, None)`, or `(output, None, selection)` where the family's
    layers hand a selection on (GLM-5, HY-V4)."""
    hands_on = hasattr(module, "skip_topk")
    if not holds_latent(past_key_values):  # the module's own code (a DynamicCache, no cache): dense K/V, its mask
        extra = {"prev_topk_indices": prev_topk_indices} if hands_on else {}
        return module._hf_paged_original(hidden_states, position_embeddings, _four_d_mask(
            module, hidden_states, attention_mask, past_key_values), past_key_values, position_ids, **extra, **kwargs)
    out, selection = _latent_sparse_attention(module, hidden_states, position_embeddings, attention_mask,
                                              past_key_values, prev_topk_indices)
    return (out, None, selection) if hands_on else (out, None)


_HANDLES = frozenset({"latent_kv", "value_head_dim", "sparse_attention"})

register(
    "transformers.models.deepseek_v32.modeling_deepseek_v32.DeepseekV32Attention",
    "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaAttention",
    "transformers.models.hy_v4.modeling_hy_v4.HYV4Attention",
    "transformers.models.axk2.modeling_axk2.AXK2Attention",
    adapter=Adapter("dsa", "forward", dsa_forward, handles=_HANDLES, refuse=_refuse),
)
