"""`GroupedPagedCache`: an engine's `PagedCache` whose layers keep K/V in groups, one block table per group.

Why: a mixed sliding / full stack (Gemma 2/3, gpt-oss, Cohere 2, Qwen2 with `max_window_layers`) can release its
local layers' blocks before their window only if those layers have tables of their own
(`hf_paged.core.layer_groups` for the layout, `hf_paged.core.block_groups` for the tables).

* Layout: the pool has ``group_size`` slot tensors of the layers' one `KVShape` (a `KVPool` of that many layers);
  layer ``l`` reads and writes slot ``slot_of[l]``, so one block id costs ``group_size`` layers, not every layer.
  Each layer's views are its own tensor objects (aliasing the slot's memory), tagged with the layer's group
  (``_hf_paged_group``), which is how the attention function picks the group's step (`StepMetadata.for_group`).
* Steps: the runner builds the step of group 0 as for any cache, then `attach_group_steps` adds each other group's
  (its slots and tables; the same lengths and query rows). A step that writes without them is refused
  (`StepMetadata.for_group`); the drop-in path (transformers' `generate()` on the cache itself) is refused too.
* The plan comes from the config (`plan_for`); the windows the attention calls pass are checked against it once
  every layer was seen (`sliding_window_bound`), before any block is released: a mismatch warns and turns the
  release off (every block is kept, so the tokens stay exact).
* Scope: one `KVShape` for every layer, every decoder layer an attention layer with its own K/V (no recurrent or
  KV-sharing layers), no FP8 pool; `plan_for` returns None otherwise (a plain `PagedCache`, today's behaviour).
  Steps replay CUDA graphs (decode and ragged), run compiled and pipeline as usual, over a table store and slot
  buffers per group (`hf_paged.runner.group_static`; the compiled op picks its layer's group step as the attention
  function does).
"""

from __future__ import annotations

import warnings
import weakref

import torch

from ..core.block_groups import GroupedBlockManager
from ..core.layer_groups import LayerGroups, config_layer_windows, plan_layer_groups
from .kv_pool import KVPool
from .paged_cache import PagedCache
from .step import StepMetadata, make_step

__all__ = ["GroupedPagedCache", "plan_for"]


