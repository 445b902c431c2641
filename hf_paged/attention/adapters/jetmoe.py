"""JetMoE: mixture-of-attention-heads, whose K/V are tiled over the query experts *after* `Cache.update()`.

What JetMoE does differently: the query projection is a mixture of experts (`self.experts.map` gives each token
`top_k` expert queries of `num_key_value_heads` heads each), K/V come from one shared `kv_proj`, and after the cache
update the module tiles K/V `top_k` times (`key.repeat(1, top_k, 1, 1)`: query head `k * Hkv + j` reads KV head `j`)
before calling `AttentionInterface`; the expert outputs are merged by `self.experts.reduce`. Tiling the pool would
copy all of it, so the adapter re-states the forward with the module's own `experts.map`, `kv_proj`, the family's
`apply_rotary_pos_emb` and `experts.reduce`, and instead orders the query heads KV-head-major (`j * top_k + k`): the
paged kernels then read KV head `j` for every expert query of head `j`, exactly the head the tiling gave it, from the
untiled pool. The output is put back in expert-major order before `reduce`.
"""

from __future__ import annotations

import torch

from .registry import Adapter, attend, family_module, register

__all__ = ["jetmoe_forward"]


def jetmoe_forward(module: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, past_key_values=None,
                   **kwargs):
    """`JetMoeAttention.forward` through the paged attention; returns `(output, None, router_logits)`."""
    batch, length = hidden_states.shape[:2]
    top_k, kv_heads, head_dim = module.top_k, module.num_key_value_heads, module.head_dim
    query, router_logits, topo_info = module.experts.map(hidden_states)  # [B, L, top_k, Hkv * D]
    key, value = module.kv_proj(hidden_states).chunk(2, dim=-1)
    # KV-head-major query heads: [B, L, top_k, Hkv, D] -> [B, Hkv * top_k, L, D]
    query = query.view(batch, length, top_k, kv_heads, head_dim).transpose(2, 3).reshape(batch, length, -1, head_dim)
    query = query.transpose(1, 2)
    key = key.view(batch, length, kv_heads, head_dim).transpose(1, 2)
    value = value.view(batch, length, kv_heads, head_dim).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = family_module(module).apply_rotary_pos_emb(query, key, cos, sin)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, module.layer_idx)
    out = attend(module, query, key, value, attention_mask, module.scaling)  # [B, L, Hkv * top_k, D]
    out = out.reshape(batch, length, kv_heads, top_k, head_dim).transpose(2, 3).reshape(batch, length, top_k, -1)
    return module.experts.reduce(out, topo_info).view(batch, length, -1), None, router_logits


register("transformers.models.jetmoe.modeling_jetmoe.JetMoeAttention",
         adapter=Adapter("jetmoe", "forward", jetmoe_forward))
