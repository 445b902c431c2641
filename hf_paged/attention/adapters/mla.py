"""Multi-head latent attention (DeepSeek-V2/V3 style, "MLA"): the compressed latent in the pool, attention absorbed.

What these families do differently: the attention module projects each token to a *latent* `c_kv`
(`kv_a_proj_with_mqa`, then `kv_a_layernorm`; `kv_lora_rank` values) and one shared rotary key `k_pe`
(`qk_rope_head_dim` values), caches those two (as K and V of different widths), and after `Cache.update()` expands the
whole prefix into per-head keys `[k_nope | k_pe]` and values with `kv_b_proj` before calling the attention function:
K/V of different head sizes that the cache never returned, which the paged attention cannot read (the gate's
`latent_kv`, `value_head_dim`, `kv_after_update`).

The adapter stores the latent instead, as vLLM does: `L = cat(c_kv, k_pe)`, one KV head of width
`kv_lora_rank + qk_rope_head_dim` (576 for DeepSeek-V2/V3), written through the ordinary
`past_key_values.update(L, L, layer_idx)` (keys and values are the same tensor; the pool's shape for such a layer,
`cache.KVShape(values_are_keys=True)`, stores it once and returns one tensor for both). Attention runs in the latent space with the
up-projection absorbed into the query: with `W_UK [H, nope, r]` and `W_UV [H, v, r]` the two halves of `kv_b_proj`'s
weight per head,

    q_nope . k_nope = q_nope . (W_UK c) = (W_UK^T q_nope) . c      and      sum_t p_t W_UV c_t = W_UV (sum_t p_t c_t),

so the query `[W_UK^T q_nope | q_pe]` (width r + rope) against the keys `L` gives exactly the model's logits, the
output's first r columns times `W_UV` give exactly its per-head values, and the call in between is an ordinary
multi-query attention (1 KV head, `num_heads` query heads, values = keys) with the module's own `scaling` (yarn's
mscale included). So the paged kernels, CUDA graphs, the compiled step, prefix caching, beams, swap and preemption see
an ordinary MQA layer.

Everything else is the module's own: `q_a_proj`/`q_a_layernorm`/`q_b_proj` (or `q_proj` without `q_lora_rank`),
`kv_a_proj_with_mqa`, `kv_a_layernorm`, `o_proj`, and the family's rotary helper from its modeling module:

* DeepSeek-V2: `apply_rotary_emb` (complex rotary on interleaved pairs, `position_embeddings` is `freqs_cis`);
* DeepSeek-V3, GLM-4-MoE-Lite (GLM-4.7-Flash), Youtu, A.X K1: `apply_rotary_pos_emb_interleave` when
  `config.rope_interleave`, else `apply_rotary_pos_emb`;
* MiniCPM3: `apply_rotary_pos_emb` (cos/sin rotary on halves);
* LongCat-Flash: `apply_rotary_pos_emb_interleave`, and its LoRA scales (`mla_scale_q_lora` on the whole query,
  `mla_scale_kv_lora` on `c_kv`) applied where the module applies them.

The latent path runs when the cache is a `PagedCache` (or one that says it holds latents, `holds_latent_kv`: the
run-time probe's recording cache, which stands for one); any other cache (a `DynamicCache` filled in the model's own
layout) and no cache at all get the module's own forward. Refused: a `kv_b_proj` that is not a plain bias-free
`nn.Linear` (a quantised checkpoint's packed weight cannot be split per head), and, on a device whose kernels are
Triton's, a latent wider than they take (`kernels.checks.triton_dims_refusal`: 1,024 values). DeepSeek's 576-wide
latent runs in the narrow kernels' small 16-bit tiles for up to 32 query heads (DeepSeek-V2-Lite's 16,
GLM-4.7-Flash's 20; measured on an H200), in the wide kernels otherwise (DeepSeek-V3's 128 heads, float32; checked
under Triton's interpreter only so far).
"""

from __future__ import annotations

import torch

from ...cache import PagedCache
from ...kernels import get_backend
from ...kernels.checks import triton_dims_refusal
from .registry import Adapter, attend, family_module, register

__all__ = ["mla_forward", "mla_forward_v2", "absorbed_weights", "holds_latent", "wide_latent_refusal"]


def holds_latent(cache) -> bool:
    """Does `cache` take the latent path (a `PagedCache`, or a cache whose `holds_latent_kv` says so)?"""
    return isinstance(cache, PagedCache) or getattr(cache, "holds_latent_kv", False) is True


