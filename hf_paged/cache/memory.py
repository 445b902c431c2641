"""KV memory arithmetic: parsing sizes such as "2GiB", and the bytes one token's K/V take for a model config.

Used by `PagedCache` to size its pool and by the engine and benchmarks; no state.
"""

from __future__ import annotations

import numbers
import os
import re

import torch

__all__ = ["parse_memory", "memory_fraction", "pool_budget", "cpu_pool_memory", "check_pool_arguments", "kv_bytes_per_token", "attention_heads", "attention_shape",
           "latent_kv_width",
           "kv_layer_indices"]

# layer types (transformers' normalised `config.layer_types`) whose layer keeps no K/V: a recurrent mixer (its state
# lives in `hf_paged.cache.state_pool`) or no token mixer at all (Nemotron-H's MoE and MLP layers)
_NO_KV_LAYER_TYPES = frozenset({"linear_attention", "conv", "moe", "mlp", "mamba", "recurrent"})


def parse_memory(value: int | float | str | None, name: str) -> int | None:
    """Parse `"2GiB"`, `"512MB"`, `"1.5G"` or a byte count into bytes; ValueError naming `name` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a byte count or a string such as '2GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a byte count or a string such as '2GiB', got {type(value).__name__}")
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)\s*", value, flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"{name} must look like '2GiB', '512MB' or a byte count, got {value!r}")
    number, unit, suffix = float(match.group(1)), match.group(2).upper(), match.group(3).lower()
    base = 1024 if (suffix.startswith("i") or suffix == "") else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit]
    size = int(number * base**power)
    if size <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return size


def memory_fraction(value, name: str = "gpu_memory_utilization") -> float:
    """`value` as a fraction in (0, 1]: a real number (a numpy scalar too), never a bool or a string, so that "0.9"
    is refused at the argument rather than accepted by one entry point and refused by another."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    fraction = float(value)
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {fraction}")
    return fraction


_DEFAULT_CPU_KV_MEMORY = 512 * 1024**2  # modest: a 135M model keeps ~11k fp32 tokens in it
_CUDA_ACTIVATION_RESERVE = 1024**3


def check_pool_arguments(block_size, num_blocks, dtype) -> None:
    """`PagedCache`'s `block_size` (a power of two), `num_blocks` (None or positive) and `dtype` (None or a dtype)."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise TypeError(f"block_size must be a positive int, got {block_size!r}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if num_blocks is not None and (not isinstance(num_blocks, int) or isinstance(num_blocks, bool)):
        raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
    if num_blocks is not None and num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")


def cpu_pool_memory() -> int:
    """Bytes a CPU pool may take: $HF_PAGED_CPU_KV_MEMORY, 512 MiB by default."""
    return int(os.environ.get("HF_PAGED_CPU_KV_MEMORY", _DEFAULT_CPU_KV_MEMORY))


def pool_budget(device: torch.device, utilization: float) -> int:
    """Bytes a `PagedCache` sized automatically may take on `device`: `utilization` of the free CUDA memory less 1 GiB
    for activations, or `cpu_pool_memory()`."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * utilization) - _CUDA_ACTIVATION_RESERVE
    return cpu_pool_memory()


def _text(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def latent_kv_width(config) -> int | None:
    """The width of one token's latent of a multi-head latent attention config (`kv_lora_rank + qk_rope_head_dim`:
    576 for DeepSeek-V2/V3), which its layers store as one KV head (`hf_paged.attention.adapters.mla`); None for
    other configs."""
    text = _text(config)
    rank = getattr(text, "kv_lora_rank", None)
    if not isinstance(rank, int) or isinstance(rank, bool):
        return None
    return rank + int(getattr(text, "qk_rope_head_dim", None) or 0)


def attention_heads(config) -> tuple[int, int]:
    """(num_heads, num_kv_heads) of a decoder config (whole model, before any tensor-parallel split), whatever the
    family calls them (a latent-attention config: one KV head, the latent)."""
    text = _text(config)
    # encoder-decoder families used as causal LMs (BartForCausalLM, ...): their decoder's sizes, which
    # num_attention_heads (mapped to the encoder's) need not equal
    num_heads = getattr(text, "decoder_attention_heads", None) or getattr(text, "num_attention_heads", None)
    if num_heads is None:
        raise ValueError("config must define num_hidden_layers and num_attention_heads")
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    if getattr(text, "decoder_attention_heads", None):  # multi-head decoders; num_key_value_heads maps to the encoder
        num_kv_heads = num_heads
    if latent_kv_width(config) is not None:  # multi-head latent attention: every query head reads the one latent
        num_kv_heads = 1
    elif getattr(text, "new_decoder_architecture", False) is True:  # Falcon-40B/180B: grouped K/V, multi_query ignored
        num_kv_heads = getattr(text, "num_kv_heads", None) or num_kv_heads
    elif getattr(text, "multi_query", False) is True:  # GPT-BigCode, Falcon-7B: one KV head
        num_kv_heads = 1
    return int(num_heads), int(num_kv_heads)


def attention_shape(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder config, whatever the family calls them (a latent-attention
    config: 1 KV head of `latent_kv_width`)."""
    text = _text(config)
    num_layers = getattr(text, "decoder_layers", None) or getattr(text, "num_hidden_layers", None)
    if num_layers is None:
        raise ValueError("config must define num_hidden_layers and num_attention_heads")
    num_heads, num_kv_heads = attention_heads(config)
    head_dim = latent_kv_width(config) or getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return int(num_layers), num_kv_heads, int(head_dim)


def kv_layer_indices(config) -> list[int]:
    """The indices of the layers that keep K/V (every layer but the recurrent and MLP-only layers of a hybrid model's
    `layer_types`; all of them for a model without layer types)."""
    text = _text(config)
    num_layers = getattr(text, "decoder_layers", None) or getattr(text, "num_hidden_layers", None)
    layer_types = getattr(text, "layer_types", None)
    if not isinstance(layer_types, (list, tuple)) or num_layers is None or len(layer_types) != num_layers:
        return list(range(int(num_layers or 0)))
    return [i for i, kind in enumerate(layer_types) if str(kind) not in _NO_KV_LAYER_TYPES]


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V for one token over all layers that keep K/V."""
    _, num_kv_heads, head_dim = attention_shape(config)
    return 2 * len(kv_layer_indices(config)) * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
