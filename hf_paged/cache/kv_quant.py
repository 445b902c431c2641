"""FP8 KV caches: the `kv_cache_dtype` argument, and the scales a quantised pool is written and read with.

`kv_cache_dtype="fp8"` (or "fp8_e4m3") stores K and V as ``float8_e4m3fn``: one byte an element, half a bf16 pool's
bytes, so a memory budget holds twice the tokens (four times a float32 model's). "auto" (the default) stores them in
the model's dtype, as before. Each K/V layer has a key and a value scale (`KVScales`): a value ``x`` is stored as
``clamp(x / scale, -448, 448)`` in e4m3 (3 mantissa bits: about 3 % relative error, 2^-9 * scale absolute below
2^-6 * scale) and read as ``stored * scale`` by every kernel (`hf_paged.kernels`).

Where the scales come from, first match:

* the caller's `kv_scales`: one float for every layer (1.0 is vLLM's default when a checkpoint ships none), a
  mapping `{layer index: (k_scale, v_scale)}`, or a model or state dict that ships them;
* a checkpoint's (the engine looks in the model it serves): quantised checkpoints keep one scale per attention layer
  as ``...layers.N.self_attn.k_scale`` / ``v_scale`` (vLLM's FP8 KV format, compressed-tensors / llm-compressor's
  ``kv_cache_scheme``, Quark), ``...self_attn.kv_scale`` (one for both, older vLLM checkpoints), or
  ``...self_attn.k_proj.output_scale`` / ``v_proj.output_scale`` (AutoFP8); a scale may also hold one value per KV
  head. A model loaded with a quantizer that keeps them (compressed-tensors registers them on the attention modules)
  has them among its parameters or buffers;
* otherwise calibrated (`KVScales.calibrate`): from the first K/V each layer writes, ``amax / 224`` for keys and
  ``amax / 112`` for values (``amax``: the largest magnitude of the tokens written, one scale per layer, all heads).

Why calibrate rather than take 1.0: e4m3's relative precision is the same at every magnitude, but its range is not,
and a fixed 1.0 fits a model whose K/V it happens to fit. Values far below 2^-6 (small V entries) fall into the
subnormals and lose their precision, values above 448 saturate. The first prompt's magnitudes place each layer's
range; the headroom (2x for keys, 4x for values, vLLM's `calculate_kv_scales` constants 200 / 100 rounded to
448 / 2 and 448 / 4) covers later tokens, whose values may exceed the first prompt's (values vary more than keys,
which RoPE and the norms keep in a band). Measured on SmolLM2-135M (`docs/engine.md`): a fixed 1.0 keeps fewer greedy
tokens than calibration. Scales never change once a layer holds K/V: everything written since (prefix-cache blocks,
beams' shared blocks, swapped blocks) is read with the scales it was written with.

Calibration runs on the device (no host sync) in the eager write paths of a forward whose host-side slot mapping
writes at least one token (`StepMetadata.host_writes`; the warm-up's dummy forwards write nothing), once per layer;
until every layer has its scales the engine runs no step from a CUDA graph (`PagedCache.kv_scales_pending`), so
graphs never hold the calibration and replay the static scales after it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

__all__ = ["FP8_DTYPE", "KV_CACHE_DTYPES", "KVScales", "as_bytes", "resolve_kv_cache_dtype", "checkpoint_kv_scales"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
#: what a calibrated scale maps the first K / V magnitudes to (headroom 2x / 4x below FP8_MAX: see the docstring)
K_RANGE = FP8_MAX / 2
V_RANGE = FP8_MAX / 4

# a layer's scale in a checkpoint's parameter names: the layer number after `layers.` (`h.`, `blocks.`) and the name
_SCALE_NAME = re.compile(
    r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.(?:.*\.)?(k_scale|v_scale|kv_scale|k_proj\.output_scale|"
    r"v_proj\.output_scale)$")


def as_bytes(pool: torch.Tensor | None) -> torch.Tensor | None:
    """An FP8 pool as its bytes (`uint8`, a view), which every device's index kernels take (swaps index the pool);
    any other pool as it is."""
    return pool.view(torch.uint8) if pool is not None and pool.dtype == FP8_DTYPE else pool


def resolve_kv_cache_dtype(value, name: str = "kv_cache_dtype") -> torch.dtype | None:
    """The pool's storage dtype for `value`: None for "auto" (the model's dtype), ``torch.float8_e4m3fn`` for "fp8" /
    "fp8_e4m3" (or that dtype itself); a ValueError naming `name` for anything else."""
    if isinstance(value, torch.dtype):
        if value == FP8_DTYPE:
            return FP8_DTYPE
        raise ValueError(f"{name} must be 'auto', 'fp8' or 'fp8_e4m3' (or torch.float8_e4m3fn), got {value}")
    if not isinstance(value, str):
        raise ValueError(f"{name} must be 'auto', 'fp8' or 'fp8_e4m3', got {type(value).__name__} {value!r}")
    key = value.strip().lower()
    if key == "auto":
        return None
    if key in ("fp8", "fp8_e4m3", "float8_e4m3fn"):
        return FP8_DTYPE
    if key == "fp8_e5m2":
        raise ValueError(f"{name}='fp8_e5m2' is not supported: hf-paged stores FP8 K/V as e4m3 ('fp8' or 'fp8_e4m3')")
    raise ValueError(f"{name} must be one of {', '.join(repr(d) for d in KV_CACHE_DTYPES)}, got {value!r}")


def checkpoint_kv_scales(source) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """`{layer index: (k_scale, v_scale)}` (float32, one value or one per KV head) from a model's parameters and
    buffers or a state dict, by the names quantised checkpoints use (module docstring); `{}` when it has none.
    A layer with only one of the two gets 1.0 for the other (what vLLM does)."""
    if isinstance(source, torch.nn.Module):
        items = list(source.named_parameters()) + list(source.named_buffers())
    elif isinstance(source, Mapping):
        items = list(source.items())
    else:
        raise ValueError(f"kv_scales: expected a model or a state dict, got {type(source).__name__}")
    found: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in items:
        match = _SCALE_NAME.search(str(key))
        if match is None or not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            continue
        which = match.group(2).split(".")[0][0]  # "k", "v" (or "k" of "kv_scale": both)
        value = tensor.detach().float().reshape(-1).cpu()
        entry = found.setdefault(int(match.group(1)), {})
        if match.group(2) == "kv_scale":
            entry.setdefault("k", value)
            entry.setdefault("v", value)
        else:
            entry[which] = value
    one = torch.ones(1)
    return {layer: (entry.get("k", one), entry.get("v", one)) for layer, entry in sorted(found.items())}


def _per_layer(kv_scales, layers: list[int]) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], bool]:
    """(`{model layer: (k, v)}` of what the caller gave, whether the layers it does not cover are calibrated)."""
    if kv_scales is None or (isinstance(kv_scales, str) and kv_scales == "calibrate"):
        return {}, True
    if isinstance(kv_scales, bool) or isinstance(kv_scales, str):
        raise ValueError(f"kv_scales must be None, 'calibrate', a positive float, a mapping {{layer: (k_scale, "
                         f"v_scale)}}, a model or a state dict, got {kv_scales!r}")
    if isinstance(kv_scales, (int, float)):
        value = torch.tensor([float(kv_scales)])
        return {layer: (value, value) for layer in layers}, False
    if isinstance(kv_scales, Mapping) and all(isinstance(k, int) for k in kv_scales):
        out = {}
        for layer, pair in kv_scales.items():
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"kv_scales[{layer}] must be a (k_scale, v_scale) pair, got {pair!r}")
            out[layer] = tuple(torch.as_tensor(s, dtype=torch.float32).reshape(-1).cpu() for s in pair)
        return out, True
    found = checkpoint_kv_scales(kv_scales)
    if not found:
        raise ValueError("kv_scales: the model / state dict given holds no K/V scales (names ending in k_scale, "
                         "v_scale, kv_scale or k_proj.output_scale); pass None to calibrate them")
    return found, True


class KVScales:
    """The scales of an FP8 pool: `tensor [kv layers, 2, kv heads]` float32 on the pool's device (K at 0, V at 1; a
    per-layer scale repeated over the heads), and the layers still to calibrate (`pending`, their pool indices).

    `kv_scales` and `layers` (the model layer of each pool index) as `PagedCache` takes them; `num_kv_heads`: every
    layer's, or each one's (layers that differ in shape: the tensor holds the most, a layer uses its first ones);
    `values_are_keys`: per pool index, whether the layer's values are its keys (stored once, so read with the key
    scale: its value scale is kept equal to it). Scales with one value per head for another head count (a
    tensor-parallel rank's share) use their largest value, a scale that fits every head."""

    def __init__(self, kv_scales, layers: list[int], num_kv_heads: int | list[int], device: torch.device,
                 values_are_keys: list[bool] | None = None) -> None:
        given, calibrate_rest = _per_layer(kv_scales, layers)
        heads = [num_kv_heads] * len(layers) if isinstance(num_kv_heads, int) else list(num_kv_heads)
        self.heads = heads
        self.shared = {i for i, same in enumerate(values_are_keys or ()) if same}
        self.tensor = torch.ones((len(layers), 2, max(heads)), dtype=torch.float32, device=device)
        self.pending: set[int] = set()
        for index, layer in enumerate(layers):
            if layer not in given:
                if calibrate_rest:
                    self.pending.add(index)
                continue
            for kind, scale in enumerate(given[layer][:1] if index in self.shared else given[layer]):
                if scale.numel() not in (1, heads[index]):
                    scale = scale.max().reshape(1)
                if not bool((scale > 0).all()) or not bool(torch.isfinite(scale).all()):
                    raise ValueError(f"kv_scales: layer {layer}'s {'kv'[kind]}_scale must be positive and finite, "
                                     f"got {scale.tolist()}")
                self.tensor[index, kind, :heads[index]] = scale.to(device)
            if index in self.shared:
                self.tensor[index, 1] = self.tensor[index, 0]
        self.source = "calibrated" if len(self.pending) == len(layers) else "given" if not self.pending else "mixed"

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_scale, v_scale) of pool layer `index`, each `[its kv heads]` (views: set in place by calibration)."""
        heads = self.heads[index]
        return self.tensor[index, 0, :heads], self.tensor[index, 1, :heads]

    def calibrate(self, index: int, keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Set pool layer `index`'s scales from the tokens `keys`/`values [T, H, D]` that `slot_mapping` writes
        (slot >= 0), on the device; a layer whose tokens are all zero keeps 1.0. Once per layer."""
        if index not in self.pending:
            return
        self.pending.discard(index)
        written = (slot_mapping >= 0).reshape(-1, 1, 1)
        for kind, (x, span) in enumerate(((keys, K_RANGE), (values, V_RANGE))):
            amax = torch.where(written, x.abs(), 0).amax().float()
            self.tensor[index, kind] = torch.where(amax > 0, amax / span, torch.ones_like(amax))
        if index in self.shared:  # values are the keys, stored with the key scale
            self.tensor[index, 1] = self.tensor[index, 0]

    def __repr__(self) -> str:
        return f"KVScales(layers={self.tensor.shape[0]}, source={self.source!r}, pending={len(self.pending)})"
