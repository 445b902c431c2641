"""Which models hf-paged can run: accepted by what their attention does, refused naming the feature it cannot handle.

A model is supported when its attention goes through transformers' ``AttentionInterface`` with a ``Cache`` (it calls
``past_key_values.update(...)`` and hands the returned K/V unchanged to ``ALL_ATTENTION_FUNCTIONS``) and every
feature it uses is in :data:`HANDLED_FEATURES`. :func:`model_features` reads the features from the config and the
model's classes, without running anything, so :func:`check_supported` is cheap enough for every ``enable``. Its
run-time counterpart, ``hf_paged.capabilities.inspect_model``, records what one forward really passes to the
attention function; the architecture sweep (``tests/test_architectures.py``) checks over every causal LM of
transformers that this static gate refuses whatever the run-time probe sees outside :data:`HANDLED_FEATURES`.

Adding a feature to the kernels is one edit here: put its name into :data:`HANDLED_FEATURES`; the sweep then runs
the newly accepted architectures and compares their tokens with transformers.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

from ..cache import attention_shape, kv_layer_indices, layer_kv_shapes
from . import adapters
from .recurrent import is_mixer_class

__all__ = [
    "FEATURES",
    "HANDLED_FEATURES",
    "KERNEL_FEATURES",
    "check_supported",
    "describe_support",
    "writes_other_cache_layers",
    "model_features",
    "refusal",
]

# Every feature name the gate and the run-time probe report, with what it means (docs/models.md explains them).
FEATURES: dict[str, str] = {
    "full_attention": "causal softmax attention over the whole prefix",
    "gqa": "grouped-query / multi-query attention (fewer KV heads than query heads)",
    "scaling": "a softmax scale other than head_dim**-0.5 (taken from the `scaling` argument)",
    "head_dim": "a head size that is not hidden_size / num_heads",
    "mixture_of_experts": "mixture-of-experts MLPs (attention unchanged)",
    "final_logit_softcapping": "soft-capping of the final logits (outside attention)",
    "sliding_window": "sliding-window attention on some or all layers",
    "softcap": "attention-logit soft-capping",
    "sinks": "attention sinks (`s_aux`: per-head logits added to the softmax denominator)",
    "chunked_attention": "chunked (block-local) attention",
    "value_head_dim": "K and V of different head sizes (MiMo-V2-Flash; multi-head latent attention)",
    "per_layer_head_dim": "head sizes or KV heads that differ between layers (Gemma 4's global layers)",
    "mask_only_window": "a sliding window applied only through the model's mask, not passed to the attention function",
    "recurrent_state": "Mamba / linear-attention / convolution layers: each sequence's recurrent state in a slot",
    "unslotted_state": ("a recurrent state kept outside transformers' cache API (the model's own cache object or "
                        "module buffers), which hf-paged cannot give each sequence a slot of"),
    "sparse_attention": "learned sparse attention (an indexer picks the keys each query reads)",
    "latent_kv": "multi-head latent attention that caches a compressed latent and expands K/V after the cache",
    "kv_after_update": "K/V changed between Cache.update() and the attention function (the paged pool cannot be read)",
    "cache_layer_index": "attention writing a cache layer other than its own layer_idx (layers run several times)",
    "attention_mask_modified": "a mask or bias the model builds itself and hands to the attention function",
    "no_position_ids": "a model whose forward takes no position_ids (positions from the cache length)",
    "kv_sharing": "layers that read K/V another layer wrote",
    "alibi": "ALiBi position biases added to the attention logits",
    "encoder_decoder": "an encoder-decoder model",
    "cross_attention": "cross-attention to encoder states",
    "text_only_cross_attention": ("cross-attention layers to image states that the model skips in a text-only forward "
                                  "(Mllama): run text-only, they keep no K/V; a forward with images is refused"),
    "non_causal": "bidirectional (non-causal) attention",
    "not_interface_routed": "attention that does not go through transformers' AttentionInterface with a Cache",
    "attention_adapter": ("attention the model computes itself, routed to the paged attention by a per-family adapter "
                          "(hf_paged.attention.adapters)"),
    "unknown_attention_kwargs": "arguments to the attention function whose meaning hf-paged does not know",
    "cache_shape": ("K/V shapes that differ from what the config says (layers, KV heads, head size; "
                    "`hf_paged.cache.layer_kv_shapes`)"),
    "remote_code": "a trust_remote_code model class",
}

# What the paged kernels and attention function handle. When a kernel feature lands, add its name here: that is
# the only change needed for the gate, the sweep and the generated docs.
HANDLED_FEATURES: frozenset[str] = frozenset({
    "full_attention", "gqa", "scaling", "head_dim", "mixture_of_experts", "final_logit_softcapping",
    "sliding_window", "softcap", "sinks", "chunked_attention", "alibi",  # hf_paged.kernels: per-call options
    "value_head_dim", "per_layer_head_dim",  # hf_paged.cache.kv_pool: each layer shape its own tensors
    "kv_sharing",  # layers handed an earlier layer's pool views (hf_paged.cache.memory.kv_shared_sources)
    "text_only_cross_attention",  # hf_paged.cache.memory.cross_attention_layer_indices: no K/V, skipped
    "cache_layer_index",  # the pool keyed on the layer update() names (PagedCache.cache_layer_of); not compiled
    "recurrent_state",  # hf_paged.attention.recurrent + hf_paged.cache.state_pool: mixers of the cache API
    "attention_adapter",  # hf_paged.attention.adapters: families that compute attention themselves
})

# Attention features the kernels can be taught (issue 15): the report estimates what would pass with them handled.
KERNEL_FEATURES: frozenset[str] = frozenset({
    "sliding_window", "softcap", "sinks", "chunked_attention", "value_head_dim", "alibi",
})

# keyword arguments that change what attention computes and that the kernels do not take (a relative position bias):
# refused when a model's attention call passes them (other arguments are checked at run time: `capabilities`)
UNSUPPORTED_ATTENTION_KWARGS = frozenset({"position_bias"})
# keyword arguments of an attention call that change nothing the kernels compute, or that they take per call
KNOWN_ATTENTION_KWARGS = frozenset({
    "position_ids", "use_cache", "cache_position", "output_attentions", "position_embeddings", "is_causal",
    "layer_idx", "past_key_values", "head_mask", "token_type_ids", "attention_type", "return_dict",
    "output_hidden_states", "sequence_length", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
    "output_router_logits", "logits_to_keep", "dropout", "scaling", "attention_mask", "sliding_window", "softcap",
    "s_aux", "alibi_slopes", "cache_window",
    "indices",  # a sparse selection: taken by the attention function (`functions._sparse_paged_attention`)
})

_RECURRENT_LAYER_WORDS = ("linear", "mamba", "conv", "recurrent", "hybrid", "rwkv", "lstm", "deltanet")
_RECURRENT_CLASS_WORDS = ("Mamba", "Rwkv", "LinearAttention", "ShortConv", "GatedDeltaNet", "Recurrent", "LSTM",
                          "mLSTM", "sLSTM", "Lfm2ShortConv", "KimiDeltaAttention", "DeltaNet", "MiniMaxLightning")


# modules that give a model positions (rotary, learned or sinusoidal embeddings): a model with one needs position_ids
_POSITION_CLASS_WORDS = ("Rotary", "Positional", "PositionEmbedding")
_POSITION_MODULE_NAMES = ("wpe", "embed_positions", "position_embeddings", "rotary_emb")


def _recurrent_only(model, decoder, holds_mixer: set[int], attention_classes: set[str]) -> bool:
    """A pure recurrent model (Mamba, FalconMamba): recurrent mixers of the cache API, no attention module, no layer
    that keeps K/V and no module that gives positions. It needs no position_ids and routes nothing through the
    attention interface (an encoder-decoder that counts positions from the cache length has attention: refused)."""
    if not holds_mixer or attention_classes:
        return False
    try:
        if kv_layer_indices(_get_config(model)):
            return False
    except Exception:  # noqa: BLE001 - a config without layer counts: not one we can tell
        return False
    return not any(any(w in type(m).__name__ for w in _POSITION_CLASS_WORDS)
                   or name.rsplit(".", 1)[-1] in _POSITION_MODULE_NAMES for name, m in decoder.named_modules())


def _get_config(model_or_config):
    config = model_or_config
    if not hasattr(model_or_config, "model_type") and hasattr(model_or_config, "config"):
        config = model_or_config.config
    if not hasattr(config, "model_type"):
        raise TypeError(
            f"check_supported() expects a transformers PreTrainedModel or PretrainedConfig, got {type(model_or_config)!r}"
        )
    return config


def _attr(config, name):
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - some configs raise their own error for per-layer attributes
        return None


def _text_config(config):
    if hasattr(config, "get_text_config"):
        try:
            return config.get_text_config(decoder=True)
        except Exception:  # noqa: BLE001 - a composite config without a decoder text config
            return config
    return config


def _layer_types(config) -> list[str]:
    for name in ("layer_types", "layers_block_type", "block_types", "attention_layers"):
        value = _attr(config, name)
        if isinstance(value, (list, tuple)) and value:
            return [str(v) for v in value]
    return []


def _config_features(config) -> dict[str, str]:
    """Features visible in one (text) config."""
    found: dict[str, str] = {}
    try:
        attention_shape(config)
        shapes = {(s.kv_heads, s.key_dim) for s in layer_kv_shapes(config)}
    except ValueError:
        shapes = set()  # not a decoder config with attention sizes: other checks name what it is
    except Exception as error:  # noqa: BLE001 - a per-layer attribute error transformers raises
        shapes = set()
        if "per-layer" in str(error) or "per_layer" in str(error):
            found["per_layer_head_dim"] = f"{type(config).__name__}: {str(error).split('.')[0]}"
    if len(shapes) > 1:  # (Gemma 4: the global layers' head_dim and KV heads; MiMo-V2-Flash: sliding layers' heads)
        found["per_layer_head_dim"] = "(KV heads, head dim) per layer: " + ", ".join(f"{s}" for s in sorted(shapes))
    layer_types = _layer_types(config)
    window = _attr(config, "sliding_window")
    sliding = [i for i, t in enumerate(layer_types) if "sliding" in t or t in ("local", "window_attention")]
    if sliding:
        found["sliding_window"] = f"{len(sliding)} of {len(layer_types)} layers (sliding_window={window})"
    elif window is not None and not layer_types and not isinstance(window, bool):
        found["sliding_window"] = f"all layers (sliding_window={window})"
    max_pos = _attr(config, "max_position_embeddings")
    if "sliding_window" in found and isinstance(window, int) and isinstance(max_pos, int) and window >= max_pos:
        found["sliding_window"] += (f"; it is >= max_position_embeddings={max_pos}, so it never masks anything within "
                                    "the model's context: set config.sliding_window = None before loading")
    chunk = _attr(config, "attention_chunk_size")
    if chunk is not None or any("chunked" in t for t in layer_types):
        found["chunked_attention"] = f"attention_chunk_size={chunk}"
    softcap = _attr(config, "attn_logit_softcapping")
    if softcap is not None:
        found["softcap"] = f"attention logit soft-capping (attn_logit_softcapping={softcap})"
    if _attr(config, "final_logit_softcapping") is not None:
        found["final_logit_softcapping"] = f"final_logit_softcapping={config.final_logit_softcapping}"
    recurrent = sorted({t for t in layer_types if any(w in t for w in _RECURRENT_LAYER_WORDS)})
    if recurrent:
        found["recurrent_state"] = f"layer types {recurrent}"
    sparse = sorted({t for t in layer_types if "sparse" in t or "compressed" in t})
    if sparse or _attr(config, "index_topk") is not None or _attr(config, "indexer_n_heads") is not None:
        found["sparse_attention"] = f"layer types {sparse}" if sparse else "an indexer picks the keys"
    v_dim = _attr(config, "v_head_dim")
    qk_dim = _attr(config, "qk_head_dim") or (
        (_attr(config, "qk_nope_head_dim") or 0) + (_attr(config, "qk_rope_head_dim") or 0)) or _attr(config, "head_dim")
    if v_dim is not None and qk_dim and v_dim != qk_dim:
        found["value_head_dim"] = f"qk head dim {qk_dim} != v_head_dim {v_dim}"
    if _attr(config, "kv_lora_rank") is not None:
        found["latent_kv"] = (f"kv_lora_rank={config.kv_lora_rank}: the cache holds the compressed latent and the "
                              "model expands K/V from it after Cache.update()")
    if (_attr(config, "num_kv_shared_layers") or 0) > 0:
        found["kv_sharing"] = f"num_kv_shared_layers={config.num_kv_shared_layers}"
    if _attr(config, "alibi") or _attr(config, "use_alibi") or _attr(config, "position_embedding_type") == "alibi":
        found["alibi"] = "ALiBi position biases"
    attn_config = _attr(config, "attn_config")
    if attn_config is not None and (_attr(attn_config, "alibi") or (isinstance(attn_config, dict)
                                                                   and attn_config.get("alibi"))):
        found["alibi"] = "ALiBi position biases (attn_config.alibi)"
    if _attr(config, "is_encoder_decoder"):
        found["encoder_decoder"] = "is_encoder_decoder=True"
    if _attr(config, "add_cross_attention"):
        found["cross_attention"] = "add_cross_attention=True"
    if _attr(config, "cross_attention_layers"):  # (Mllama's text model skips them without image states)
        found["text_only_cross_attention"] = f"cross_attention_layers={config.cross_attention_layers}"
    # (`use_bidirectional_attention="vision"`, Gemma 4's default: image tokens attend both ways, text causally, as
    # Gemma 3's images; a text-only run is causal, and image inputs do not reach the paged generate())
    bidirectional = _attr(config, "use_bidirectional_attention")
    if _attr(config, "is_causal") is False or (bidirectional and bidirectional != "vision"):
        found["non_causal"] = (f"bidirectional attention (is_causal=False / use_bidirectional_attention="
                               f"{bidirectional!r})")
    num_experts = next((_attr(config, n) for n in ("num_experts", "num_local_experts", "n_routed_experts",
                                                   "moe_num_experts") if _attr(config, n)), None)
    if num_experts:
        found["mixture_of_experts"] = f"{num_experts} experts"
    scaling = _attr(config, "attention_multiplier") or _attr(config, "query_pre_attn_scalar")
    if scaling:
        found["scaling"] = f"{scaling}"
    return found


@functools.cache
def _forward_source(cls) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return None


def _routes_through_interface(cls) -> bool | None:
    """Does the `forward` of this attention class call transformers' AttentionInterface? None if unreadable."""
    source = _forward_source(cls)
    if source is None:
        return None
    return "ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source


