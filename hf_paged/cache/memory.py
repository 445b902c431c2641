"""KV memory arithmetic: parsing sizes such as "2GiB", and the bytes one token's K/V take for a model config.

Used by `PagedCache` to size its pool and by the engine and benchmarks; no state.
"""

from __future__ import annotations

import numbers
import os
import re

import torch

from .kv_pool import KVShape

__all__ = ["parse_memory", "memory_fraction", "pool_budget", "cpu_pool_memory", "check_pool_arguments",
           "kv_bytes_per_token", "attention_heads", "indexer_key_dims", "attention_shape",
           "cross_attention_layer_indices", "kv_layer_indices", "latent_kv_width", "layer_kv_shapes", "kv_shared_sources",
           "num_decoder_layers", "BLOCKLESS_POOL_BLOCKS"]

# layer types (transformers' normalised `config.layer_types`) whose layer keeps no K/V: a recurrent mixer (its state
# lives in `hf_paged.cache.state_pool`) or no token mixer at all (Nemotron-H's MoE and MLP layers)
_NO_KV_LAYER_TYPES = frozenset({"linear_attention", "conv", "moe", "mlp", "mamba", "recurrent"})
# families whose sliding-window layers write more KV heads than `num_key_value_heads` says, a fact of their modeling
# code, not of their config (MiMo-V2-Flash: `num_key_value_heads * 2` on its sliding layers)
_SLIDING_KV_HEAD_FACTOR = {"mimo_v2_flash": 2}
# families whose attention adapter stores KV heads `h` and `h + kv_heads / 2` side by side as one head of twice the
# width (DiffLlama: `hf_paged.attention.adapters.diffllama`, whose two attention calls pair those heads' values)
_PAIRED_KV_HEADS = frozenset({"diffllama"})


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


# blocks of a pool without K/V layers (a pure recurrent model: Mamba, FalconMamba), whose blocks cost no memory and
# only count tokens for the block manager (scheduling, prefix-cache keys): 1M tokens of 16-token blocks
BLOCKLESS_POOL_BLOCKS = 1 << 16
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
    family calls them (of the first layer that keeps K/V, where layers differ: Gemma 4; a latent-attention config: one
    KV head, the latent)."""
    text = _text(config)
    if getattr(text, "is_heterogeneous", False):  # per-layer attributes: transformers raises on the global ones
        text = text.per_layer_config[kv_layer_indices(config)[0]]
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
    """(num_layers, num_kv_heads, head_dim) of a decoder config, whatever the family calls them (of its first layer
    that keeps K/V where layers differ: `layer_kv_shapes` gives each one's; a latent-attention config: 1 KV head of
    `latent_kv_width`)."""
    text = _text(config)
    num_layers = num_decoder_layers(config)
    if num_layers is None:
        raise ValueError("config must define num_hidden_layers and num_attention_heads")
    if getattr(text, "is_heterogeneous", False):  # Gemma 4: `head_dim` etc. are per layer (transformers raises)
        first = layer_kv_shapes(config)[0]
        return int(num_layers), first.kv_heads, first.key_dim
    num_heads, num_kv_heads = attention_heads(config)
    head_dim = latent_kv_width(config) or getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return int(num_layers), num_kv_heads, int(head_dim)


def num_decoder_layers(config) -> int | None:
    """The decoder's layer count (`decoder_layers` or `num_hidden_layers`), None when the config says neither."""
    text = _text(config)
    num_layers = getattr(text, "decoder_layers", None) or getattr(text, "num_hidden_layers", None)
    return None if num_layers is None else int(num_layers)


def _layer_config(text, layer: int):
    """Layer `layer`'s config of a heterogeneous config (transformers' `per_layer_config`), else the config itself."""
    return text.per_layer_config[layer] if getattr(text, "is_heterogeneous", False) else text


