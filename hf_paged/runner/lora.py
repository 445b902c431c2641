"""LoRA adapters per request: the wrapped linears, their stacked adapter pools and each step's token -> slot index.

The model keeps running transformers' own code. Each linear an adapter targets (``q_proj``, ``v_proj``, ...) is
replaced in its parent by a `LoraLinear`, which computes ``base(x) + delta`` where ``delta`` is every token's own
adapter's ``scale * B(A(x))`` (`hf_paged.kernels.lora`: Punica's BGMV in Triton on CUDA, a dense masked form in
torch elsewhere). Its adapter weights live in a pool of `max_loras` slots, ``A [max_loras, r_max, in]`` and
``B [max_loras, out, r_max]``, zero padded to the largest rank, the scale folded into ``B``. A slot a module's adapter
does not target stays zero there.

`LoraSlots.step(sched)` (the runner enters it around every forward) writes each token's slot into one int32 device
buffer whose address never changes, so CUDA graphs and the compiled step read it as any other step input; the
padding rows of a bucket and the tokens without an adapter read -1. After the forward the rows it wrote are set back
to -1, so a forward of the same model outside the engine (or through another engine) computes no delta.

Why the pools are plain attributes, not buffers: loading an adapter into a slot is an in-place copy, and the engine's
`WeightWatch` would take it for a weight change and drop the prefix cache; the cache keys carry the adapter's id
instead (`hf_paged.core.block_pool.salted_root`). `load_adapter` reads a PEFT adapter directory (``adapter_config.json``
and ``adapter_model.safetensors``) without PEFT.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from ..core import SchedulerOutput
from ..kernels import lora as lora_kernels

__all__ = ["LoraLinear", "LoraSlots", "LoraWeights", "load_adapter"]

_UNSUPPORTED = (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D layers)"))


@torch.library.custom_op("hf_paged::lora_delta", mutates_args=())
def lora_delta_op(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`hf_paged.kernels.lora.lora_delta` as one opaque op: the compiled step traces around it, not into Triton."""
    return lora_kernels.lora_delta(x, a, b, index)


@lora_delta_op.register_fake
def _(x, a, b, index):
    return x.new_empty((x.shape[0], b.shape[1]))


@dataclass
class LoraWeights:
    """One PEFT LoRA adapter, read from its directory: per module name (as in the model), ``(A [r, in], B [out, r],
    scale)``, on the CPU."""

    path: str
    rank: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]


def _pattern_value(patterns: dict, name: str, default):
    """PEFT's `alpha_pattern` / `rank_pattern` rule: the first key matching the end of the module name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def load_adapter(path: str) -> LoraWeights:
    """Read the PEFT LoRA adapter saved in directory `path` (`save_pretrained`); a ValueError naming what is not
    supported (DoRA, bias training, `modules_to_save`, embedding adapters, another PEFT method)."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise ValueError(f"path must be a PEFT adapter directory, got {path!r}")
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"path {path!r} has no readable adapter_config.json: {error}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {path!r} is a {config.get('peft_type')} adapter; only LoRA is supported")
    for key, what in _UNSUPPORTED:
        if config.get(key):
            raise ValueError(f"adapter {path!r} uses {what}, which is not supported")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise ValueError(f"adapter {path!r} trains biases or whole modules (bias / modules_to_save): not supported")
    file = os.path.join(path, "adapter_model.safetensors")
    if os.path.exists(file):
        state = load_file(file)
    elif os.path.exists(os.path.join(path, "adapter_model.bin")):
        state = torch.load(os.path.join(path, "adapter_model.bin"), map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"path {path!r} has no adapter_model.safetensors")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if match is None or tensor.dim() != 2:
            raise ValueError(f"adapter {path!r} has a weight this engine cannot apply: {key}")
        pairs.setdefault(match.group(1), {})[match.group(2)] = tensor
    modules, top = {}, 0
    alpha, rslora = config.get("lora_alpha", 8), bool(config.get("use_rslora"))
    for name, ab in pairs.items():
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != ab["B"].shape[1]:
            raise ValueError(f"adapter {path!r}: module {name} needs lora_A [r, in] and lora_B [out, r]")
        rank = ab["A"].shape[0]
        a_value = _pattern_value(config.get("alpha_pattern"), name, alpha)
        scale = a_value / math.sqrt(rank) if rslora else a_value / rank
        modules[name] = (ab["A"], ab["B"], float(scale))
        top = max(top, rank)
    if not modules:
        raise ValueError(f"adapter {path!r} holds no LoRA weights")
    return LoraWeights(str(path), top, modules)