@functools.cache
def _dataflow_features(cls) -> tuple[tuple[str, str], ...]:
    """Read the attention `forward` (ast): are the K/V handed to the attention function the ones `Cache.update()`
    returned, untouched; is the cache layer `self.layer_idx`; is the mask the model's own `attention_mask`?"""
    source = _forward_source(cls)
    if source is None:
        return ()
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ()
    updates, calls, assigned = [], [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            names = [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            assigned.append((node.lineno, names))
            value = node.value
            if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "update"
                    and len(node.targets) == 1 and isinstance(node.targets[0], ast.Tuple) and len(value.args) >= 3):
                updates.append((node.lineno, names, ast.unparse(value.args[2])))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and "attention" in node.func.id
                and len(node.args) >= 4 and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"):
            calls.append(node)
    if not updates or not calls:
        return ()
    found: dict[str, str] = {}
    line, names, index = updates[0]
    if index != "self.layer_idx":
        found["cache_layer_index"] = f"{cls.__name__} writes cache layer `{index}`, not its own layer_idx"
    for call in calls:
        k, v = (ast.unparse(a) for a in call.args[2:4])
        reassigned = {n for ln, ns in assigned if line < ln < call.lineno for n in ns}
        if [k, v] != names[:2] or {k, v} & reassigned:
            found["kv_after_update"] = f"{cls.__name__} passes `{k}`, `{v}`, not the K/V Cache.update() returned"
        mask = call.args[4] if len(call.args) > 4 else next(
            (kw.value for kw in call.keywords if kw.arg == "attention_mask"), None)
        mask_name = ast.unparse(mask) if mask is not None else None
        if mask_name not in (None, "None") and mask_name not in _model_mask_names(tree, call.lineno):
            builders = sorted({ast.unparse(c.func) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                               and node.lineno < call.lineno and mask_name in {ast.unparse(t) for t in node.targets}
                               for c in ast.walk(node.value) if isinstance(c, ast.Call)})
            built = f", built by {', '.join(f'`{b}`' for b in builders)}" if builders else ""
            found["attention_mask_modified"] = (f"{cls.__name__} passes `{mask_name}` as the mask{built} (its own "
                                                "bias/mask, not the model's attention_mask)")
        extra = sorted(kw.arg for kw in call.keywords if kw.arg in UNSUPPORTED_ATTENTION_KWARGS
                       and not (isinstance(kw.value, ast.Constant) and kw.value.value is None))
        if extra:
            found["unknown_attention_kwargs"] = f"{cls.__name__} passes {extra} to the attention function"
    return tuple(found.items())


def _model_mask_names(tree: ast.AST, before: int) -> set[str]:
    """Names that hold the model's own `attention_mask` argument at line `before`: the argument itself and names
    assigned only from it, by `or`, subscripts and `.get(...)` (Zaya picks its layer type's mask out of the mapping
    `attention_mask` is: `mask_mapping = attention_mask or {}; causal_mask = mask_mapping.get("causal")`). A name
    assigned from anything else (a bias built from the hidden states, Doge's dynamic mask) is not the model's mask.
    (`attention_mask` itself always counts, as it always did: GPT-2 reassigns it on its cross-attention branch only.)"""
    derived = {"attention_mask"}
    assignments = sorted((node for node in ast.walk(tree) if isinstance(node, ast.Assign) and node.lineno < before),
                         key=lambda node: node.lineno)
    for node in assignments:
        targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
        if len(targets) != len(node.targets):
            derived -= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            continue
        names = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
        calls_ok = all(isinstance(c.func, ast.Attribute) and c.func.attr == "get"
                       for c in ast.walk(node.value) if isinstance(c, ast.Call))
        if names and names <= derived and calls_ok:
            derived.update(targets)
        else:
            derived -= set(targets)
    return derived | {"attention_mask"}


def _kv_heads_written(module) -> int | None:
    """The KV heads an attention module with a separate `k_proj` writes (`k_proj` width / `head_dim`), if it says."""
    k_proj, head_dim = getattr(module, "k_proj", None), getattr(module, "head_dim", None)
    width = getattr(k_proj, "out_features", None)
    if not isinstance(width, int) or not isinstance(head_dim, int) or head_dim <= 0 or width % head_dim:
        return None
    return width // head_dim


def _unexpected_kv_heads(model, written: dict[int, tuple[int, str]]) -> list[str]:
    """`module: heads written (config: heads)` of the attention modules whose KV heads are not their layer's
    `layer_kv_shapes` (on a tensor-parallel rank: not the same share of it for every layer), all of them when the
    config's shapes cannot be read and the modules differ. Only layers that keep K/V count."""
    try:
        config = _get_config(model)
        expected = dict(zip(kv_layer_indices(config), (s.kv_heads for s in layer_kv_shapes(config))))
    except Exception:  # noqa: BLE001 - no per-layer shapes: differing heads are then unexpected
        expected = {}
    if expected:  # (modules at layers without K/V, a hybrid's recurrent mixers, write into no pool)
        written = {layer: entry for layer, entry in written.items() if layer in expected}
        shares = {expected[layer] / heads for layer, (heads, _) in written.items()}
        if len(shares) <= 1 and all(share >= 1 and share == int(share) for share in shares):
            return []
    elif len({heads for heads, _ in written.values()}) <= 1:
        return []
    return [f"{name}: {heads} (config: {expected.get(layer)})" for layer, (heads, name) in sorted(written.items())]


def _model_features(model) -> tuple[dict[str, str], frozenset[str]]:
    """Features visible in the model's modules (without running it), and the config features its attention adapters
    handle for it (`Adapter.handles`: a latent-attention model whose every attention module is adapted)."""
    found: dict[str, str] = {}
    attention_classes, recurrent_classes, not_routed, unslotted, adapted = set(), set(), set(), set(), set()
    adapter_handles: set[str] = set()
    attention_types: set[type] = set()
    written: dict[int, tuple[int, str]] = {}  # layer -> (KV heads its attention module writes, the module)
    try:  # composite models: only the decoder runs under hf-paged (a vision / audio tower keeps its own attention)
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    except Exception:  # noqa: BLE001 - models without a separable decoder
        decoder = model
    # (a leaf is no decoder stack: BERT-style heads call their output projection `decoder`, ModernBERT-decoder's too)
    decoder = decoder if hasattr(decoder, "named_modules") and next(decoder.children(), None) is not None else model
    holds_mixer = {id(m) for m in decoder.modules() if isinstance(getattr(m, "layer_idx", None), int)
                   and is_mixer_class(type(m))}
    for name, module in decoder.named_modules():
        cls = type(module)
        cls_name = cls.__name__
        if "encoder_attn" in name or "cross_attn" in name or cls_name.endswith("Layer"):
            continue  # cross-attention runs only with encoder states, which hf-paged does not take
        # (softmax attention that routes through the interface is none, even named so: RecurrentGemmaAttention)
        if (any(word in cls_name for word in _RECURRENT_CLASS_WORDS) and "Cache" not in cls_name
                and not ("Attention" in cls_name and _routes_through_interface(cls) is True)):
            recurrent_classes.add(cls_name)
            # a mixer of transformers' cache API gets its state slotted (`recurrent.install`); a module that keeps
            # state another way and sits at a layer (its own cache, buffers) cannot be
            if (not is_mixer_class(cls) and (hasattr(module, "layer_idx") or hasattr(module, "layer_id"))
                    and _routes_through_interface(cls) is not True  # (softmax attention named "...Linear...")
                    and not any(id(sub) in holds_mixer for sub in module.modules())):
                unslotted.add(cls_name)
        if hasattr(module, "sinks") and "sinks" in dict(module.named_parameters(recurse=False)):
            found["sinks"] = f"{cls_name}.sinks (attention sink logits, passed as s_aux)"
        if "Attention" in cls_name and getattr(module, "is_causal", True) is False:
            found["non_causal"] = f"{cls_name}.is_causal=False (bidirectional attention)"
        adapter = adapters.adapter_for(cls)
        if (("Attention" in cls_name and hasattr(module, "layer_idx")) or adapter) and cls_name not in recurrent_classes:
            attention_classes.add(cls_name)
            reason = adapters.refusal(module) if adapter is not None else None
            if adapter is not None and reason is None:  # routed by its adapter, which passes windows itself
                adapted.add(cls_name)
                adapter_handles.update(adapter.handles)
                continue
            attention_types.add(cls)
            heads = _kv_heads_written(module)
            if heads is not None and isinstance(getattr(module, "layer_idx", None), int):
                written.setdefault(module.layer_idx, (heads, name))
            if reason is not None:
                not_routed.add(f"{cls_name} ({adapter.family} adapter: {reason})")
            elif _routes_through_interface(cls) is False:
                not_routed.add(cls_name)
            for name, detail in _dataflow_features(cls):
                found.setdefault(name, detail)
    wrong = _unexpected_kv_heads(model, written)
    if wrong:  # the pool gives each layer the heads its config says (`layer_kv_shapes`); these write others
        found["cache_shape"] = "layers write KV heads their config does not say (" + ", ".join(wrong) + ")"
    if adapted:
        found["attention_adapter"] = f"{sorted(adapted)} routed by hf_paged.attention.adapters"
    if attention_types and not any("sliding_window" in (_forward_source(c) or "") for c in attention_types):
        text = _text_config(_get_config(model))
        if "sliding_window" in _config_features(text):
            found["mask_only_window"] = (f"{sorted(attention_classes)} never pass `sliding_window` to the attention "
                                         "function: the window lives in the model's mask only")
    if recurrent_classes:
        found.setdefault("recurrent_state", f"modules {sorted(recurrent_classes)}")
    if unslotted:
        found["unslotted_state"] = f"modules {sorted(unslotted)} keep their state outside the cache API"
    recurrent_only = _recurrent_only(model, decoder, holds_mixer, attention_classes)
    if not_routed:
        found["not_interface_routed"] = f"{sorted(not_routed)} compute attention themselves"
    elif not attention_classes and not recurrent_only:
        found["not_interface_routed"] = "no attention module with a layer_idx calls ALL_ATTENTION_FUNCTIONS"
    try:
        takes_positions = "position_ids" in inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        takes_positions = True
    handled = frozenset(adapter_handles) if adapted and not attention_types else frozenset()
    if not takes_positions and "no_position_ids" not in handled and not recurrent_only:
        found["no_position_ids"] = (f"{type(model).__name__}.forward takes no position_ids: positions come from the "
                                    "cache length, which a ragged continuous batch cannot give per sequence")
    remote = [c for c in type(model).__mro__ if (c.__module__ or "").startswith("transformers_modules")]
    if remote:
        found["remote_code"] = (f"the model class {type(model).__name__} is remote code ({remote[0].__module__}); "
                                "load it without trust_remote_code")
    return found, handled


def model_features(model_or_config) -> dict[str, str]:
    """`{feature: detail}` for a ``PreTrainedModel`` or ``PretrainedConfig``, from its config(s) and, for a model,
    its modules. Feature names are the keys of :data:`FEATURES`."""
    config = _get_config(model_or_config)
    found: dict[str, str] = {}
    text = _text_config(config)
    for cfg in (config, text) if text is not config else (config,):
        for name, detail in _config_features(cfg).items():
            found.setdefault(name, detail)
    if model_or_config is not config:
        modules, handled = _model_features(model_or_config)
        found = {name: detail for name, detail in found.items() if name not in handled}
        found.update(modules)
    return found


def writes_other_cache_layers(model) -> bool:
    """Whether an attention module of `model` writes a cache layer other than its own `layer_idx` (the feature
    `cache_layer_index`: Zamba, HRM). The paged attention finds the layer from the pool views `update()` returned;
    the compiled decode step's fused op (`compiled_op.fused_decode_attention`) writes the module's `layer_idx`, so
    such a model runs its decode steps eagerly (`hf_paged.engine.defaults.compile_decode_for`)."""
    return "cache_layer_index" in model_features(model)


def refusal(model_or_config, features: dict[str, str]) -> str | None:
    """The refusal message for these features (None when all are handled)."""
    unhandled = {k: v for k, v in features.items() if k not in HANDLED_FEATURES}
    if not unhandled:
        return None
    config = _get_config(model_or_config)
    model_type = getattr(config, "model_type", None) or "<none>"
    reasons = "; ".join(f"{name}: {FEATURES.get(name, name)} ({detail})" for name, detail in sorted(unhandled.items()))
    return (f"hf-paged cannot run this model ({model_type}): it uses feature(s) {sorted(unhandled)} that the paged "
            f"attention does not handle: {reasons}. Handled: {', '.join(sorted(HANDLED_FEATURES))}; see "
            "docs/models.md.")


def check_supported(model_or_config) -> None:
    """Raise ``ValueError`` naming every feature of this model (or config) outside :data:`HANDLED_FEATURES`.

    A config alone shows its attention features (windows, soft-capping, chunks, head sizes, recurrent layers,
    encoder-decoder, ...); a model also shows whether its attention modules call transformers' AttentionInterface,
    attention sinks and remote-code classes.
    """
    message = refusal(model_or_config, model_features(model_or_config))
    if message:
        raise ValueError(message)


def describe_support(header: bool = True) -> str:
    """Markdown table of the features hf-paged knows and whether the paged attention handles them."""
    lines = ["| feature | meaning | handled |", "|---|---|---|"] if header else []
    for name, meaning in FEATURES.items():
        lines.append(f"| `{name}` | {meaning} | {'yes' if name in HANDLED_FEATURES else 'refused'} |")
    return "\n".join(lines)
