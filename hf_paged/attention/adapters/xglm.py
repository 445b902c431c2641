"""XGLM: fairseq-style self-attention (`XGLMAttention.forward`) re-stated around the module's own projections.

What XGLM does differently: the module serves self- and cross-attention (`key_value_states`, with an
`EncoderDecoderCache`), pre-scales the query (`q_proj(x) * self.scaling`) and computes the softmax with `bmm` and the
model's additive 4D mask. Positions are sinusoidal embeddings added to the input (from `position_ids`), outside
attention. The adapter runs the module's own `q_proj` / `k_proj` / `v_proj` / `out_proj`, updates the cache as the
module does for self-attention, and calls the paged attention with scale 1 (the query already carries the scale).
Cross-attention (a decoder given encoder states) is refused by the gate (`cross_attention`); an adapted module called
with `key_value_states` raises instead of silently attending over the wrong keys.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import EncoderDecoderCache

from .registry import Adapter, attend, register

__all__ = ["xglm_forward"]


def xglm_forward(module: torch.nn.Module, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None = None,
                 past_key_values=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """`XGLMAttention.forward` (self-attention) through the paged attention; returns `(output, None)`."""
    if key_value_states is not None:
        raise ValueError("hf-paged runs XGLM's self-attention only: cross-attention to encoder states is not supported")
    batch, length = hidden_states.shape[:2]
    shape = (batch, length, -1, module.head_dim)
    query = (module.q_proj(hidden_states) * module.scaling).view(shape).transpose(1, 2)
    key = module.k_proj(hidden_states).view(shape).transpose(1, 2)
    value = module.v_proj(hidden_states).view(shape).transpose(1, 2)
    if past_key_values is not None:
        if isinstance(past_key_values, EncoderDecoderCache):
            past_key_values = past_key_values.self_attention_cache
        key, value = past_key_values.update(key, value, module.layer_idx)
    out = attend(module, query, key, value, attention_mask, 1.0)
    return module.out_proj(out.reshape(batch, length, module.embed_dim)), None


register("transformers.models.xglm.modeling_xglm.XGLMAttention", adapter=Adapter("xglm", "forward", xglm_forward))