def wide_latent_refusal(width: int, heads: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why a latent `width` values wide, read by `heads` query heads, in `dtype`, cannot be attended on `device` (None
    when it can): the Triton kernels take heads of up to 1,024 values (DeepSeek's latent is 576) for any number of
    query heads (`kernels.checks.triton_dims_refusal`); the torch backend, the CPU's, takes any. Said up front rather
    than by the first kernel call of a serving step."""
    if get_backend(device) != "triton":
        return None
    return triton_dims_refusal(width, heads, torch.empty((), dtype=dtype).element_size())


def _refuse(module: torch.nn.Module) -> str | None:
    proj = getattr(module, "kv_b_proj", None)
    if type(proj) is not torch.nn.Linear or proj.bias is not None:
        return f"kv_b_proj is {type(proj).__name__} (a bias-free nn.Linear is split per head for the absorbed query)"
    return wide_latent_refusal(module.kv_lora_rank + module.qk_rope_head_dim, module.num_heads, proj.weight.dtype,
                               proj.weight.device)


def absorbed_weights(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(`W_UK [H, nope, r]`, `W_UV [H, v, r]`): `kv_b_proj`'s weight split per head into its key and value parts
    (views: they follow weight updates and `model.to(...)`). Under tensor parallelism `kv_b_proj` is split by head
    (transformers' plan: colwise), and `H` is this rank's heads: its share of the weight (a DTensor's local part)."""
    weight = module.kv_b_proj.weight
    weight = weight.to_local() if hasattr(weight, "to_local") else weight
    per_head = module.qk_nope_head_dim + module.v_head_dim
    weight = weight.view(weight.shape[0] // per_head, per_head, -1)
    return weight[:, :module.qk_nope_head_dim], weight[:, module.qk_nope_head_dim:]


# each family's rotary convention where it is not DeepSeek-V3's (`config.rope_interleave` chooses)
_ROTARY = {"DeepseekV2Attention": "complex", "MiniCPM3Attention": "halves", "LongcatFlashMLA": "interleave"}


def _rotary(module: torch.nn.Module, q_pe: torch.Tensor, k_pe: torch.Tensor, position_embeddings):
    """The family's own rotary on the query and the shared key's rotary parts (`[B, H or 1, q, rope]`)."""
    family = family_module(module)
    kind = _ROTARY.get(type(module).__name__)
    if kind == "complex":  # DeepSeek-V2: complex rotary on pairs, `position_embeddings` is freqs_cis
        return family.apply_rotary_emb(q_pe, k_pe, position_embeddings.to(q_pe.device))
    cos, sin = position_embeddings
    if kind == "interleave" or (kind is None and module.config.rope_interleave):
        return family.apply_rotary_pos_emb_interleave(q_pe, k_pe, cos, sin)
    return family.apply_rotary_pos_emb(q_pe, k_pe, cos, sin)


def _query(module: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_nope `[B, H, q, nope]`, q_pe `[B, H, q, rope]`), projected as the module does (LongCat's scale applied)."""
    batch, length = hidden_states.shape[:2]
    if getattr(module, "q_a_proj", None) is None:
        q = module.q_proj(hidden_states)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    q = q.view(batch, length, -1, module.qk_head_dim).transpose(1, 2)
    scale = getattr(module, "mla_scale_q_lora", None)  # LongCat-Flash
    if scale is not None:
        q = q * scale
    q_nope, q_pe = torch.split(q, [module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    return q_nope, q_pe


def _latent_attention(module: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings, attention_mask,
                      past_key_values) -> torch.Tensor:
    """The module's attention through the latent pool; returns its output `[B, q, hidden]` (after `o_proj`)."""
    batch, length = hidden_states.shape[:2]
    rank, rope = module.kv_lora_rank, module.qk_rope_head_dim
    q_nope, q_pe = _query(module, hidden_states)
    c_kv, k_pe = torch.split(module.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    c_kv = module.kv_a_layernorm(c_kv)
    scale = getattr(module, "mla_scale_kv_lora", None)  # LongCat-Flash
    if scale is not None:
        c_kv = c_kv * scale
    c_kv = c_kv.view(batch, 1, length, rank)
    k_pe = k_pe.view(batch, 1, length, rope)
    q_pe, k_pe = _rotary(module, q_pe, k_pe, position_embeddings)
    latent = torch.cat((c_kv, k_pe.to(c_kv.dtype)), dim=-1)  # [B, 1, q, r + rope]
    keys, values = past_key_values.update(latent, latent, module.layer_idx)
    w_uk, w_uv = absorbed_weights(module)
    q_latent = torch.einsum("bhqn,hnr->bhqr", q_nope, w_uk.to(q_nope.dtype))
    query = torch.cat((q_latent, q_pe.to(q_latent.dtype)), dim=-1)  # [B, H, q, r + rope]
    out = attend(module, query, keys, values, attention_mask, module.scaling)  # [B, q, H, r + rope]
    out = torch.einsum("bqhr,hvr->bqhv", out[..., :rank], w_uv.to(out.dtype))
    return module.o_proj(out.reshape(batch, length, -1))  # (this rank's heads under tensor parallelism)


def mla_forward(module: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings=None,
                attention_mask: torch.Tensor | None = None, past_key_values=None, **kwargs):
    """`forward(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)` of the DeepSeek-V3
    pattern (V3, GLM-4-MoE-Lite, MiniCPM3, Youtu, LongCat-Flash, A.X K1); returns `(output, None)`."""
    if not holds_latent(past_key_values):
        return module._hf_paged_original(hidden_states, position_embeddings=position_embeddings,
                                         attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)
    return _latent_attention(module, hidden_states, position_embeddings, attention_mask, past_key_values), None


def mla_forward_v2(module: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   past_key_values=None, position_embeddings=None, **kwargs):
    """`DeepseekV2Attention.forward(hidden_states, attention_mask, past_key_values, position_embeddings, **kwargs)`;
    returns `(output, None)`."""
    if not holds_latent(past_key_values):
        return module._hf_paged_original(hidden_states, attention_mask=attention_mask,
                                         past_key_values=past_key_values, position_embeddings=position_embeddings,
                                         **kwargs)
    return _latent_attention(module, hidden_states, position_embeddings, attention_mask, past_key_values), None


_HANDLES = frozenset({"latent_kv", "value_head_dim"})

register("transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Attention",
         adapter=Adapter("mla", "forward", mla_forward_v2, handles=_HANDLES, refuse=_refuse))
register(
    "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention",
    "transformers.models.glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteAttention",
    "transformers.models.minicpm3.modeling_minicpm3.MiniCPM3Attention",
    "transformers.models.youtu.modeling_youtu.YoutuAttention",
    "transformers.models.longcat_flash.modeling_longcat_flash.LongcatFlashMLA",
    "transformers.models.axk1.modeling_axk1.AXK1Attention",
    adapter=Adapter("mla", "forward", mla_forward, handles=_HANDLES, refuse=_refuse),
)
