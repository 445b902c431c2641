"""ALiBi: the slopes the paged kernels take (computed once per adapted module from the family's own helper), and the
adapters of BLOOM and MPT (Falcon-RW's is in `falcon`).

ALiBi adds `slope[h] * key_position` to the logits of head `h` (BLOOM: positions counted among the row's real
tokens; MPT: `key - (max_seq_len - 1)`; Falcon-RW: as BLOOM, then scaled with the logits). For one query row that is
`slope[h] * (key - query)` plus a constant, and softmax ignores a constant added to a whole row, so the kernels'
`alibi_slopes` option (`slope[h] * (key_pos - query_pos)` over the row's cache positions) gives the same attention
whatever the padding or the offset each family counts from. The slopes are read off the family's own ALiBi function
(`build_alibi_tensor`, `build_mpt_alibi_tensor`) evaluated at two positions, never re-derived, so rounding the
family applies to them (Falcon's bfloat16) is kept.
"""

from __future__ import annotations

import torch

from .registry import Adapter, attend, family_module, register

__all__ = ["SLOPES", "alibi_buffers", "slopes_of", "bloom_forward", "mpt_forward"]

SLOPES = "_hf_paged_alibi_slopes"  # the non-persistent buffer an ALiBi adapter keeps on its module


def alibi_buffers(module: torch.nn.Module, slopes: torch.Tensor) -> dict[str, torch.Tensor]:
    """What an ALiBi adapter's `prepare` returns: the per-head slopes (in the logits' units), float32."""
    return {SLOPES: slopes.detach().to(torch.float32).contiguous()}


def slopes_of(module: torch.nn.Module) -> torch.Tensor:
    """The slopes `prepare` left on `module` (`[num_heads]`, float32, on the module's device)."""
    return getattr(module, SLOPES)


# ---------------------------------------------------------------------------------------------------------------------
# BLOOM and MPT: their attention modules re-stated around the model's own projections, with ALiBi in the kernels.
#
# What they do differently: neither has rotary or learned positions (their model forward takes no `position_ids`): the
# only position information is the ALiBi bias, which the model builds once per forward (`alibi` / `position_bias`) and
# each attention module adds to its hand-written logits (BLOOM: `alibi.baddbmm(q, k^T, alpha=1/sqrt(d))`, the bias
# unscaled; MPT: `q.k * softmax_scale + position_bias`, with `clip_qkv` clamping the fused projection). The adapters
# run the module's own `query_key_value` / `_reshape` / `dense` (BLOOM, then the family's `dropout_add` of the
# residual, which BLOOM's attention returns) and `Wqkv` / `out_proj` (MPT), and pass the slopes to the kernels instead
# of the bias tensor. Since the kernels compute the bias from each sequence's cache positions, these families need no
# `position_ids` under hf-paged (the adapter `handles` "no_position_ids"); MPT's model calls `.to(torch.bool)` on its
# mask, hence `mask_tensor`. In float32 the result is transformers'; in 16-bit types transformers rounds the absolute
# biases (`slope * position`) to the model's dtype, which the relative form does not reproduce bit for bit.


def _bloom_slopes(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    ones = torch.ones((1, 2), dtype=torch.long)
    bias = family_module(module).build_alibi_tensor(ones, module.num_heads, torch.float32)  # [H, 1, 2]: slope * [0, 1]
    return alibi_buffers(module, bias[:, 0, 1])


def _bloom_refusal(module: torch.nn.Module) -> str | None:
    if module.pretraining_tp > 1 and module.slow_but_exact:
        return "slow_but_exact with pretraining_tp > 1 (a sliced output projection)"
    return None


def bloom_forward(module: torch.nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor, alibi: torch.Tensor,
                  attention_mask: torch.Tensor | None, layer_past=None, use_cache: bool = False,
                  output_attentions: bool = False, **kwargs):
    """`BloomAttention.forward` through the paged attention; returns `(output + residual, None)` as the module."""
    batch, length = hidden_states.shape[:2]
    query, key, value = module._reshape(module.query_key_value(hidden_states))  # [B, H, L, D] each
    if layer_past is not None:
        key, value = layer_past.update(key, value, module.layer_idx)
    out = attend(module, query, key, value, attention_mask, module.inv_norm_factor, alibi_slopes=slopes_of(module))
    output = module.dense(out.reshape(batch, length, module.num_heads * module.head_dim))
    return family_module(module).dropout_add(output, residual, module.hidden_dropout, module.training), None


def _mpt_slopes(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    bias = family_module(module).build_mpt_alibi_tensor(module.n_heads, 2)  # as MptModel calls it: [H, 1, 2]
    return alibi_buffers(module, bias[:, 0, 1] - bias[:, 0, 0])


def mpt_forward(module: torch.nn.Module, hidden_states: torch.Tensor, position_bias: torch.Tensor | None,
                past_key_values=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """`MptAttention.forward` through the paged attention; returns `(output, None)` as the module does."""
    batch, length = hidden_states.shape[:2]
    qkv = module.Wqkv(hidden_states)
    if module.clip_qkv:
        qkv = qkv.clamp(min=-module.clip_qkv, max=module.clip_qkv)
    query, key, value = (t.reshape(batch, length, module.n_heads, module.head_dim).transpose(1, 2)
                         for t in qkv.chunk(3, dim=2))
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, module.layer_idx)
    slopes = slopes_of(module) if position_bias is not None else None
    out = attend(module, query, key, value, attention_mask, module.softmax_scale, alibi_slopes=slopes)
    return module.out_proj(out.reshape(batch, length, -1)), None


register("transformers.models.bloom.modeling_bloom.BloomAttention",
         adapter=Adapter("bloom", "forward", bloom_forward, handles=frozenset({"no_position_ids"}),
                         refuse=_bloom_refusal, prepare=_bloom_slopes))
register("transformers.models.mpt.modeling_mpt.MptAttention",
         adapter=Adapter("mpt", "forward", mpt_forward, handles=frozenset({"no_position_ids"}), prepare=_mpt_slopes,
                         mask_tensor=True))