def indexer_key_dims(config) -> dict[int, int]:
    """`{layer: index_head_dim}` of the layers whose sparse-attention indexer keeps keys (`index_topk` and
    `index_head_dim` set: DeepSeek-V3.2, GLM-5, HY-V4, A.X K2; `indexer_budget` and `indexer_head_dim`: Qwen4-Exp's
    attention layers); a layer whose `indexer_types` entry is "shared" reuses an earlier layer's selection and keeps
    none. Empty for every other config."""
    text = _text(config)
    dim, topk = getattr(text, "index_head_dim", None), getattr(text, "index_topk", None)
    if not isinstance(dim, int):  # Qwen4-Exp's sparse attention: one raw index key a token (`adapters.qsa`)
        dim, topk = getattr(text, "indexer_head_dim", None), getattr(text, "indexer_budget", None)
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1 or not isinstance(topk, int):
        return {}
    types = list(getattr(text, "indexer_types", None) or ())
    return {layer: dim for layer in kv_layer_indices(config)
            if not (layer < len(types) and types[layer] == "shared")}


def layer_kv_shapes(config) -> list[KVShape]:
    """The `KVShape` of every layer that keeps K/V (`kv_layer_indices` order), as the config says (whole model,
    before any tensor-parallel split).

    * multi-head latent attention (`kv_lora_rank` set: DeepSeek V2/V3, Kimi, ...): one head of
      ``kv_lora_rank + qk_rope_head_dim`` whose values are its keys (the latent, stored once), and the indexer keys
      of a sparse-attention layer (`indexer_key_dims`);
    * per-layer head sizes and KV heads (transformers' `per_layer_config`: Gemma 4's global layers);
    * a value width of its own (`v_head_dim`: MiMo-V2-Flash), and the sliding layers' KV heads of the families whose
      modeling code multiplies them (`_SLIDING_KV_HEAD_FACTOR`);
    * half the KV heads at twice the width where the family's adapter pairs them (`_PAIRED_KV_HEADS`: DiffLlama).
    """
    text = _text(config)
    layers = kv_layer_indices(config)
    if not layers:  # a pure recurrent model (Mamba): no attention sizes to read
        return []
    rank = getattr(text, "kv_lora_rank", None)
    if isinstance(rank, int) and rank > 0:
        width = rank + int(getattr(text, "qk_rope_head_dim", None) or 0)
        index_dims = indexer_key_dims(config)
        return [KVShape(1, width, width, values_are_keys=True, index_dim=index_dims.get(layer, 0)) for layer in layers]
    heterogeneous = getattr(text, "is_heterogeneous", False)
    index_dims = indexer_key_dims(config)
    if not heterogeneous:
        _, kv_heads, head_dim = attention_shape(config)
    layer_types = getattr(text, "layer_types", None) or ()
    factor = _SLIDING_KV_HEAD_FACTOR.get(getattr(text, "model_type", None), 1)
    shapes = []
    for layer in layers:
        if heterogeneous:
            own = _layer_config(text, layer)
            heads = int(getattr(own, "num_key_value_heads", None) or own.num_attention_heads)
            key_dim = int(getattr(own, "head_dim", None) or own.hidden_size // own.num_attention_heads)
        else:
            own, heads, key_dim = text, kv_heads, head_dim
        value_dim = getattr(own, "v_head_dim", None)
        value_dim = int(value_dim) if isinstance(value_dim, int) and value_dim > 0 else key_dim
        if factor > 1 and layer < len(layer_types) and "sliding" in str(layer_types[layer]):
            heads *= factor
        if getattr(text, "model_type", None) in _PAIRED_KV_HEADS and heads % 2 == 0:
            heads, key_dim, value_dim = heads // 2, key_dim * 2, value_dim * 2
        shapes.append(KVShape(heads, key_dim, value_dim, index_dim=index_dims.get(layer, 0)))
    return shapes


def kv_layer_indices(config) -> list[int]:
    """The indices of the layers that keep K/V (every layer but the recurrent and MLP-only layers of a hybrid model's
    `layer_types`; all of them for a model without layer types)."""
    text = _text(config)
    num_layers = getattr(text, "decoder_layers", None) or getattr(text, "num_hidden_layers", None)
    # (RecurrentGemma names them `layers_block_type` only: "recurrent" and "attention")
    layer_types = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None)
    # Gemma 3n / 4: the last `num_kv_shared_layers` layers read the K/V of an earlier layer and write none
    shared = getattr(text, "num_kv_shared_layers", None)
    end = int(num_layers or 0) - (shared if isinstance(shared, int) and 0 < shared < (num_layers or 0) else 0)
    cross = set(cross_attention_layer_indices(config))  # (Mllama: they attend to image states, cached apart)
    if not isinstance(layer_types, (list, tuple)) or num_layers is None or len(layer_types) != num_layers:
        return [i for i in range(end) if i not in cross]
    return [i for i, kind in enumerate(layer_types[:end]) if str(kind) not in _NO_KV_LAYER_TYPES and i not in cross]


