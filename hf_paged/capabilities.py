"""What a model's attention really does, observed by running it: the run-time half of accepting models by capability.

`hf_paged.attention.support.check_supported` decides from the config and the model's classes (cheap, no forward:
it runs on every `enable`). This module checks that decision against the truth: :func:`inspect_model` registers a
*recording* attention function and mask function in transformers' `AttentionInterface` / `AttentionMaskInterface`,
runs one 4-token forward with a recording `DynamicCache`, and reports what arrived: whether attention is routed
through the interface at all, whether the K/V the function gets are exactly what `Cache.update()` returned, the
per-layer `sliding_window`, `softcap`, `s_aux` (sinks), `alibi_slopes`, `scaling`, head sizes (K vs V), and layers that keep a
recurrent state (Mamba / linear attention) or read K/V they did not write (shared-KV layers). The architecture sweep
(`tests/test_architectures.py`) asserts, for every architecture of transformers, that the static gate refuses a
model whenever the observed features include one outside :data:`~hf_paged.attention.support.HANDLED_FEATURES`.

The model is left as it was: its attention implementation is restored and the probe cache is thrown away.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .attention import adapters, recurrent
from .attention.recurrent import cache_argument
from .attention.support import HANDLED_FEATURES, KNOWN_ATTENTION_KWARGS, model_features, refusal

__all__ = ["Capabilities", "AttentionCall", "inspect_model", "check_supported", "PROBE_NAME"]

PROBE_NAME = "hf_paged_probe"
# kwargs every interface-routed family may pass and that carry no attention semantics of their own
# (recorded one by one; `cache_window`, Moshi's window of its cache, as its `sliding_window`)
_OPTION_KWARGS = frozenset({"sliding_window", "softcap", "s_aux", "alibi_slopes", "cache_window"})
_BENIGN_KWARGS = KNOWN_ATTENTION_KWARGS - _OPTION_KWARGS


@dataclass
class AttentionCall:
    """One call of the attention function, as it arrived."""

    module: str
    layer_idx: int | None
    query_shape: tuple[int, ...]
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]
    scaling: float | None
    sliding_window: int | None
    softcap: float | None
    has_sinks: bool
    has_alibi: bool
    causal: bool  # neither `is_causal=False` passed nor the module's `is_causal` attribute False
    from_cache_update: bool  # the key tensor is the one `Cache.update()` returned
    other_kwargs: tuple[str, ...]


@dataclass
class Capabilities:
    """What one forward of the model showed (see :func:`inspect_model`)."""

    model_type: str
    interface_routed: bool  # attention went through ALL_ATTENTION_FUNCTIONS with a Cache (every call)
    calls: list[AttentionCall] = field(default_factory=list)
    updated_layers: tuple[int, ...] = ()
    recurrent_layers: tuple[int, ...] = ()
    recurrent_only: bool = False  # every cache layer a recurrent one and no attention call (Mamba): nothing to route
    features: dict[str, str] = field(default_factory=dict)  # observed feature -> detail
    error: str | None = None  # the forward failed (with the probe function in place)

    @property
    def unhandled(self) -> dict[str, str]:
        return {k: v for k, v in self.features.items() if k not in HANDLED_FEATURES}


class _RecordingCache(DynamicCache):
    """A DynamicCache that remembers which tensors `update()` handed back, per layer.

    It stands for the `PagedCache` the model will run with, so adapted latent-attention layers store their latent in
    it as they do in the pool (`holds_latent_kv`, read by `hf_paged.attention.adapters.mla`)."""

    holds_latent_kv = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.returned: dict[int, int] = {}
        self.linear_states: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self.returned[layer_idx] = id(keys)
        return keys, values

    def get_linear_cache(self, layer_idx: int):
        """MiniMax's lightning attention keeps its state by these two calls (as in the paged cache's state slots)."""
        return self.linear_states.get(layer_idx)

    def set_linear_cache(self, layer_idx: int, linear_cache) -> None:
        self.linear_states[layer_idx] = linear_cache


_CALLS: list[tuple[AttentionCall, int]] = []


def _recording_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    sinks = kwargs.get("s_aux")
    call = AttentionCall(
        module=type(module).__name__,
        layer_idx=getattr(module, "layer_idx", None),
        query_shape=tuple(query.shape),
        key_shape=tuple(key.shape),
        value_shape=tuple(value.shape),
        scaling=None if scaling is None else float(scaling),
        sliding_window=kwargs.get("sliding_window") or kwargs.get("cache_window"),
        softcap=kwargs.get("softcap"),
        has_sinks=sinks is not None,
        has_alibi=kwargs.get("alibi_slopes") is not None,
        causal=kwargs.get("is_causal") is not False and getattr(module, "is_causal", True) is not False,
        from_cache_update=False,
        other_kwargs=tuple(sorted(k for k, v in kwargs.items()
                                  if k not in _BENIGN_KWARGS | _OPTION_KWARGS
                                  and v is not None)),
    )
    _CALLS.append((call, id(key)))
    # compute with transformers' own eager-equivalent path so the forward goes on (sinks / softcap / ALiBi dropped:
    # the numbers do not matter here, only what arrived)
    groups = getattr(module, "num_key_value_groups", 1)
    if value.shape[-1] != query.shape[-1] or key.shape[1] != value.shape[1] or key.shape[1] * groups != query.shape[1]:
        return _plain_attention(query, key, value, scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=scaling,
                                  is_causal=kwargs.get("is_causal"))


def _plain_attention(query, key, value, scaling):
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    weights = torch.softmax(query @ key.transpose(-1, -2) * (scaling or query.shape[-1] ** -0.5), dim=-1)
    return (weights @ value).transpose(1, 2).contiguous(), None


def _probe_mask(*args, **kwargs):
    """transformers' SDPA mask, always as a tensor (some families' code uses it as one: MPT)."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _register_probe() -> None:
    AttentionInterface.register(PROBE_NAME, _recording_attention)
    AttentionMaskInterface.register(PROBE_NAME, _probe_mask)
    adapters.route_through(PROBE_NAME)


