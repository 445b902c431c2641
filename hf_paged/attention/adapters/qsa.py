"""Qwen sparse attention (QSA, Qwen4-Exp's `qwen_sparse_attention` layers): each query reads the token blocks an
indexer picks, plus its unfinished last block.

What the family does differently: its attention module (`Qwen4ExpTextAttention`, gated GQA) first asks its indexer
(`Qwen4ExpTextQSAIndexer`) for a mask. The indexer projects index queries (per head, `q_layernorm`, rotary at the
query's position) and one *raw* index key per token (cached through `past_key_values.update_indexer`); for every query
it cuts the tokens it sees into blocks of `indexer_compress_ratio` (from the first real token), pools each complete
block (the mean of its raw keys, `k_layernorm`, rotary at the block's first position), scores the blocks
(`relu(q . k)` summed over heads, over `sqrt(head_dim)`, float32), keeps the top `indexer_budget / ratio` blocks
(`topk`) and adds the tail of tokens past the last complete block; the attention then ANDs that into its mask. The
model binds the *full* position ids of every forward to the cache object (`past_key_values.position_ids`) so the
indexer can rotate block keys at old positions.

The adapter (on a `PagedCache`; any other cache gets the module's own forward) keeps the module's projections and
code for everything but the selection:

* raw index keys in the pool beside K/V, same blocks (`cache.index_keys`, `KVShape.index_dim`), written at the step's
  slots;
* the selection (:func:`qsa_positions`) per sequence, against its own keys only: its raw keys gathered by block table,
  its complete blocks pooled once (`k_layernorm` and the rotary of the model's own `Qwen4ExpTextRotaryEmbedding`,
  built from the module's config, at the blocks' first positions: a row's position counts its real tokens, as
  transformers' positions do), and for each query the same float32 scores over the blocks it sees and the same
  `topk` on exactly those (one call per query, as transformers does: equal inputs, equal ties);
* attention over exactly the selected positions (`indices=`: `functions._sparse_paged_attention`), or the dense
  kernels where every query sees no more blocks than it keeps;
* `past_key_values.position_ids` is not grown: a `PagedCache` hands the model an empty history there
  (`IndexKeys.position_ids`), since the adapter computes the rotary of old positions itself; an engine's cache would
  otherwise keep every position of every step of every sequence.
"""

from __future__ import annotations

import math

import torch

from ...cache import PagedCache
from ...cache.index_keys import gather_index_keys
from .dsa import _four_d_mask
from .registry import Adapter, attend, family_module, register

__all__ = ["qsa_forward", "qsa_positions"]


def _rotary(module: torch.nn.Module, positions: torch.Tensor, like: torch.Tensor):
    """(cos, sin) `[1, n, dim]` of the model's own rotary at `positions [n]` (text positions: the three rows alike)."""
    rotary = module.__dict__.get("_hf_paged_qsa_rotary")
    if rotary is None:
        rotary = family_module(module).Qwen4ExpTextRotaryEmbedding(module.config)
        module.__dict__["_hf_paged_qsa_rotary"] = rotary  # (not a submodule: no parameters, no state dict entry)
    rotary.to(like.device)
    return rotary(like, positions.view(1, 1, -1).expand(3, 1, -1))


def _sequence_selection(indexer, module, raw: torch.Tensor, queries: torch.Tensor, query_pos: list[int],
                        width: int) -> torch.Tensor:
    """`[q, width]` positions (in the sequence's own real-token numbering) for queries `[q, H, D]` (normed and rotated)
    at `query_pos`, over the sequence's raw keys `raw [L, D]`; -1 fills."""
    ratio = indexer.compress_ratio
    out = torch.full((len(query_pos), width), -1, dtype=torch.long, device=raw.device)
    blocks = (max(query_pos, default=-1) + 1) // ratio
    if blocks:
        pooled = raw[:blocks * ratio].view(blocks, ratio, -1).float().mean(dim=1).to(raw.dtype)
        pooled = indexer.k_layernorm(pooled)
        starts = torch.arange(blocks, device=raw.device) * ratio
        cos, sin = _rotary(module, starts, pooled)
        keys = family_module(module).apply_rotary_pos_emb(pooled.unsqueeze(1), cos=cos[0], sin=sin[0]).squeeze(1)
    for i, pos in enumerate(query_pos):
        seen = (pos + 1) // ratio  # complete blocks this query sees
        chosen = torch.empty(0, dtype=torch.long, device=raw.device)
        if seen > 0:
            scores = torch.matmul(queries[i].float(), keys[:seen].float().transpose(-1, -2)).transpose(-1, -2)
            scores = torch.relu(scores).sum(dim=-1) / math.sqrt(indexer.index_head_dim)
            picked = scores.topk(min(indexer.block_topk, seen), dim=0).indices
            chosen = (starts[picked][:, None] + torch.arange(ratio, device=raw.device)).flatten()
        tail = torch.arange(seen * ratio, pos + 1, device=raw.device)
        chosen = torch.cat([chosen, tail])
        out[i, :chosen.numel()] = chosen
    return out


