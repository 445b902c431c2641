"""Falcon: `FalconAttention.forward` re-stated around the model's own projections, head split and rotary code.

What Falcon does differently: one fused `query_key_value` projection split by `self._split_heads` in three layouts
(multi-query: one KV head; the new decoder architecture of Falcon-40B/180B: `num_kv_heads` groups, each K/V
*broadcast* to every query head of its group before the cache; or plain multi-head), rotary embeddings from the
model (`position_embeddings`) unless the config uses ALiBi, then `layer_past.update(...)` and an inline SDPA or eager
softmax, with the ALiBi bias folded into the mask, then `self.dense`. No `AttentionInterface`.

The adapter runs the same steps with the module's own `query_key_value`, `_split_heads`, the family's
`apply_rotary_pos_emb` and `self.dense`, and calls the paged attention where the module computed it. One change:
with the new decoder architecture the cache gets each group's K/V once (one head of each broadcast group, the heads
`_split_heads` made equal), not `num_heads` copies: the paged kernels read KV head `h // group` for query head `h`,
which is the head the broadcast gave it, and the pool holds the config's `num_kv_heads`. ALiBi (Falcon-RW): the
logits are `(q.k + alibi) / sqrt(head_dim)`, so the slopes the kernels take are the family's own
(`build_alibi_tensor`, with its bfloat16 rounding) times `inv_norm_factor`.
"""

from __future__ import annotations

import torch

from .alibi import alibi_buffers, slopes_of
from .registry import Adapter, attend, family_module, register

__all__ = ["falcon_forward"]


def _slopes(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    if not module.config.alibi:
        return {}
    ones = torch.ones((1, 2), dtype=torch.long)
    bias = family_module(module).build_alibi_tensor(ones, module.num_heads, torch.float32)  # [H, 1, 2]: slope * [0, 1]
    return alibi_buffers(module, bias[:, 0, 1] * module.inv_norm_factor)


def falcon_forward(module: torch.nn.Module, hidden_states: torch.Tensor, alibi: torch.Tensor | None,
                   attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None,
                   layer_past=None, use_cache: bool = False, output_attentions: bool = False,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs):
    """`FalconAttention.forward` through the paged attention; returns `(output, None)` as the module does."""
    query, key, value = module._split_heads(module.query_key_value(hidden_states))  # [B, L, heads, D]
    batch, length = query.shape[:2]
    if module.new_decoder_architecture:  # K/V broadcast over each group of query heads: keep one head of each
        group = module.num_heads // module.num_kv_heads
        key, value = key[:, :, ::group], value[:, :, ::group]
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    if alibi is None:
        cos, sin = position_embeddings
        query, key = family_module(module).apply_rotary_pos_emb(query, key, cos, sin)
    if layer_past is not None:
        key, value = layer_past.update(key, value, module.layer_idx)
    out = attend(module, query, key, value, attention_mask, module.inv_norm_factor,
                 alibi_slopes=slopes_of(module) if alibi is not None else None)
    return module.dense(out.reshape(batch, length, module.num_heads * module.head_dim)), None


register("transformers.models.falcon.modeling_falcon.FalconAttention",
         adapter=Adapter("falcon", "forward", falcon_forward, prepare=_slopes))
