"""`KVPages`: the K/V blocks of a grouped cache whose layers differ in shape, one *page* of bytes per block id.

Why: a grouped cache (`hf_paged.cache.grouped_cache`) gives each layer group its own block tables, and one block id
holds one group's layers. When every layer has one `KVShape` the groups' layers at one position alias one slot tensor
(`KVPool` of ``group_size`` layers). Gemma 4's layers do not: its local layers have ``head_dim`` heads, its global
ones ``global_head_dim`` and their own KV heads, so no slot tensor fits both. Here a block id is a page of
``page_width`` elements per token (`LayerGroups.layout`), one tensor ``[num_blocks, 1, block_size, page_width]``, and
each layer reads and writes its part of every page: keys ``[num_blocks, heads, block_size, key_dim]`` at its offset,
values right after them, both with the page's block stride (`torch.as_strided`; the kernels take a cache's block,
head and token strides, the torch references index it). Layers of different groups at overlapping offsets alias,
which is safe for the reason slots are: a block id belongs to one group's tables at a time.

Why pages and not slot tensors sized for the widest layer aliasing them: Gemma-4-31B's 10 global layers (4 KV heads x
512) take half the bytes of 10 local ones (16 x 256), so slots would leave half of every global block empty, and the
global group is the one that keeps a whole context (at 32k tokens in bf16: 5 GiB a sequence instead of 2.5).

What the rest of the pool does is `KVPool`'s, on the page tensor: copy-on-write copies whole pages (one launch:
each block ``[1, block_size, page_width]`` is contiguous), swapping moves whole pages, growth copies the pages and the
cache takes new views. A page costs ``page_width * block_size`` elements, padding included (a group narrower than
the page leaves its rest unused): what `GroupedPagedCache.bytes_per_block` counts and the engine sizes the pool by.
Out of scope: indexer keys (`KVShape.index_dim`) and FP8 pools (`grouped_cache.plan_for` keeps one table for them).
"""

from __future__ import annotations

import torch

from .kv_pool import KVPool, KVShape

__all__ = ["KVPages"]


class _Pages:
    """One page tensor (and its CPU copy) holding every pool layer at its offset; `KVPool`'s group interface."""

    joint = False
    shape = None  # (no one shape: `KVPool.index_view` is overridden)

    def __init__(self, shapes: list[KVShape], offsets: tuple[int, ...], width: int) -> None:
        self.layer_shapes, self.offsets, self.width = shapes, offsets, width
        self.members = list(range(len(shapes)))
        self.tensors: list[torch.Tensor] = []
        self.cpu: list[torch.Tensor] = []

    def shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        return [(num_blocks, 1, block_size, self.width)]

    def views(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        pages = self.tensors[0]
        num_blocks, _, block_size, _ = pages.shape
        shape, stride = self.layer_shapes[row], pages.stride(0)
        start = pages.storage_offset() + self.offsets[row] * block_size
        keys = pages.as_strided((num_blocks, shape.kv_heads, block_size, shape.key_dim),
                                (stride, block_size * shape.key_dim, shape.key_dim, 1), start)
        if shape.values_are_keys:
            return keys, keys
        values = pages.as_strided((num_blocks, shape.kv_heads, block_size, shape.value_dim),
                                  (stride, block_size * shape.value_dim, shape.value_dim, 1),
                                  start + shape.kv_heads * shape.key_dim * block_size)
        return keys, values


class KVPages(KVPool):
    """A `KVPool` whose layers (pool order, shapes `shapes`) sit at `offsets` (elements per token) of one page of
    `page_width` elements per token per block id (module docstring); `layer_views(i)` are layer ``i``'s own views.

    Args: `KVPool`'s, and `offsets`, `page_width` (`LayerGroups.layout` of the layers' widths)."""

    def __init__(self, shapes: list[KVShape], offsets: tuple[int, ...], page_width: int, num_blocks: int,
                 block_size: int, device: torch.device, dtype: torch.dtype, num_cpu_blocks: int = 0) -> None:
        if len(offsets) != len(shapes):
            raise ValueError(f"offsets must give {len(shapes)} layers' offsets, got {len(offsets)}")
        for shape, offset in zip(shapes, offsets):
            if shape.index_dim:
                raise ValueError(f"KVPages does not hold indexer keys (a layer of shape {shape})")
            if offset < 0 or offset + shape.elements_per_token > page_width:
                raise ValueError(f"page_width {page_width} cannot hold a layer of shape {shape} at offset {offset}")
        self._layout = (tuple(offsets), int(page_width))
        super().__init__(shapes, num_blocks, block_size, device, dtype, num_cpu_blocks)

    def _make_groups(self):
        pages = _Pages(self.shapes, *self._layout)
        return [pages], [(pages, row) for row in range(len(self.shapes))]

    def __repr__(self) -> str:
        return (f"KVPages(num_blocks={self.num_blocks}, block_size={self.block_size}, page_width={self._layout[1]}, "
                f"layers={len(self.shapes)})")

    def index_view(self, index: int) -> torch.Tensor | None:
        return None
