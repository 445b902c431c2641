"""A tiny seeded random model of every architecture in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``.

Why: hf-paged accepts models by what their attention does, not by name, so the architecture sweep
(``tests/test_architectures.py``, ``benchmarks/probe_architectures.py``) must instantiate *every* causal-LM class of
the installed transformers. Writing 178 configs by hand would rot at the next release; instead :func:`tiny_config`
shrinks each family's default config generically (every size-like attribute it has, in the config and in each of its
sub-configs, is set to a small value) and :data:`OVERRIDES` fixes the few families whose configs need more.

Sizes: hidden 64, 4 query heads and 2 KV heads (head_dim 16), 2 layers (more only when the family's default
``layer_types`` need them to show every layer type, e.g. Gemma 3's 5 sliding : 1 full), vocab 256, intermediate
128, 4 experts (2 per token), sliding windows and attention chunks of 4 tokens (so that they really mask something in
the sweep's short sequences). Special tokens are pad/bos/eos = 0/1/2. Everything is seeded; nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import copy
import signal
import threading

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .attention import HANDLED_FEATURES, model_features
from .attention.recurrent import cache_argument
from .cache import PagedCache
from .capabilities import inspect_model
from .integrations.generate import disable, enable

__all__ = [
    "ARCHITECTURES", "OVERRIDES", "PAD_ID", "UNBUILDABLE", "TimeLimitExceeded", "check_architecture", "time_limit",
    "tiny_config", "tiny_inputs", "tiny_model",
]

ARCHITECTURES: tuple[str, ...] = tuple(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VOCAB = 256
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128
LAYERS = 2
MAX_LAYERS = 8
WINDOW = 4
EXPERTS = 4

# attribute name -> small value; applied to a config (and each sub-config) only where the default config has it
_SIZES: dict[str, object] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "hidden_dim", "n_embed"), HIDDEN),
    **dict.fromkeys(("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers"), LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), KV_HEADS),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "d_ff", "ffn_hidden_size", "decoder_ffn_dim"), INTERMEDIATE),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
                     "moe_ffn_hidden_size", "intermediate_size_mlp"), 32),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "moe_k"), 2),
    "expert_ffn_hidden_size": 32,
    # linear-attention layers (Qwen3.5 / Qwen3-Next / Kimi-Linear): 32 value heads of 128 by default; two value heads
    # per key head keep the grouped repeat
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": HEADS,
    "linear_head_dim": 16,
    "emb_dim": HIDDEN,
    # per-layer input embeddings (Gemma 3n / 4): 262,144 x (layers x 256) by default, seconds of initialisation alone
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
    "head_dim": HEAD_DIM,
    "rotary_dim": 8,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "n_ctx": 256,
    "initializer_range": 0.2,
    "sliding_window": WINDOW,
    "attention_chunk_size": WINDOW,
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}
# dropout-like attributes are zeroed (the sweep compares greedy tokens; eval mode makes most of them moot anyway)
_DROPOUTS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout",
             "attention_probs_dropout_prob", "hidden_dropout_prob", "activation_dropout")

# Families whose configs the generic shrink cannot satisfy: extra constructor kwargs (merged over the shrink).
OVERRIDES: dict[str, dict] = {
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=WINDOW),
    "recurrent_gemma": dict(num_hidden_layers=3, lru_width=HIDDEN, attention_window_size=WINDOW),
    "zamba": dict(num_hidden_layers=4, layer_types=["linear_attention", "hybrid"] * 2, attn_layer_period=2, attn_layer_offset=1, attention_hidden_size=2 * HIDDEN,
                  attention_head_dim=2 * HIDDEN // HEADS, mamba_dt_rank=8),
    "reformer": dict(is_decoder=True),
    # (one image cross-attention layer within the tiny stack, which a text-only run skips)
    "mllama": dict(text_config=dict(num_hidden_layers=3, cross_attention_layers=[1])),
    "zaya": dict(num_experts_per_tok=1),
    # Moshi's checkpoints: a window as long as the context (3000 = 3000); a shorter one is refused (adapters.moshi)
    "moshi": dict(sliding_window=256, max_position_embeddings=256),
    "qwen4_exp": dict(text_config=dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                                       indexer_compress_ratio=2)),
    "lfm2": dict(layer_types=["conv", "full_attention"]),  # the default config has no conv layer; checkpoints do
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], mamba_n_heads=4, mamba_d_head=32,
                             mamba_d_state=16, mamba_chunk_size=16, shared_intermediate_size=64),
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16),
    "blt": dict(encoder_hash_byte_group_vocab=64),
    "gemma3n_text": dict(num_kv_shared_layers=0, laurel_rank=8),
    "prophetnet": dict(num_encoder_layers=LAYERS, num_decoder_layers=LAYERS),
    "falcon_h1": dict(mamba_d_ssm=128, mamba_n_heads=4, mamba_d_state=16, mamba_chunk_size=16),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
                  mamba_d_state=16, mamba_dt_rank=8),
    "mamba2": dict(head_dim=32, state_size=16, chunk_size=16),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=2),
}
# Families the zoo cannot build as a stand-alone causal LM, and why (listed by the sweep as not runnable).
UNBUILDABLE: dict[str, str] = {
    "musicgen": "MusicgenForCausalLM is the decoder of a text-to-music encoder-decoder: its config needs "
                "text_encoder and audio_encoder sub-configs (pretrained T5 / EnCodec)",
    "musicgen_melody": "MusicgenMelodyForCausalLM is the decoder of a text-to-music encoder-decoder: its config needs "
                       "text_encoder and audio_encoder sub-configs",
    "gemma3n": "Gemma3nForConditionalGeneration builds a timm vision tower, which needs pillow and timm (not "
               "installed); its text model is covered by gemma3n_text",
}


def _layer_count(default_types) -> int:
    """Enough layers to show every layer type of the family's default pattern (at least 2, at most MAX_LAYERS)."""
    if not default_types:
        return LAYERS
    kinds = {str(t) for t in default_types}
    seen: set = set()
    for i, layer_type in enumerate(default_types):
        seen.add(str(layer_type))
        if seen == kinds:
            return max(LAYERS, min(i + 1, MAX_LAYERS))
    return LAYERS


