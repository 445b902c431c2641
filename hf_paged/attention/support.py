"""Which transformers causal LMs hf-paged supports, and a gate that refuses the rest with a reason.

Verified against transformers 5.17 modeling code (see docs/model-families.md). Every supported family:

* calls ``past_key_values.update(key, value, self.layer_idx)`` and passes the returned k/v unchanged to
  ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)(self, query, key, value, attention_mask,
  dropout=..., scaling=..., **kwargs)``;
* builds its mask with ``masking_utils.create_causal_mask`` (Mistral/Phi3/Qwen2/Qwen3 switch to
  ``create_sliding_window_causal_mask`` only when a sliding window is in use, which is refused here);
* is causal, single-stack (no cross-attention), without attention-logit soft-capping.

So for every accepted model the attention function receives ``sliding_window`` either not at all or ``None``,
and never ``softcap`` / ``s_aux``.

This module does not import torch or transformers.
"""

from __future__ import annotations

__all__ = ["SUPPORTED_MODEL_TYPES", "check_supported", "describe_support"]

# model_type -> (transformers class, notes for the README)
_FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "GQA; also SmolLM2/SmolLM (model_type llama)"),
    "mistral": ("MistralForCausalLM", "GQA; only with `sliding_window: null` (e.g. Mistral-7B v0.2+)"),
    "qwen2": ("Qwen2ForCausalLM", "GQA, q/k/v bias; only with `use_sliding_window: false` (the usual case)"),
    "qwen3": ("Qwen3ForCausalLM", "GQA, per-head q/k RMSNorm; only without sliding-window layers"),
    "phi3": ("Phi3ForCausalLM", "fused qkv, partial rotary; only with `sliding_window: null`"),
    "gemma": ("GemmaForCausalLM", "Gemma 1 (MQA/GQA, head_dim 256); Gemma 2/3 are refused (soft-capping, sliding)"),
    "opt": ("OPTForCausalLM", "MHA, learned positions; q pre-scaled, attention called with scaling=1.0"),
    "gpt2": ("GPT2LMHeadModel", "MHA, Conv1D, learned positions; optional per-layer scaling; no cross-attention"),
    "granite": ("GraniteForCausalLM", "GQA; scaling = attention_multiplier (not head_dim**-0.5)"),
}

SUPPORTED_MODEL_TYPES: frozenset[str] = frozenset(_FAMILIES)

# How each family decides that a sliding window is applied (transformers 5.17):
# - mistral, phi3: the model picks create_sliding_window_causal_mask and passes sliding_window=config.sliding_window
#   to the attention function whenever config.sliding_window is not None (all layers; layer_types is ignored).
# - qwen2, qwen3: per layer, from config.layer_types[i] == "sliding_attention" (built in __post_init__ from
#   use_sliding_window + max_window_layers); config.sliding_window may stay set while no layer uses it.
_WINDOW_BY_CONFIG = {"mistral", "phi3"}
_WINDOW_BY_LAYER_TYPES = {"qwen2", "qwen3"}


def _supported_list() -> str:
    return ", ".join(sorted(SUPPORTED_MODEL_TYPES))


def _get_config(model_or_config):
    config = model_or_config
    # A model (or anything carrying a config), not a config itself.
    if not hasattr(model_or_config, "model_type") and hasattr(model_or_config, "config"):
        config = model_or_config.config
    if not hasattr(config, "model_type"):
        raise TypeError(
            f"check_supported() expects a transformers PreTrainedModel or PretrainedConfig, got {type(model_or_config)!r}"
        )
    return config