def plan_for(config, probe: PagedCache, *, fp8: bool = False, recurrent: bool = False) -> LayerGroups | None:
    """The layer groups of an engine's cache for `config` (`probe`: a `PagedCache` of it), or None for one table.

    None when the config does not declare a mixed sliding / full stack (`config_layer_windows`), or the model is
    outside the grouped scope: an FP8 pool, recurrent layers, layers that share another's K/V or differ in shape.
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if fp8 or recurrent or len(set(probe.kv_shapes)) != 1 or len(probe.kv_layers) != probe.num_layers:
        return None
    if probe._kv_sources:
        return None
    windows = config_layer_windows(text, probe.num_layers)
    return plan_layer_groups(windows) if windows is not None else None


class GroupedPagedCache(PagedCache):
    """A `PagedCache` with one block table per layer group (module docstring); built by the engine.

    Args: `PagedCache`'s, and `layer_groups` (from `plan_for`).
    """

    def __init__(self, *args, layer_groups: LayerGroups, **kwargs) -> None:
        self.layer_groups = layer_groups  # (before the base class, which may allocate the pool)
        super().__init__(*args, **kwargs)
        if len(self.kv_layers) != len(layer_groups.group_of) or len(set(self.kv_shapes)) != 1:
            raise ValueError(f"layer_groups plans {len(layer_groups.group_of)} layers of one shape; this cache has "
                             f"{len(self.kv_layers)} K/V layers of shapes {sorted(set(map(str, self.kv_shapes)))}")
        if self.kv_cache_dtype is not None:
            raise ValueError("a grouped PagedCache does not support an FP8 pool (kv_cache_dtype)")

    def bytes_per_block(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of one block id: `group_size` layers' K/V (a block belongs to one group)."""
        element = torch.empty((), dtype=dtype or self.dtype).element_size()
        return KVPool.bytes_per_block(self.kv_shapes[:1] * self.layer_groups.group_size, self.block_size, element)

    def _new_pool(self, num_blocks: int, device: torch.device, dtype: torch.dtype):
        groups = self.layer_groups
        pool = KVPool(self.kv_shapes[:1] * groups.group_size, num_blocks, self.block_size, device, dtype,
                      self.num_cpu_blocks)
        manager = GroupedBlockManager(num_blocks, self.block_size, groups.windows, self.num_cpu_blocks)
        return pool, manager

    def _tag_layers(self) -> None:
        """Each layer gets views of its slot tensor of its own (aliasing the memory), tagged with its group."""
        self._layer_views = [None] * self.num_layers
        for index, layer in enumerate(self.kv_layers):
            key_slot, value_slot = self.kv.layer_views(self.layer_groups.slot_of[index])
            key_cache, value_cache = key_slot.view(key_slot.shape), value_slot.view(value_slot.shape)
            for view in (key_cache, value_cache):
                view._hf_paged_cache = weakref.ref(self)
                view._hf_paged_scales = (None, None)
                view._hf_paged_group = self.layer_groups.group_of[index]
                view._hf_paged_layer = layer
            self._layer_views[layer] = (key_cache, value_cache)

    def write_layer(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, step: StepMetadata) -> None:
        """Write at the slots of the layer's group (`StepMetadata.for_group`)."""
        group = self.layer_groups.group_of[self._kv_index[layer_idx]]
        super().write_layer(layer_idx, keys, values, step.for_group(group))

    def _begin_forward(self, batch: int, q_len: int, device: torch.device) -> None:
        raise RuntimeError("a grouped PagedCache serves an engine only (its steps carry one table per layer group)")

    def attach_group_steps(self, step: StepMetadata, scheduled: list, num_tokens: int) -> None:
        """Give `step` (group 0's, built from `scheduled`'s items in order) the steps of the other groups: each
        item's slots and table in that group; rows past the items' tokens (padding, `num_tokens` in all) write
        nothing."""
        bm: GroupedBlockManager = self.block_manager
        device = step.slot_mapping.device
        lens = [item.start + item.num_tokens for item in scheduled]
        q_lens = [item.num_tokens for item in scheduled]
        by_item = [bm.group_tables(item.seq.seq_id) for item in scheduled]
        steps = [step]
        for group in range(1, bm.num_groups):
            slots: list[int] = []
            for item in scheduled:
                slots.extend(bm.group_slots(item.seq.seq_id, group, item.start, item.start + item.num_tokens))
            tables = [item_tables[group] for item_tables in by_item]
            slots.extend([-1] * (num_tokens - len(slots)))
            made = make_step(step.layout, slots, tables, lens, q_lens, device)
            made.split_counters, made.kv_start, made.kv_start_ready = step.split_counters, step.kv_start, \
                step.kv_start_ready
            steps.append(made)
        step.group_steps = steps

    def sliding_window_bound(self) -> tuple[bool, int | None]:
        """``(known, window)`` as `PagedCache`'s, checked against the plan: once every layer was seen, the largest
        planned window when the layers' windows are the planned ones (the scheduler then releases each sliding
        group's blocks, `GroupedBlockManager.release_out_of_window`), else a warning and None (nothing released)."""
        if len(self.layer_windows) < len(self.kv_layers):
            return False, None
        seen = [self.layer_windows.get(layer) for layer in self.kv_layers]
        if not self.layer_groups.matches(seen):
            warnings.warn(f"the attention layers passed sliding windows {seen}, not the "
                          f"{self.layer_groups.layer_windows()} their config declares: no KV block is released out of "
                          "a window", RuntimeWarning, stacklevel=2)
            self.block_manager.releasing = False
            return True, None
        return True, max(w for w in self.layer_groups.windows if w is not None)