def _get(config, name):
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - e.g. Gemma 4's per-layer attributes raise their own error class
        return None


def _settable(config, name) -> bool:
    attr = getattr(type(config), name, None)
    return not isinstance(attr, property) and (name in config.__dict__ or hasattr(type(config), name))


def _shrink(config: PretrainedConfig) -> dict:
    """Constructor kwargs that shrink `config` (a default instance) to the zoo's sizes."""
    kwargs: dict = {}
    for name, value in _SIZES.items():
        if not _settable(config, name):
            continue
        current = _get(config, name)
        if name in ("sliding_window", "attention_chunk_size") and current is None:
            continue  # off by default: keep it off
        if isinstance(current, (list, tuple)) and name.endswith("token_id"):
            value = [value]
        if isinstance(current, bool) or (current is not None and not isinstance(current, (int, float, list))):
            continue
        if isinstance(current, list) and not name.endswith("token_id"):
            continue  # per-layer lists are cut below
        kwargs[name] = value
    if "is_decoder" in vars(config):  # encoder families (BERT, RoBERTa, ...) as causal LMs: their decoder mode
        kwargs["is_decoder"] = True
    for name in _DROPOUTS:
        if isinstance(_get(config, name), float):
            kwargs[name] = 0.0
    if _settable(config, "qk_rope_head_dim"):  # multi-head latent attention (DeepSeek V2/V3 and descendants)
        # K has one head per query head (the latent is expanded per head): no GQA grouping
        kwargs.update(qk_rope_head_dim=8, qk_nope_head_dim=8, head_dim=8, num_key_value_heads=HEADS)
        for name, value in (("v_head_dim", 8), ("kv_lora_rank", 16), ("qk_head_dim", 16)):
            if _settable(config, name):
                kwargs[name] = value
        if _get(config, "q_lora_rank") is not None:
            kwargs["q_lora_rank"] = 24
    for name in ("n_shared_experts", "n_group", "topk_group", "first_k_dense_replace", "num_dense_layers"):
        if _settable(config, name):
            kwargs[name] = 1
    layers = _get(config, "num_hidden_layers") or _get(config, "num_layers")
    default_types = _get(config, "layer_types")
    n = LAYERS
    if isinstance(default_types, (list, tuple)) and default_types and _settable(config, "layer_types"):
        n = _layer_count(default_types)
        kwargs["layer_types"] = list(default_types[:n])
    for name in ("num_hidden_layers", "num_layers", "n_layer", "n_layers"):
        if name in kwargs:
            kwargs[name] = n
    # every other per-layer list of the default config is cut to the zoo's layer count
    for name, current in list(vars(config).items()):
        if (isinstance(current, list) and layers and len(current) == layers and name != "layer_types"
                and _settable(config, name) and not name.startswith("_")):
            cut = current[:n]
            kwargs[name] = [INTERMEDIATE if isinstance(v, int) and v > 1024 else v for v in cut]
    return kwargs