def _queries(indexer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(index queries `[B, q, H, D]`, normed and rotated; raw keys `[B, q, D]`), projected as the indexer does."""
    batch, length = hidden.shape[:2]
    q, raw = torch.split(indexer.index_qk_proj(hidden), [indexer.index_n_heads * indexer.index_head_dim,
                                                         indexer.index_kv_heads * indexer.index_head_dim], dim=-1)
    q = indexer.q_layernorm(q.reshape(batch, length, -1, indexer.index_head_dim))
    q = family_module(indexer).apply_rotary_pos_emb(q, cos=cos, sin=sin, unsqueeze_dim=2)
    return q, raw.reshape(batch, length, indexer.index_head_dim)


def qsa_positions(module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_mask,
                  cache: PagedCache) -> tuple[torch.Tensor, bool]:
    """(each query's selected positions `[B, q, K]` in its row's coordinates, -1 fills; whether every query keeps
    all it sees), the raw index keys of this step written to `cache` first."""
    indexer = module.indexer
    step = cache._step
    queries, raw = _queries(indexer, hidden, cos, sin)
    cache.write_index_keys(module.layer_idx, raw.reshape(-1, raw.shape[-1]), step.slot_mapping)
    pool = cache.index_pool(module.layer_idx)
    width = indexer.token_budget + indexer.compress_ratio - 1
    batch, q_len = hidden.shape[:2]
    selection = torch.full((batch * q_len, width), -1, dtype=torch.long, device=hidden.device)
    flat_q = queries.reshape(batch * q_len, *queries.shape[2:])
    if step.layout == "ragged":  # each sequence: its rows, positions 0..length-1
        q_lens = step.cu_seqlens_q.diff().tolist()
        lens = step.seq_lens[:len(q_lens)].tolist()
        pieces, first = [], 0
        for s, (n, length) in enumerate(zip(q_lens, lens)):
            pieces.append((s, first, n, length, 0))
            first += n
    else:  # each row: left padding first (its real tokens from `start`), its queries at the last q_len positions
        kv_len = cache.get_seq_length()
        valid = attention_mask.to(torch.bool)[:, -kv_len:] if attention_mask is not None else None
        starts = ((valid.cumsum(-1) == 0).sum(-1).tolist() if valid is not None else [0] * batch)
        pieces = [(b, b * q_len, q_len, kv_len, starts[b]) for b in range(batch)]
    longest = 0
    for row, first, n, length, start in pieces:
        real = length - start
        longest = max(longest, real)
        query_pos = [p - start for p in range(length - n, length)]
        keep = [i for i, p in enumerate(query_pos) if p >= 0]  # (a pad query selects nothing)
        if not keep or real <= 0:
            continue
        keys = gather_index_keys(pool, step.block_tables[row:row + 1], length)[0, start:].to(raw.dtype)
        picked = _sequence_selection(indexer, module, keys, flat_q[first:first + n][keep],
                                     [query_pos[i] for i in keep], width)
        rows = torch.tensor([first + i for i in keep], device=hidden.device)
        selection[rows] = torch.where(picked >= 0, picked + start, -1)
    every = longest // indexer.compress_ratio <= indexer.block_topk
    return selection.view(batch, q_len, width), every


def qsa_forward(module, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                **kwargs):
    """`Qwen4ExpTextAttention.forward(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)`;
    returns `(output, None)`."""
    if not isinstance(past_key_values, PagedCache):  # the module's own code, with the 4D mask its indexer reads
        return module._hf_paged_original(hidden_states, position_embeddings, _four_d_mask(
            module, hidden_states, attention_mask, past_key_values), past_key_values, **kwargs)
    cos, sin = (x[:, -hidden_states.shape[1]:, :] for x in position_embeddings)  # (current positions, as it slices)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    query, gate = torch.chunk(module.q_proj(hidden_states).view(*input_shape, -1, module.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(*input_shape, -1)
    query = module.q_norm(query.view(hidden_shape)).transpose(1, 2)
    key = module.k_norm(module.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    query, key = family_module(module).apply_rotary_pos_emb(query, key, cos, sin)
    key, value = past_key_values.update(key, value, module.layer_idx)  # (opens the step the index keys go to)
    selection, every = qsa_positions(module, hidden_states, cos, sin, attention_mask, past_key_values)
    out = attend(module, query, key, value, attention_mask, module.scaling, indices=None if every else selection)
    out = out.reshape(*input_shape, -1).contiguous() * torch.sigmoid(gate)
    return module.o_proj(out), None


def _refuse(module: torch.nn.Module) -> str | None:
    if getattr(module.indexer, "index_kv_heads", 1) != 1:
        return f"indexer_kv_heads={module.indexer.index_kv_heads} (one raw index key a token is kept)"
    return None


register("transformers.models.qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextAttention",
         adapter=Adapter("qsa", "forward", qsa_forward, handles=frozenset({"sparse_attention"}), refuse=_refuse))