def _sliding_window_reasons(model_type: str, config) -> list[str]:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    reasons: list[str] = []
    if getattr(config, "attention_chunk_size", None) is not None:
        reasons.append(f"chunked attention is used (attention_chunk_size={config.attention_chunk_size})")

    if model_type in _WINDOW_BY_LAYER_TYPES:
        bad = sorted({t for t in (layer_types or []) if t != "full_attention"})
        if bad:
            n = sum(t != "full_attention" for t in layer_types)
            reasons.append(
                f"{n} of {len(layer_types)} layers use {'/'.join(bad)} (sliding_window={window}; "
                f"use_sliding_window={getattr(config, 'use_sliding_window', None)}, "
                f"max_window_layers={getattr(config, 'max_window_layers', None)})"
            )
        return reasons

    if model_type in _WINDOW_BY_CONFIG:
        in_use = window is not None
    else:
        # Families whose modeling code ignores these fields: refuse anyway when they are set, because transformers'
        # DynamicCache(config=...) (the reference hf-paged is compared with) would build sliding-window layers.
        in_use = window is not None or any(t != "full_attention" for t in (layer_types or []))
    if in_use:
        reason = f"sliding-window attention is used (sliding_window={window})"
        max_pos = getattr(config, "max_position_embeddings", None)
        if window is not None and max_pos is not None and window >= max_pos:
            reason += (
                f"; it is >= max_position_embeddings={max_pos}, so it never masks anything within the model's "
                "context: set config.sliding_window = None before loading to use hf-paged"
            )
        reasons.append(reason)
    return reasons


def check_supported(model_or_config) -> None:
    """Raise ``ValueError`` (listing the supported families and every reason) unless hf-paged can run this model.

    Accepts a ``PreTrainedModel`` or a ``PretrainedConfig``. Refused: model types other than
    :data:`SUPPORTED_MODEL_TYPES`, encoder-decoders, cross-attention, non-causal / bidirectional attention,
    sliding-window or chunked attention in use, attention or final logit soft-capping, and remote-code model classes
    (``trust_remote_code``: they may not use transformers' attention/cache interfaces).
    """
    config = _get_config(model_or_config)
    model_type = getattr(config, "model_type", None) or "<none>"
    reasons: list[str] = []

    if getattr(config, "is_encoder_decoder", False):
        reasons.append("encoder-decoder models are not supported")
    if model_type not in SUPPORTED_MODEL_TYPES:
        reasons.append(f"model_type {model_type!r} is not supported")
    if getattr(config, "add_cross_attention", False):
        reasons.append("cross-attention (add_cross_attention=True) is not supported")
    if getattr(config, "is_causal", True) is False or getattr(config, "use_bidirectional_attention", False):
        reasons.append("non-causal (bidirectional) attention is not supported")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = getattr(config, name, None)
        if value is not None:
            reasons.append(f"soft-capping is not supported ({name}={value})")
    if model_type in SUPPORTED_MODEL_TYPES:
        reasons.extend(_sliding_window_reasons(model_type, config))
    else:
        # Still explain windows on unsupported types when they are obviously there (e.g. Gemma 2).
        window = getattr(config, "sliding_window", None)
        if window is not None:
            reasons.append(f"sliding-window attention is not supported (sliding_window={window})")

    if model_or_config is not config:
        remote = [c for c in type(model_or_config).__mro__ if (c.__module__ or "").startswith("transformers_modules")]
        if remote:
            reasons.append(
                f"the model class {type(model_or_config).__name__} is remote code ({remote[0].__module__}); its "
                "modeling may not use transformers' cache/attention interfaces: load it without trust_remote_code"
            )

    if reasons:
        raise ValueError(
            f"hf-paged cannot run this model ({model_type}): "
            + "; ".join(reasons)
            + f". Supported model types: {_supported_list()} (full attention only, no soft-capping, "
            "decoder-only); see docs/model-families.md."
        )


def describe_support(header: bool = True) -> str:
    """Markdown table of the supported families (for the README)."""
    lines = []
    if header:
        lines += ["| model_type | transformers class | notes |", "|---|---|---|"]
    for model_type, (cls, notes) in _FAMILIES.items():
        lines.append(f"| `{model_type}` | `{cls}` | {notes} |")
    return "\n".join(lines)
