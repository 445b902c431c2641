"""`StatePool`: the recurrent layers' states (convolution windows, SSM / delta-rule matrices) of every sequence, by slot.

Hybrid models (Qwen3.5, Granite 4, Falcon-H1, LFM2, Jamba, ...) keep, beside the K/V of their attention layers, a
fixed-size state per sequence in each recurrent layer. transformers' own cache holds it per batch row
(`LinearAttentionLayer.conv_states` / `.recurrent_states`, one tensor per layer and state index); here each such
tensor becomes one tensor of ``[slots, *state shape]`` and a sequence owns one slot of all of them
(`hf_paged.core.state_slots` decides which). The mixer adapter (`hf_paged.attention.recurrent`) gathers a step's slots
before the layer's own code runs and scatters them back after it.

A state is named by a `StateKey` ``(layer_idx, kind, state_idx)``, ``kind`` being ``"conv"`` or ``"recurrent"``, and has
a `StateSpec` (shape without the batch dimension, dtype). The engine learns the specs up front
(`hf_paged.attention.recurrent_profile.profile_state_specs`) to size its memory; the drop-in cache learns them from the first
forward and grows its slots with the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import SlotOps

__all__ = ["StateKey", "StatePool", "StateSpec"]

StateKey = tuple[int, str, int]  # (layer_idx, "conv" | "recurrent", state_idx)


@dataclass(frozen=True)
class StateSpec:
    """One recurrent state of one layer: its shape without the batch dimension, and its dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


class StatePool:
    """Per-slot tensors of every recurrent state of a model, on the device, with a pinned CPU copy for swapping.

    Args:
        num_slots: device slots in all (sequence slots, checkpoint slots and the scratch slot of
            `hf_paged.core.StateSlots`: ``num_slots + num_checkpoints + 1``).
        device: where the states live.
        specs: the states to allocate now; more can be added later (`ensure`, the drop-in cache's first forward).
        num_cpu_slots: slots of the CPU swap copy (0: none).
    """

    def __init__(self, num_slots: int, device: torch.device, specs: dict[StateKey, StateSpec] | None = None,
                 num_cpu_slots: int = 0) -> None:
        self.num_slots = int(num_slots)
        self.num_cpu_slots = int(num_cpu_slots)
        self.device = torch.device(device)
        self.specs: dict[StateKey, StateSpec] = {}
        self.tensors: dict[StateKey, torch.Tensor] = {}
        self.cpu: dict[StateKey, torch.Tensor] = {}
        for key, spec in (specs or {}).items():
            self._allocate(key, spec)

    def __repr__(self) -> str:
        return (f"StatePool(slots={self.num_slots}, states={len(self.specs)}, "
                f"bytes_per_slot={self.bytes_per_slot()}, cpu_slots={self.num_cpu_slots})")

    @staticmethod
    def spec_bytes(specs: dict[StateKey, StateSpec]) -> int:
        """Bytes one slot takes in every state of `specs`."""
        return sum(spec.nbytes for spec in specs.values())

    def bytes_per_slot(self) -> int:
        return self.spec_bytes(self.specs)

    def layers(self) -> set[int]:
        return {key[0] for key in self.specs}

    def _allocate(self, key: StateKey, spec: StateSpec) -> None:
        self.specs[key] = spec
        self.tensors[key] = torch.zeros((self.num_slots, *spec.shape), dtype=spec.dtype, device=self.device)
        if self.num_cpu_slots:
            self.cpu[key] = torch.zeros((self.num_cpu_slots, *spec.shape), dtype=spec.dtype,
                                        pin_memory=self.device.type == "cuda")

    def ensure(self, key: StateKey, example: torch.Tensor) -> torch.Tensor:
        """The tensor of `key`, created from `example` (``[batch, *shape]``) the first time it is seen."""
        tensor = self.tensors.get(key)
        if tensor is None:
            self._allocate(key, StateSpec(tuple(example.shape[1:]), example.dtype))
            tensor = self.tensors[key]
        elif tuple(example.shape[1:]) != tuple(tensor.shape[1:]):
            raise ValueError(f"recurrent state {key} changed shape: {tuple(example.shape[1:])} against the pool's "
                             f"{tuple(tensor.shape[1:])}")
        return tensor

    def grow(self, num_slots: int) -> None:
        """More device slots (the drop-in cache's batch grew): the states are copied, slot ids stay."""
        if num_slots <= self.num_slots:
            return
        for key, old in self.tensors.items():
            new = torch.zeros((num_slots, *old.shape[1:]), dtype=old.dtype, device=old.device)
            new[: self.num_slots].copy_(old)
            self.tensors[key] = new
        self.num_slots = num_slots

    def release(self) -> None:
        """Free the memory now (a closing engine)."""
        self.tensors = {}
        self.cpu = {}

    # ------------------------------------------------------------------ slot operations
    def apply(self, ops: SlotOps) -> None:
        """Apply the slot operations decided between two forwards (order: `hf_paged.core.state_slots`)."""
        if not ops:
            return
        dev = self.device
        if ops.swap_out:
            zero_cpu = [cpu for gpu, cpu in ops.swap_out if gpu < 0]
            pairs = [(gpu, cpu) for gpu, cpu in ops.swap_out if gpu >= 0]
            for key, tensor in self.tensors.items():
                if pairs:
                    src = torch.tensor([g for g, _ in pairs], device=dev)
                    self.cpu[key][[c for _, c in pairs]] = tensor.index_select(0, src).to("cpu")
                if zero_cpu:
                    self.cpu[key][zero_cpu] = 0
        gathered = {}
        if ops.copies:
            src = torch.tensor([s for s, _ in ops.copies], device=dev)
            gathered = {key: tensor.index_select(0, src) for key, tensor in self.tensors.items()}
        if ops.copies:
            dst = torch.tensor([d for _, d in ops.copies], device=dev)
            for key, tensor in self.tensors.items():
                tensor.index_copy_(0, dst, gathered[key])
        if ops.zeros:
            dst = torch.tensor(ops.zeros, device=dev)
            for tensor in self.tensors.values():
                tensor.index_fill_(0, dst, 0)
        if ops.swap_in:
            cpu = [c for c, _ in ops.swap_in]
            dst = torch.tensor([g for _, g in ops.swap_in], device=dev)
            for key, tensor in self.tensors.items():
                tensor.index_copy_(0, dst, self.cpu[key][cpu].to(dev, non_blocking=True))