class LoraLinear(torch.nn.Module):
    """A linear plus the LoRA delta of each token's adapter slot (see the module docstring). `base` stays the
    model's own module; `weight` / `bias` / `in_features` / `out_features` read through to it."""

    def __init__(self, base: torch.nn.Linear, slots: int, rank: int, index: torch.Tensor) -> None:
        super().__init__()
        self.base = base
        weight = base.weight
        self.lora_a = torch.zeros((slots, rank, weight.shape[1]), dtype=weight.dtype, device=weight.device)
        self.lora_b = torch.zeros((slots, weight.shape[0], rank), dtype=weight.dtype, device=weight.device)
        self.lora_index = index

    weight = property(lambda self: self.base.weight)
    bias = property(lambda self: self.base.bias)
    in_features = property(lambda self: self.base.in_features)
    out_features = property(lambda self: self.base.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        tokens = x.numel() // x.shape[-1]
        if tokens > self.lora_index.shape[0]:  # not one of this engine's steps (another engine's): no adapter
            return y
        delta = lora_delta_op(x.reshape(tokens, x.shape[-1]), self.lora_a, self.lora_b, self.lora_index[:tokens])
        return y + delta.view(y.shape)

    def load(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor, float] | None) -> None:
        """Put an adapter's `(A, B, scale)` of this module into `slot` (None: zeros, the module not targeted)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if weights is not None:
            a, b, scale = weights
            self.lora_a[slot, : a.shape[0]].copy_(a)
            self.lora_b[slot, :, : b.shape[1]].copy_(b.to(torch.float32) * scale)


class LoraSlots:
    """The runner's side of the adapters: the wrapped modules, the pools' slots and the per-token index buffer.

    `slots_for` (set by the engine, `hf_paged.engine.lora`) maps the adapter ids of a step's items (None: no
    adapter) to their slots, loading adapters that are not resident."""

    def __init__(self, max_loras: int, max_rank: int, max_tokens: int, device: torch.device) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.index = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._hosts = [torch.full((max_tokens,), -1, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.modules: dict[str, LoraLinear] = {}
        self.slots_for: Callable[[list], list[int]] | None = None

    def wrap(self, model: torch.nn.Module, names: list[str]) -> int:
        """Replace the linears `names` of `model` not wrapped yet by `LoraLinear`s; returns how many were."""
        wrapped = 0
        for name in names:
            if name in self.modules:
                continue
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            module = self.modules[name] = LoraLinear(getattr(parent, child), self.max_loras, self.max_rank,
                                                     self.index)
            setattr(parent, child, module)
            wrapped += 1
        return wrapped

    def unwrap(self, model: torch.nn.Module) -> None:
        """Give the model back its own linears (the engine is closing)."""
        for name, module in self.modules.items():
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            if getattr(parent, child, None) is module:
                setattr(parent, child, module.base)
        self.modules.clear()

    def load(self, slot: int, weights: LoraWeights) -> None:
        """Copy `weights` into `slot` of every wrapped module (zeros where the adapter targets none)."""
        with torch.no_grad():
            for name, module in self.modules.items():
                module.load(slot, weights.modules.get(name))

    @contextmanager
    def step(self, sched: SchedulerOutput) -> Iterator[None]:
        """Around one forward of `sched`: each token's slot in `index` for its duration (see the module docstring)."""
        if self.slots_for is None or not self.modules:
            yield
            return
        items = sched.scheduled
        slots = self.slots_for([item.group.data.get("lora") for item in items])
        tokens = sum(item.num_tokens for item in items)
        if all(s < 0 for s in slots):
            yield
            return
        if tokens > self.index.shape[0]:
            raise RuntimeError(f"a step of {tokens} tokens exceeds the LoRA index buffer ({self.index.shape[0]})")
        self._hosts.reverse()  # two host buffers: a pipelined step fills one while the other's copy may be pending
        host = self._hosts[0].numpy()
        if tokens == len(items):  # one token an item (a decode step): one copy of the list
            host[:tokens] = slots
        else:
            at = 0
            for item, slot in zip(items, slots):
                host[at : at + item.num_tokens] = slot
                at += item.num_tokens
        self.index[:tokens].copy_(self._hosts[0][:tokens], non_blocking=True)
        try:
            yield
        finally:
            self.index[:tokens].fill_(-1)