@contextlib.contextmanager
def _probe_attention(model):
    """The probe's attention and mask functions in place for one forward; a family that computes attention itself
    gets its attention adapters (`hf_paged.attention.adapters`) for it, so the probe sees what they pass."""
    before = model.config._attn_implementation
    sub_before = {id(m.config): m.config._attn_implementation for m in model.modules()
                  if hasattr(m, "config") and hasattr(m.config, "_attn_implementation")}
    _register_probe()
    had_adapters = any("_hf_paged_adapter" in m.__dict__ for m in model.modules())
    adapters.install(model)
    # (the recurrent families' hooks too: MiniMax's model takes the recording cache as it takes a PagedCache)
    had_recurrent = any("_hf_paged_forward" in m.__dict__ or "_hf_paged_family_hook" in m.__dict__
                        for m in model.modules())
    recurrent.install(model)
    adapters.switch_implementation(model, PROBE_NAME)
    try:
        yield
    finally:
        adapters.switch_implementation(model, before)
        if not had_adapters:
            adapters.uninstall(model)
        if not had_recurrent:
            recurrent.uninstall(model)
        for module in model.modules():  # sub-models the top-level switch did not reach back
            config = getattr(module, "config", None)
            if config is not None and id(config) in sub_before:
                config._attn_implementation_internal = sub_before[id(config)]


