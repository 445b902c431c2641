"""GPT-J, CodeGen, GPT-Neo and GPT-NeoX-Japanese: the inner `_attn(query, key, value, attention_mask)` replaced,
nothing else.

What these families do differently: their attention module's `forward` projects q/k/v, applies its rotary code (GPT-J,
CodeGen: interleaved rotary on the first `rotary_dim` dims, from a sinusoid table; GPT-NeoX-Japanese: the model's
rotary embedding on `rotary_ndims`; GPT-Neo: none, learned absolute positions outside attention), calls
`layer_past.update(key, value, layer)` and hands the returned K/V straight to
`self._attn`, which computes the softmax attention by hand (float32 logits, `torch.where` with a causal buffer)
instead of calling `AttentionInterface`. Everything but that last step is the model's own code, so only `_attn` is
replaced, on each instance.

Why it is safe: `_attn` receives exactly what an interface-routed attention function receives (query `[B, H, q, D]`,
the K/V `update()` returned, untouched, and the model's mask from `create_causal_mask`, which under `hf_paged` is the
2D padding mask) and must return `([B, H, q, D], weights)`, which the module's `_merge_heads` turns into
`[B, q, H * D]`; the adapter returns the paged attention's output in that layout and no weights. The scale and the
window are the family's own:

* GPT-J and CodeGen divide the logits by `self.scale_attn` (sqrt(head_dim)); CodeGen adds the mask before dividing,
  which changes nothing a mask keeps. GPT-NeoX-Japanese multiplies them by `1 / self.norm_factor` (sqrt(head_dim)).
* GPT-Neo does not scale the logits at all (scale 1.0), and its `local` layers keep keys with `q - k < window_size`
  (its causal buffer XOR the one shifted by the window): transformers' `sliding_window` rule, so the kernels apply it.
"""

from __future__ import annotations

import torch

from .registry import Adapter, attend, register

__all__ = ["inner_attention"]


def _scale(module: torch.nn.Module) -> float:
    """The softmax scale of the family's `_attn`."""
    if hasattr(module, "scale_attn"):  # GPT-J, CodeGen
        return 1.0 / float(module.scale_attn)
    if hasattr(module, "norm_factor"):  # GPT-NeoX-Japanese
        return 1.0 / float(module.norm_factor)
    return 1.0  # GPT-Neo: no scaling


def _window(module: torch.nn.Module) -> int | None:
    if getattr(module, "attention_type", None) == "local":  # GPT-Neo's local layers
        return int(module.config.window_size)
    return None


def inner_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None = None, *args, **kwargs) -> tuple[torch.Tensor, None]:
    """`module._attn`: the paged attention over the K/V `update()` returned; `([B, H, q, D], None)`."""
    out = attend(module, query, key, value, attention_mask, _scale(module), sliding_window=_window(module))
    return out.transpose(1, 2), None


register(
    "transformers.models.gptj.modeling_gptj.GPTJAttention",
    "transformers.models.codegen.modeling_codegen.CodeGenAttention",
    "transformers.models.gpt_neo.modeling_gpt_neo.GPTNeoSelfAttention",
    "transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese.GPTNeoXJapaneseAttention",
    adapter=Adapter("inner _attn", "_attn", inner_attention),
)
