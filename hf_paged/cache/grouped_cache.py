"""`GroupedPagedCache`: an engine's `PagedCache` whose layers keep K/V in groups, one block table per group.

Why: a mixed sliding / full stack (Gemma 2, 3, 3n and 4, gpt-oss, Cohere 2, MiMo-V2-Flash, Qwen2 with
`max_window_layers`) can release its local layers' blocks before their window only if those layers have tables of
their own (`hf_paged.core.layer_groups` for the layout, `hf_paged.core.block_groups` for the tables).

* Layout: when every layer has one `KVShape`, the pool has ``group_size`` slot tensors of it (a `KVPool` of that
  many layers); layer ``l`` reads and writes slot ``slot_of[l]``, so one block id costs ``group_size`` layers, not
  every layer. Layers of several shapes (Gemma 4's local and global layers) share pages instead (`kv_pages.KVPages`:
  a block id is one page, each layer at its offset, `LayerGroups.layout`). Either way each layer's views are its own
  tensor objects (aliasing the pool's memory), tagged with the layer's group (``_hf_paged_group``), which is how the
  attention function picks the group's step (`StepMetadata.for_group`).
* KV sharing (Gemma 3n / 4's last `num_kv_shared_layers` layers read an earlier layer's K/V): such a layer has no
  place in the pool; it is handed its source layer's views (tagged with the source's group), so it reads through
  the source's group tables. The plan requires each such layer to have its source's window.
* Steps: the runner builds the step of group 0 as for any cache, then `attach_group_steps` adds each other group's
  (its slots and tables; the same lengths and query rows). A step that writes without them is refused
  (`StepMetadata.for_group`); the drop-in path (transformers' `generate()` on the cache itself) is refused too.
* The plan comes from the config (`plan_for`); the windows the attention calls pass are checked against it once
  every layer was seen (`sliding_window_bound`), before any block is released: a mismatch warns and turns the
  release off (every block is kept, so the tokens stay exact).
* Scope: every decoder layer an attention layer with its own K/V or one read from an earlier layer of its window
  (no recurrent layers), no indexer keys, no FP8 pool; `plan_for` returns None otherwise (a plain `PagedCache`,
  today's behaviour).
  Steps replay CUDA graphs (decode and ragged), run compiled and pipeline as usual, over a table store and slot
  buffers per group (`hf_paged.runner.group_static`; the compiled op picks its layer's group step as the attention
  function does).
"""

from __future__ import annotations

import warnings
import weakref

import numpy as np
import torch

from ..core.block_groups import GroupedBlockManager
from ..core.layer_groups import LayerGroups, config_layer_windows, plan_layer_groups
from .kv_pages import KVPages
from .kv_pool import KVPool
from .paged_cache import PagedCache
from .step import StepMetadata, make_step

__all__ = ["GroupedPagedCache", "fill_group_slots", "plan_for"]


