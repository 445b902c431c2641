"""LoRA adapters per request, the engine's side: the registry of named adapters, their slots, admission.

`Engine(model, max_loras=4, max_lora_rank=16)`; `engine.add_lora(name, path)` reads a PEFT adapter directory and
wraps the linears it targets (`hf_paged.runner.lora`); `SamplingParams(lora=name)` runs a request through it. Requests
of different adapters (and of none) run in the same steps, each token through its own adapter.

* **Slots.** At most `max_loras` adapters are resident in the pools at once. A step's adapters are put in slots
  just before its forward (`LoraSlots.step` asks `slots_for`): an adapter that is not resident takes a free slot, or
  the slot of the least recently used adapter that this step does not use. Loading is a copy of its weights (held
  on the CPU since `add_lora`) into the pools.
* **Admission.** A step can only use `max_loras` adapters, so a waiting request whose adapter is not among those of
  the running and swapped requests is admitted only while they use fewer than `max_loras` (`admissible`, the
  scheduler's `admission_gate`). Otherwise it waits, in order, until one of them finishes: never an error.
* **Prefix cache.** Each `add_lora` gives the adapter a new id (a name added again after `remove_lora` gets another
  one), which is the request's `cache_salt`: the same prompt through two adapters never shares K/V blocks, through
  the same adapter it does (`hf_paged.core.block_pool.salted_root`).

Tensor parallelism is not supported with adapters (`add_lora` raises).
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict

import torch

from ..core import SequenceGroup
from ..runner.lora import LoraSlots, LoraWeights, load_adapter

__all__ = ["LoraAdapters"]


def _positive(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class LoraAdapters:
    """The named adapters of one engine, their ids and slots (see the module docstring)."""

    def __init__(self, engine, max_loras: int, max_lora_rank: int) -> None:
        self.max_loras = _positive("max_loras", max_loras)
        self.max_lora_rank = _positive("max_lora_rank", max_lora_rank)
        # a weak proxy: the engine holds this part, and a strong reference back would be a cycle that keeps a dropped
        # engine (its KV pool, its model) alive until the cycle collector runs (tests/test_memory_lifetime.py)
        self._engine = weakref.proxy(engine)
        self._ids = itertools.count(1)
        self._by_name: dict[str, tuple[int, LoraWeights]] = {}
        self._weights: dict[int, LoraWeights] = {}
        self._resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.slots: LoraSlots | None = None
        self.loads = 0  # adapters copied into a slot (evictions are the loads into an occupied slot)

    def names(self) -> list[str]:
        """The adapters' names, in the order they were added."""
        return list(self._by_name)

    def add(self, name: str, path: str) -> None:
        """Read the adapter at `path` and register it as `name` (see `Engine.add_lora`)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        if name in self._by_name:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded (remove_lora it first)")
        engine = self._engine
        if engine.tp is not None:
            raise ValueError("LoRA adapters are not supported under tensor parallelism")
        weights = load_adapter(path)
        if weights.rank > self.max_lora_rank:
            raise ValueError(f"adapter {name!r} has rank {weights.rank} > max_lora_rank={self.max_lora_rank}")
        model = engine.model
        for module_name, (a, b, _) in weights.modules.items():
            try:
                module = model.get_submodule(module_name)
            except AttributeError:
                raise ValueError(f"adapter {name!r} targets {module_name}, which the model does not have") from None
            base = getattr(module, "base", module)
            if not isinstance(base, torch.nn.Linear) or tuple(base.weight.shape) != (b.shape[0], a.shape[1]):
                raise ValueError(f"adapter {name!r}: {module_name} is not a linear of shape "
                                 f"{(b.shape[0], a.shape[1])} in the model")
        with engine._control():
            if self.slots is None:
                limit = max(engine.max_num_batched_tokens, engine.scheduler.max_num_seqs)
                self.slots = LoraSlots(self.max_loras, self.max_lora_rank, limit, engine.device)
                self.slots.slots_for = self.slots_for
                engine.runner.lora = self.slots
                engine.scheduler.admission_gate = self.admissible
            if self.slots.wrap(model, list(weights.modules)):
                engine.runner.invalidate_graphs()  # the graphs recorded the modules as they were
                for adapter_id, slot in self._resident.items():  # new modules' pools: fill the resident slots
                    self.slots.load(slot, self._weights[adapter_id])
            adapter_id = next(self._ids)
            self._by_name[name] = (adapter_id, weights)
            self._weights[adapter_id] = weights

    def remove(self, name: str) -> None:
        """Unregister `name`; a ValueError while unfinished requests use it."""
        adapter_id = self.resolve(name)
        with self._engine._control():
            if any(group.data.get("lora") == adapter_id for group in self._engine.scheduler.groups()):
                raise ValueError(f"LoRA adapter {name!r} is used by unfinished requests")
            del self._by_name[name]
            del self._weights[adapter_id]
            self._resident.pop(adapter_id, None)  # its slot is free again (zeroed when next loaded)

    def resolve(self, name: str) -> int:
        """The id of the adapter named `name`; a ValueError naming it when there is none."""
        entry = self._by_name.get(name) if isinstance(name, str) else None
        if entry is None:
            known = ", ".join(repr(n) for n in self._by_name) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {known})")
        return entry[0]

    def admissible(self, group: SequenceGroup) -> bool:
        """Whether admitting `group` keeps the adapters of the running and swapped requests within `max_loras`."""
        wanted = group.data.get("lora")
        if wanted is None:
            return True
        scheduler = self._engine.scheduler
        live = {g.data.get("lora") for g in itertools.chain(scheduler.running, scheduler.swapped)} - {None}
        return wanted in live or len(live) < self.max_loras

    def slots_for(self, ids: list[int | None]) -> list[int]:
        """Each item's slot (-1: no adapter), loading the step's adapters that are not resident."""
        needed = {i for i in ids if i is not None}
        resident = self._resident
        for adapter_id in needed:
            if adapter_id in resident:
                resident.move_to_end(adapter_id)
                continue
            used = set(resident.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next((i for i in resident if i not in needed), None)
                if victim is None:  # admission keeps a step's adapters within max_loras
                    raise RuntimeError(f"a step uses more than max_loras={self.max_loras} adapters (a bug)")
                slot = resident.pop(victim)
            self.slots.load(slot, self._weights[adapter_id])
            resident[adapter_id] = slot
            self.loads += 1
        return [-1 if i is None else resident[i] for i in ids]

    def close(self) -> None:
        """Give the model back its own linears (the engine is closing)."""
        if self.slots is not None:
            model = self._engine._model_ref.peek()
            if model is not None:
                self.slots.unwrap(model)
            self._resident.clear()