def cross_attention_layer_indices(config) -> list[int]:
    """The layers of a decoder config's `cross_attention_layers` (Mllama's text model: they cross-attend to image
    states instead of self-attending, and the model skips them in a forward without image states and nothing cached
    for them). They keep no K/V of the paged cache: hf-paged runs such a model text-only (`PagedCache.update` refuses
    a write to them with a ValueError)."""
    layers = getattr(_text(config), "cross_attention_layers", None)
    return [int(i) for i in layers] if isinstance(layers, (list, tuple)) else []


def kv_shared_sources(config) -> dict[int, int]:
    """`{layer: the layer whose K/V it reads}` of the last `num_kv_shared_layers` layers (Gemma 3n, Gemma 4): each
    reads the K/V of the last earlier layer of its type, which its modeling code hands it (the pool's views, as that
    layer's `Cache.update` returned them); it writes none and has no blocks of its own (`kv_layer_indices`)."""
    text = _text(config)
    shared = getattr(text, "num_kv_shared_layers", None)
    layer_types = list(getattr(text, "layer_types", None) or ())
    num_layers = len(layer_types)
    if not isinstance(shared, int) or not 0 < shared < num_layers:
        return {}
    first = num_layers - shared
    earlier = layer_types[:first]
    return {layer: first - 1 - earlier[::-1].index(layer_types[layer]) for layer in range(first, num_layers)
            if layer_types[layer] in earlier}


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V for one token over all layers that keep K/V, each layer its own shape (`layer_kv_shapes`)."""
    elements = sum(shape.elements_per_token for shape in layer_kv_shapes(config))
    return elements * torch.empty((), dtype=dtype).element_size()


def pool_kv_shapes(config, num_kv_layers: int, num_kv_heads: int | None, head_dim: int | None,
                   kv_shapes: list[KVShape] | None) -> list[KVShape]:
    """The shape of each of a `PagedCache`'s `num_kv_layers` pool layers, from the first of these that says it:

    * `kv_shapes` (one `KVShape` per pool layer, given by the caller: e.g. an adapter that knows what it writes);
    * `config` (`layer_kv_shapes`), with `num_kv_heads` / `head_dim` overriding it: on a model whose layers share
      one shape they replace it; where layers differ, `num_kv_heads` is the first layer's heads on one
      tensor-parallel rank and every layer's heads are split alike (`head_dim` cannot be overridden there);
    * `num_kv_heads` and `head_dim` alone (no config): every layer alike.
    """
    if num_kv_layers == 0:  # a pure recurrent model: a pool of bookkeeping blocks only
        return []
    if kv_shapes is not None:
        shapes = list(kv_shapes)
        if len(shapes) != num_kv_layers or not all(isinstance(s, KVShape) for s in shapes):
            raise ValueError(f"kv_shapes must hold one KVShape per K/V layer ({num_kv_layers}), got {kv_shapes!r}")
        return shapes
    if config is None:
        return [KVShape(int(num_kv_heads), int(head_dim), int(head_dim))] * num_kv_layers
    shapes = layer_kv_shapes(config)
    if len(shapes) != num_kv_layers:  # a layer count overridden (`num_layers`): the first layer's shape for all
        shapes = shapes[:1] * num_kv_layers
    if len(set(shapes)) == 1:
        first = shapes[0]
        heads = first.kv_heads if num_kv_heads is None else int(num_kv_heads)
        key_dim = first.key_dim if head_dim is None else int(head_dim)
        value_dim = key_dim if first.value_dim == first.key_dim else first.value_dim
        return [KVShape(heads, key_dim, value_dim, first.values_are_keys, first.index_dim)] * len(shapes)
    if head_dim is not None:
        raise ValueError("head_dim cannot be overridden for a model whose layers differ in shape; pass kv_shapes")
    if num_kv_heads is not None and num_kv_heads != shapes[0].kv_heads:
        if num_kv_heads < 1 or shapes[0].kv_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} is no share of the first layer's {shapes[0].kv_heads} "
                             "KV heads")
        shapes = [s.split_heads(shapes[0].kv_heads // num_kv_heads) for s in shapes]
    return shapes