def plan_for(config, probe: PagedCache, *, fp8: bool = False, recurrent: bool = False) -> LayerGroups | None:
    """The layer groups of an engine's cache for `config` (`probe`: a `PagedCache` of it), or None for one table.

    None when the config does not declare a mixed sliding / full stack (`config_layer_windows`), or the model is
    outside the grouped scope: an FP8 pool, recurrent (or other K/V-less) layers, indexer keys, a layer that reads
    the K/V of a layer of another window. Layers of several shapes are packed by their widths (`plan_layer_groups`).
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    sources = probe._kv_sources
    if fp8 or recurrent or len(probe.kv_layers) + len(sources) != probe.num_layers:
        return None
    if any(shape.index_dim for shape in probe.kv_shapes):
        return None
    windows = config_layer_windows(text, probe.num_layers)
    if windows is None or any(windows[layer] != windows[source] for layer, source in sources.items()):
        return None
    return plan_layer_groups([windows[layer] for layer in probe.kv_layers],
                             [shape.elements_per_token for shape in probe.kv_shapes])


def fill_group_slots(out: np.ndarray, scheduled: list, tables: list, shift: int) -> int:
    """Write the slot of every token of `scheduled` (its items' tokens in order, from column 0) in each group but the
    first into ``out[group - 1]``; `tables[i]`: item ``i``'s table in every group (`group_tables`). Returns the
    tokens written. A prefill chunk's slots come from one index into its table per group (the positions shared by
    every group), a decode row's from one entry: fewer Python operations than a slot list per group and item, for
    host work the GPU waits for (a prefill step is planned between two forwards)."""
    mask = (1 << shift) - 1
    groups = out.shape[0]
    at = 0
    for item, item_tables in zip(scheduled, tables):
        start, n = item.start, item.num_tokens
        if n == 1:
            block, offset = start >> shift, start & mask
            for g in range(groups):
                out[g, at] = (item_tables[g + 1][block] << shift) | offset
        elif n:
            positions = np.arange(start, start + n)
            blocks, offsets = positions >> shift, positions & mask
            for g in range(groups):
                out[g, at : at + n] = (np.asarray(item_tables[g + 1], dtype=np.int64)[blocks] << shift) | offsets
        at += n
    return at


class GroupedPagedCache(PagedCache):
    """A `PagedCache` with one block table per layer group (module docstring); built by the engine.

    Args: `PagedCache`'s, and `layer_groups` (from `plan_for`).
    """

    def __init__(self, *args, layer_groups: LayerGroups, **kwargs) -> None:
        self.layer_groups = layer_groups  # (before the base class, which may allocate the pool)
        super().__init__(*args, **kwargs)
        if len(self.kv_layers) != len(layer_groups.group_of):
            raise ValueError(f"layer_groups plans {len(layer_groups.group_of)} K/V layers; this cache has "
                             f"{len(self.kv_layers)}")
        if any(shape.index_dim for shape in self.kv_shapes):
            raise ValueError("a grouped PagedCache does not hold indexer keys (KVShape.index_dim)")
        if self.kv_cache_dtype is not None:
            raise ValueError("a grouped PagedCache does not support an FP8 pool (kv_cache_dtype)")

    @property
    def uniform_layers(self) -> bool:
        """Every K/V layer has one shape: slot tensors (`KVPool`), else pages (`KVPages`)."""
        return len(set(self.kv_shapes)) == 1

    def page_layout(self) -> tuple[tuple[int, ...], int]:
        """Each K/V layer's offset in a block's page and the page's width, in elements per token (of this cache's
        shapes: a tensor-parallel rank's share)."""
        return self.layer_groups.layout([shape.elements_per_token for shape in self.kv_shapes])

    def bytes_per_block(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of one block id: one page, the widest group's layers (a block belongs to one group); with one shape
        for every layer that is `group_size` layers' K/V."""
        element = torch.empty((), dtype=dtype or self.dtype).element_size()
        return self.page_layout()[1] * self.block_size * element

    def _new_pool(self, num_blocks: int, device: torch.device, dtype: torch.dtype):
        groups = self.layer_groups
        if self.uniform_layers:
            pool = KVPool(self.kv_shapes[:1] * groups.group_size, num_blocks, self.block_size, device, dtype,
                          self.num_cpu_blocks)
        else:
            pool = KVPages(self.kv_shapes, *self.page_layout(), num_blocks, self.block_size, device, dtype,
                           self.num_cpu_blocks)
        manager = GroupedBlockManager(num_blocks, self.block_size, groups.windows, self.num_cpu_blocks)
        return pool, manager

    def _tag_layers(self) -> None:
        """Each layer gets views of its own (aliasing the memory of its slot tensor or of its place in the pages),
        tagged with its group; a layer reading another's K/V gets that layer's views."""
        self._layer_views = [None] * self.num_layers
        uniform = self.uniform_layers
        for index, layer in enumerate(self.kv_layers):
            if uniform:
                key_slot, value_slot = self.kv.layer_views(self.layer_groups.slot_of[index])
                key_cache, value_cache = key_slot.view(key_slot.shape), value_slot.view(value_slot.shape)
            else:
                key_cache, value_cache = self.kv.layer_views(index)
            for view in {id(key_cache): key_cache, id(value_cache): value_cache}.values():
                view._hf_paged_cache = weakref.ref(self)
                view._hf_paged_scales = (None, None)
                view._hf_paged_group = self.layer_groups.group_of[index]
                view._hf_paged_layer = layer
            self._layer_views[layer] = (key_cache, value_cache)
        for layer, source in self._kv_sources.items():
            self._layer_views[layer] = self._layer_views[source]

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
        all_slots = np.full((bm.num_groups - 1, num_tokens), -1, dtype=np.int64)
        fill_group_slots(all_slots, scheduled, by_item, self.block_size.bit_length() - 1)
        steps = [step]
        for group in range(1, bm.num_groups):
            tables = [item_tables[group] for item_tables in by_item]
            made = make_step(step.layout, all_slots[group - 1].tolist(), tables, lens, q_lens, device)
            made.split_counters, made.kv_start, made.kv_start_ready = step.split_counters, step.kv_start, \
                step.kv_start_ready
            steps.append(made)
        step.group_steps = steps

    def sliding_window_bound(self) -> tuple[bool, int | None]:
        """``(known, window)`` as `PagedCache`'s, checked against the plan: once every layer was seen (those reading
        another layer's K/V too), the largest planned window when the layers' windows are the planned ones (the
        scheduler then releases each sliding group's blocks, `GroupedBlockManager.release_out_of_window`), else a
        warning and None (nothing released)."""
        layers = list(self.kv_layers) + list(self._kv_sources)
        if any(layer not in self.layer_windows for layer in layers):
            return False, None
        planned = self.layer_groups.layer_windows()
        seen = [self.layer_windows[layer] for layer in layers]
        expected = planned + [planned[self._kv_index[layer]] for layer in self._kv_sources]
        if seen != expected:
            warnings.warn(f"the attention layers {layers} passed sliding windows {seen}, not the {expected} their "
                          "config declares: no KV block is released out of a window", RuntimeWarning, stacklevel=2)
            self.block_manager.releasing = False
            return True, None
        return True, max(w for w in self.layer_groups.windows if w is not None)