def tiny_config(model_type: str, **overrides) -> PretrainedConfig:
    """The zoo's tiny config of `model_type` (a key of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``); `overrides` win.

    Composite configs (a text config inside a multimodal one) have every sub-config shrunk the same way.
    """
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"unknown model_type {model_type!r}")
    if model_type in UNBUILDABLE:
        raise ValueError(f"the zoo cannot build {model_type!r}: {UNBUILDABLE[model_type]}")
    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    kwargs = _shrink(default)
    for name, sub_class in (getattr(config_class, "sub_configs", {}) or {}).items():
        sub = getattr(default, name, None)
        if sub is None and isinstance(sub_class, type) and issubclass(sub_class, PretrainedConfig):
            try:
                sub = sub_class()
            except Exception:  # noqa: BLE001 - a sub-config without defaults stays unset
                sub = None
        if isinstance(sub, PretrainedConfig):
            kwargs[name] = _shrink(sub)
    for extra in (copy.deepcopy(OVERRIDES.get(model_type, {})), overrides):
        for name, value in extra.items():
            if isinstance(value, dict) and isinstance(kwargs.get(name), dict):
                kwargs[name] = {**kwargs[name], **value}  # a sub-config: merge over its shrunk kwargs
            else:
                kwargs[name] = value
    return config_class(**kwargs)


def _jitter_constants(model: torch.nn.Module, generator: torch.Generator, std: float = 0.1) -> None:
    """Biases start at 0 and norm weights at 1 (or 0): jitter every constant tensor so they all matter."""
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() > 1 and param.dtype.is_floating_point and bool((param == param.flatten()[0]).all()):
                param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * std)


def tiny_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> PreTrainedModel:
    """A seeded random model of `model_type`'s causal-LM class, in eval mode, with sdpa attention (or eager where
    the family has no sdpa path)."""
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    except ValueError as error:
        if "scaled_dot_product_attention" not in str(error) and "sdpa" not in str(error).lower():
            raise
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    if hasattr(model, "set_default_language"):  # X-MOD: language adapters need a language
        model.set_default_language(config.default_language or next(iter(config.languages)))
    _jitter_constants(model, torch.Generator().manual_seed(seed + 1))
    return model.eval()


def tiny_inputs(lengths: tuple[int, ...] = (6, 4), seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch (`input_ids`, `attention_mask`) of random tokens in [3, VOCAB) with the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length:] = torch.randint(3, VOCAB, (length,), generator=generator)
        attention_mask[row, width - length:] = 1
    return input_ids, attention_mask


# ---------------------------------------------------------------------------------------------------------------------
# one architecture through the sweep (tests/test_architectures.py, benchmarks/probe_architectures.py)

NEW_TOKENS = 4
_POOL_BLOCKS, _BLOCK_SIZE = 16, 4  # a small pool (default sizing zero-fills far more than the sweep needs)


class TimeLimitExceeded(Exception):
    """Raised by `time_limit` when its time is up."""


