"""DiffLlama: differential attention as one paged call, with KV heads `a` and `a + kv_heads / 2` paired in the pool.

What DiffLlama does differently: after `Cache.update()` it splits the values along the KV-head axis into two halves
and broadcasts each back to all KV heads (`value_states1 = [V_0..V_{h-1}, V_0..V_{h-1}]`, `value_states2 = [V_h..,
V_h..]` with `h = kv_heads / 2`), calls the attention function twice with the same query and keys, concatenates the
two outputs on the last axis, and combines head halves with the learned lambda and a group norm. So KV head `g`'s
attention weights are applied to values of `g mod h` and of `h + g mod h`, values the cache never returned for `g`
(the gate's `kv_after_update`): the paged kernels read a query head's keys and values from one pool head.

The adapter stores the two heads that share values side by side instead: pool head `a` (of `kv_heads / 2`) holds
`K' = [K_a | K_{a+h}]` and `V' = [V_a | V_{a+h}]` (twice the head width, the same bytes per token; the pool's shape
comes from `cache.memory.layer_kv_shapes`, `_PAIRED_KV_HEADS`), written through the ordinary
`past_key_values.update(K', V', layer_idx)`. A query head of KV group `g = s * h + a` (`s` 0 or 1) is given as
`[Q, 0]` (s = 0) or `[0, Q]` (s = 1) against pool head `a`, so `Q' . K'_a = Q . K_g` (the model's logits, with its
own `scaling`), and the output `P V'_a = [P V_a | P V_{a+h}]` is exactly the concatenation of the model's two calls
for that head (`value_states1[g] = V_a`, `value_states2[g] = V_{a+h}`). The query heads are ordered so that the
kernels' `head // group` mapping reads pool head `a` for both halves, and the output is put back in the model's head
order. A module whose KV heads are not its config's (a tensor-parallel shard, which splits the pairs across ranks) is
refused. Everything else is the module's own: projections, the family's `apply_rotary_pos_emb` (before the cache, as the
module applies it), the lambda parameters, `lambda_init`, `groupnorm` and `o_proj`, re-stated in the module's order.
"""

from __future__ import annotations

import torch

from .registry import Adapter, attend, family_module, register

__all__ = ["diffllama_forward", "pair_heads"]


def pair_heads(states: torch.Tensor) -> torch.Tensor:
    """`[B, kv_heads, L, D]` -> `[B, kv_heads / 2, L, 2D]`: head `a` is `[states_a | states_{a + kv_heads / 2}]`."""
    batch, heads, length, dim = states.shape
    paired = states.view(batch, 2, heads // 2, length, dim).permute(0, 2, 3, 1, 4)
    return paired.reshape(batch, heads // 2, length, 2 * dim)


def _paired_query(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`[B, Hq, L, D]` -> `[B, Hq, L, 2D]` in the order (pool head a, half s, head i of the group): the query of KV
    group `s * kv_heads / 2 + a`, zero on the other half, so that head `j` reads pool head `j // (Hq / (kv_heads /
    2))`, which is `a`."""
    batch, heads, length, dim = query.shape
    group = heads // kv_heads
    grouped = query.view(batch, 2, kv_heads // 2, group, length, dim).transpose(1, 2)  # [B, a, s, i, L, D]
    paired = query.new_zeros(batch, kv_heads // 2, 2, group, length, 2 * dim)
    paired[:, :, 0, :, :, :dim] = grouped[:, :, 0]
    paired[:, :, 1, :, :, dim:] = grouped[:, :, 1]
    return paired.view(batch, heads, length, 2 * dim)


def _refuse(module: torch.nn.Module) -> str | None:
    """A module that writes other KV heads than its config's `num_key_value_heads` cannot pair heads `a` and
    `a + kv_heads / 2` (a tensor-parallel shard holds one of them only)."""
    width, heads = getattr(module.k_proj, "out_features", None), module.config.num_key_value_heads
    if width != heads * module.head_dim:
        return f"k_proj writes {width} values, not the config's {heads} KV heads of {module.head_dim}"
    return None


def diffllama_forward(module: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings=None,
                      attention_mask: torch.Tensor | None = None, past_key_values=None, **kwargs):
    """`DiffLlamaAttention.forward` through one paged attention call; returns `(output, None)`."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    query = module.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key = module.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = family_module(module).apply_rotary_pos_emb(query, key, cos, sin)
    kv_heads = key.shape[1]
    if kv_heads != module.config.num_key_value_heads:
        raise ValueError(f"DiffLlama under hf-paged pairs the config's {module.config.num_key_value_heads} KV heads; "
                         f"this module has {kv_heads} (a tensor-parallel shard is not supported)")
    key, value = pair_heads(key), pair_heads(value)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, module.layer_idx)
    out = attend(module, _paired_query(query, kv_heads), key, value, attention_mask, module.scaling,
                 sliding_window=kwargs.get("sliding_window"))  # [B, L, Hq, 2D] in the (a, s, i) order
    batch, length, heads, width = out.shape
    group = heads // kv_heads
    # back to the model's head order: `torch.cat([attn_output1, attn_output2], dim=-1)` of its two calls
    attn_output = out.view(batch, length, kv_heads // 2, 2, group, width).transpose(2, 3).reshape(out.shape)
    # the module's own differential combination
    attn_output1, attn_output2 = torch.chunk(attn_output, 2, dim=2)
    lambda_1 = torch.exp(torch.sum(module.lambda_q1 * module.lambda_k1, dim=-1, dtype=torch.float32)).to(query.dtype)
    lambda_2 = torch.exp(torch.sum(module.lambda_q2 * module.lambda_k2, dim=-1, dtype=torch.float32)).to(query.dtype)
    lambda_full = lambda_1 - lambda_2 + module.lambda_init
    attn_output = attn_output1 - lambda_full * attn_output2
    attn_output = (1 - module.lambda_init) * module.groupnorm(attn_output)
    return module.o_proj(attn_output.reshape(*input_shape, -1)), None


register("transformers.models.diffllama.modeling_diffllama.DiffLlamaAttention",
         adapter=Adapter("diffllama", "forward", diffllama_forward, refuse=_refuse))