def _observed_features(caps: Capabilities, text_config) -> dict[str, str]:
    features: dict[str, str] = {}
    calls = caps.calls
    if not caps.interface_routed and not caps.recurrent_only:
        features["not_interface_routed"] = (
            "no attention call went through transformers' AttentionInterface with a Cache" if not calls else
            "some attention calls got K/V that Cache.update() did not return (K/V expanded from cached latents, "
            "cross-attention or shared-KV layers)")
    windows = sorted({(c.layer_idx, c.sliding_window) for c in calls if c.sliding_window is not None},
                     key=lambda t: (t[0] is None, t[0] or 0))
    if windows:
        features["sliding_window"] = ", ".join(f"layer {i}: {w}" for i, w in windows)
    softcaps = {c.softcap for c in calls if c.softcap is not None}
    if softcaps:
        features["softcap"] = ", ".join(str(s) for s in sorted(softcaps))
    if any(not c.causal for c in calls):
        features["non_causal"] = "is_causal=False (bidirectional attention)"
    if any(c.has_sinks for c in calls):
        features["sinks"] = "s_aux passed (per-head attention sink logits)"
    if any(c.has_alibi for c in calls):
        features["alibi"] = "alibi_slopes passed (ALiBi position biases)"
    if any(c.value_shape[-1] != c.query_shape[-1] for c in calls):
        c = next(c for c in calls if c.value_shape[-1] != c.query_shape[-1])
        features["value_head_dim"] = f"K head dim {c.key_shape[-1]} != V head dim {c.value_shape[-1]}"
    extra = sorted({k for c in calls for k in c.other_kwargs})
    if extra:
        features["unknown_attention_kwargs"] = ", ".join(extra)
    if caps.recurrent_layers:
        features["recurrent_state"] = f"layers {list(caps.recurrent_layers)} keep a Mamba / linear-attention state"
    if calls:
        features["full_attention"] = f"{len(calls)} attention layers"
        heads = {(c.query_shape[1], c.key_shape[1]) for c in calls}
        if any(q != k for q, k in heads):
            features["gqa"] = ", ".join(f"{q} query / {k} KV heads" for q, k in sorted(heads))
        scalings = sorted({c.scaling for c in calls if c.scaling is not None})
        if scalings:
            features["scaling"] = ", ".join(f"{s:.4g}" for s in scalings)
        features["head_dim"] = ", ".join(str(d) for d in sorted({c.query_shape[-1] for c in calls}))
    return features


def inspect_model(model, num_tokens: int = 4) -> Capabilities:
    """Run one `num_tokens`-token forward of `model` (batch 1) with a recording attention function and cache."""
    config = model.config
    text_config = config.get_text_config(decoder=True)
    caps = Capabilities(model_type=getattr(config, "model_type", "?"), interface_routed=False)
    vocab = int(getattr(text_config, "vocab_size", 0) or 0)
    device = next(model.parameters()).device
    input_ids = (torch.arange(num_tokens, device=device) % max(vocab - 3, 1) + 3)[None]
    cache = _RecordingCache(config=config)
    _CALLS.clear()
    try:
        with _probe_attention(model), torch.no_grad():
            # (under the name the model takes it: `cache_params` for Mamba, which ignores `past_key_values`)
            model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=True,
                  **{cache_argument(model): cache})
    except Exception as error:  # noqa: BLE001 - reported, the caller decides
        caps.error = f"{type(error).__name__}: {error}"[:300]
    for call, key_id in _CALLS:
        # its own layer's update, or an earlier layer's whose K/V it reads unchanged (Gemma 3n / 4 KV sharing)
        # (a module without a layer of its own, Zamba's shared attention block, passes its cache layer to update())
        call.from_cache_update = key_id in cache.returned.values()
        caps.calls.append(call)
    _CALLS.clear()
    caps.updated_layers = tuple(sorted(cache.returned))
    caps.recurrent_layers = tuple(
        i for i, layer in enumerate(getattr(cache, "layers", []))
        if "LinearAttention" in type(layer).__name__
    )
    caps.interface_routed = bool(caps.calls) and all(c.from_cache_update for c in caps.calls)
    layers = getattr(cache, "layers", [])
    caps.recurrent_only = not caps.calls and bool(layers) and len(caps.recurrent_layers) == len(layers)
    caps.features = _observed_features(caps, text_config)
    return caps


def check_supported(model, probe: bool = True) -> Capabilities | None:
    """Raise ``ValueError`` naming every unhandled feature, from the config and classes (always) and from one
    recorded forward (`probe=True`); returns the observed capabilities (None without `probe`)."""
    static = model_features(model)
    caps = inspect_model(model) if probe else None
    found = dict(static)
    if caps is not None:
        for name, detail in caps.features.items():
            found.setdefault(name, detail)
    message = refusal(model, found)
    if message:
        raise ValueError(message)
    return caps