@contextlib.contextmanager
def time_limit(seconds: int):
    """Raise `TimeLimitExceeded` after `seconds` (0: no limit; main thread only, elsewhere no limit): one hung
    architecture must not stall the sweep, one stuck system a benchmark run."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(*_):
        raise TimeLimitExceeded(f"over {seconds} s")

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _short(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:240]


def _greedy(model, input_ids, attention_mask, **kwargs) -> torch.Tensor:
    out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False, pad_token_id=PAD_ID, eos_token_id=None, **kwargs)
    return out[:, input_ids.shape[1]:]


def check_architecture(model_type: str, timeout_s: int = 60, compare: bool = True, **overrides) -> dict:
    """Run `model_type` through the sweep and return its record (the rows of docs/architectures.json):

    * ``runs_under_transformers`` (and ``reason`` when not): the tiny model's greedy `generate()` with transformers'
      own attention and DynamicCache on a left-padded batch of 2;
    * ``interface_routed``, ``observed`` (run-time features, `hf_paged.capabilities.inspect_model`) and ``features``
      (the static gate's, `hf_paged.attention.support.model_features`);
    * ``verdict``: ``pass`` (accepted; greedy tokens of `generate(cache_implementation="paged")` and of the drop-in
      `PagedCache` equal transformers'), ``refused`` (`enable` raised a ValueError naming every unhandled feature),
      ``not_runnable`` (transformers itself fails), or a failure: ``mismatch``, ``crash``, ``gate_missed`` (the probe saw
      an unhandled feature the gate let through), ``bad_refusal``.

    `overrides` go to :func:`tiny_config` (a variant of the family's tiny model, e.g. Falcon's
    ``new_decoder_architecture=True``).
    """
    record: dict = {"model_type": model_type, "class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type),
                    "runs_under_transformers": False, "interface_routed": None, "features": {}, "observed": {},
                    "unhandled": [], "verdict": "not_runnable", "reason": ""}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: worker threads only spin, and slow down badly on a loaded machine
    try:
        with time_limit(timeout_s):
            _check(model_type, record, compare, overrides)
    except TimeLimitExceeded as error:  # a hang under transformers: not runnable; under hf-paged: a failure
        record["verdict"] = "crash" if record["runs_under_transformers"] else "not_runnable"
        record["reason"] = f"timed out ({error}) at stage {record.get('stage', '?')}"
    finally:
        torch.set_num_threads(threads)
    record.pop("stage", None)
    return record


def _check(model_type: str, record: dict, compare: bool, overrides: dict) -> None:
    record["stage"] = "build"
    try:
        model = tiny_model(model_type, **overrides)
    except Exception as error:  # noqa: BLE001 - recorded
        record["reason"] = f"the tiny config does not build: {_short(error)}"
        return
    # the family's own generation defaults (forced BOS/EOS, no-repeat n-grams, ...) are not what the sweep compares
    model.generation_config = GenerationConfig(pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    attn_implementation = model.config._attn_implementation
    input_ids, attention_mask = tiny_inputs()
    record["stage"] = "transformers"
    try:
        with torch.no_grad():
            reference = _greedy(model, input_ids, attention_mask)
    except Exception as error:  # noqa: BLE001 - recorded
        record["reason"] = f"transformers' own generate() fails on the tiny model: {_short(error)}"
        return
    record["runs_under_transformers"] = True
    record["stage"] = "probe"
    record["features"] = model_features(model)
    caps = inspect_model(model)
    # (a pure recurrent model has no attention to route: every call it makes is one of the cache API)
    record["interface_routed"] = caps.interface_routed or caps.recurrent_only
    record["observed"] = dict(caps.features)
    if caps.error:
        record["observed"]["probe_error"] = caps.error
    static_unhandled = sorted(k for k in record["features"] if k not in HANDLED_FEATURES)
    observed_unhandled = sorted(k for k in caps.features if k not in HANDLED_FEATURES)
    record["unhandled"] = sorted(set(static_unhandled) | set(observed_unhandled))
    record["stage"] = "enable"
    try:
        enable(model, num_blocks=_POOL_BLOCKS, block_size=_BLOCK_SIZE)
    except ValueError as error:
        message = str(error)
        missing = [k for k in static_unhandled if k not in message]
        record["verdict"] = "bad_refusal" if missing or not static_unhandled else "refused"
        record["reason"] = message if not missing else f"refusal does not name {missing}: {message}"
        return
    except Exception as error:  # noqa: BLE001 - recorded
        record["verdict"], record["reason"] = "crash", f"enable() crashed: {_short(error)}"
        return
    if observed_unhandled or caps.error:
        record["verdict"] = "gate_missed"
        record["reason"] = (f"accepted, but one forward showed {observed_unhandled}" if observed_unhandled
                            else f"accepted, but the probe forward failed: {caps.error}")
        disable(model, attn_implementation)
        return
    if not compare:
        record["verdict"], record["reason"] = "accepted", ""
        disable(model, attn_implementation)
        return
    record["stage"] = "paged"
    try:
        with torch.no_grad():
            paged = _greedy(model, input_ids, attention_mask, cache_implementation="paged")
            cache = PagedCache(config=model.config, num_blocks=_POOL_BLOCKS, block_size=_BLOCK_SIZE)
            # (under the name the model takes its cache: `cache_params` for Mamba)
            dropin = _greedy(model, input_ids, attention_mask, **{cache_argument(model): cache})
    except Exception as error:  # noqa: BLE001 - recorded
        record["verdict"], record["reason"] = "crash", f"paged generate crashed: {_short(error)}"
        return
    finally:
        disable(model, attn_implementation)
    if torch.equal(paged, reference) and torch.equal(dropin, reference):
        record["verdict"], record["reason"] = "pass", ""
    else:
        record["verdict"] = "mismatch"
        record["reason"] = (f"transformers {reference.tolist()} vs generate(paged) {paged.tolist()} vs "
                            f"PagedCache {dropin.tolist()}")
