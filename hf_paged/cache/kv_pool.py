"""`KVPool`: the K/V tensors of a `PagedCache`, grouped by layer shape, behind one narrow interface.

A layer's K/V shape is a `KVShape`: its KV heads, the key width, the value width, and whether its values *are* its
keys (multi-head latent attention caches one latent per token and reads it as both: stored once). Most models have
one shape for every layer; Gemma 4 (per-layer head sizes and KV heads), MiMo-V2-Flash (K wider than V, sliding
layers with twice the KV heads) and MLA models do not. Layers of one shape form a *group*, which owns its tensors:

* K and V of one width: one tensor ``[layers, 2, num_blocks, heads, block_size, dim]``, K at ``[i, 0]`` and V at
  ``[i, 1]``: exactly the single pool of a uniform model, so its layout, its one-launch block copies and its views
  are unchanged;
* K and V of different widths: ``keys [layers, num_blocks, heads, block_size, key_dim]`` and ``values [..., value_dim]``;
* values that are the keys: ``keys`` only, and the layer's value cache *is* its key cache (the same view), so a token
  costs ``heads * key_dim`` elements, not twice that. `PagedCache.update(latent, latent, layer)` writes the keys only.

Every group shares the cache's one block manager and block tables: block id ``b`` holds the same tokens in every
layer, so copy-on-write, swapping, prefix caching and growth apply the same block ids to each tensor (the block dim
of every tensor is ``dim() - 4``, which `kernels.copy_blocks` takes). Nothing here runs per layer on the hot path:
`layer_views` is computed once per allocation (and growth) and the cache hands those views out.

Where the shapes come from: `memory.layer_kv_shapes(config)` (per-layer head sizes and KV heads, a value width,
MLA's latent: ``kv_lora_rank`` set gives one head of ``kv_lora_rank + qk_rope_head_dim`` whose values are its keys),
or `PagedCache(kv_shapes=[...])`, one `KVShape` per K/V layer. A layer of a learned-sparse-attention model (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5, ...) also keeps its
indexer's keys, one `index_dim`-wide vector per token (`KVShape.index_dim`): a tensor ``[layers, num_blocks, 1,
block_size, index_dim]`` of the group beside its K/V, under the same block ids, so forks, copy-on-write, swapping,
prefix caching and growth carry a sequence's index keys with its K/V (`index_view` hands a layer's out; the
`hf_paged.attention.adapters.dsa` adapter writes and reads them). `PagedCache.update` checks what a layer writes against
its shape (a ValueError naming both); a values-are-keys layer must be given the keys themselves as its values
(``update(latent, latent, layer)``), and its FP8 value scale is kept equal to its key scale. `PoolShapes` is the
cache's side of this: the shapes, the classic one-tensor `pool` view and the bytes of a block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from .index_keys import check_index_dtype
from .kv_quant import as_bytes

__all__ = ["KVShape", "KVPool", "PoolShapes"]


@dataclass(frozen=True)
class KVShape:
    """The K/V shape of one layer: `kv_heads` heads of `key_dim` keys and `value_dim` values; `values_are_keys`: the
    layer reads its keys as its values (stored once; `value_dim` equals `key_dim`); `index_dim`: the width of the
    sparse-attention indexer's key each token also keeps (0: no indexer at this layer)."""

    kv_heads: int
    key_dim: int
    value_dim: int
    values_are_keys: bool = False
    index_dim: int = 0

    def __post_init__(self) -> None:
        for name in ("kv_heads", "key_dim", "value_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KVShape.{name} must be a positive int, got {value!r}")
        if isinstance(self.index_dim, bool) or not isinstance(self.index_dim, int) or self.index_dim < 0:
            raise ValueError(f"KVShape.index_dim must be a non-negative int, got {self.index_dim!r}")
        if self.values_are_keys and self.value_dim != self.key_dim:
            raise ValueError(f"KVShape: values_are_keys needs value_dim == key_dim, got {self.value_dim} and "
                             f"{self.key_dim}")

    @property
    def elements_per_token(self) -> int:
        """Elements one token takes in one layer of this shape (K and V, or K alone when values are keys, and its
        index key)."""
        return self.kv_heads * (self.key_dim + (0 if self.values_are_keys else self.value_dim)) + self.index_dim

    def split_heads(self, divisor: int) -> KVShape:
        """This shape on one rank of a tensor-parallel model whose KV heads are split `divisor` ways."""
        if self.kv_heads % divisor:
            raise ValueError(f"a layer with {self.kv_heads} KV heads cannot be split {divisor} ways")
        return KVShape(self.kv_heads // divisor, self.key_dim, self.value_dim, self.values_are_keys, self.index_dim)


class _Group:
    """The layers of one shape: their pool indices and their tensors (GPU and, for swapping, CPU)."""

    def __init__(self, shape: KVShape, members: list[int]) -> None:
        self.shape = shape
        self.members = members  # pool indices, in order; member i is row i of every tensor
        self.tensors: list[torch.Tensor] = []
        self.cpu: list[torch.Tensor] = []

    @property
    def joint(self) -> bool:
        """K and V in one tensor `[layers, 2, ...]` (one width, values stored)."""
        return not self.shape.values_are_keys and self.shape.key_dim == self.shape.value_dim

    def shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        s, n = self.shape, len(self.members)
        index = [(n, num_blocks, 1, block_size, s.index_dim)] if s.index_dim else []  # last: `index_view`
        if self.joint:
            return [(n, 2, num_blocks, s.kv_heads, block_size, s.key_dim)] + index
        keys = (n, num_blocks, s.kv_heads, block_size, s.key_dim)
        kv = [keys] if s.values_are_keys else [keys, (n, num_blocks, s.kv_heads, block_size, s.value_dim)]
        return kv + index

    def views(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.joint:
            return self.tensors[0][row, 0], self.tensors[0][row, 1]
        keys = self.tensors[0][row]
        return (keys, keys) if self.shape.values_are_keys else (keys, self.tensors[1][row])


class KVPool:
    """The K/V blocks of every layer that keeps K/V, grouped by `KVShape` (module docstring).

    Args:
        shapes: each pool layer's shape, in pool order (the cache's `kv_layers`).
        num_blocks, block_size: blocks in every tensor, tokens per block.
        device, dtype: where and how K/V are stored.
        num_cpu_blocks: blocks of the CPU swap copies (0: none); pinned when `device` is CUDA.
    """

    def __init__(self, shapes: list[KVShape], num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, num_cpu_blocks: int = 0) -> None:
        # no shapes: a model without K/V layers (Mamba, FalconMamba): blocks are bookkeeping only (token counts,
        # prefix-cache keys) and cost nothing
        self.shapes = list(shapes)
        self._device, self._dtype = torch.device(device), dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.groups, self._place = self._make_groups()  # (`_place`: pool index -> (its group, its row there))
        for group in self.groups:
            group.tensors = [torch.zeros(s, device=device, dtype=dtype) for s in group.shapes(num_blocks, block_size)]
            if num_cpu_blocks > 0:
                group.cpu = [torch.zeros(s, dtype=dtype, pin_memory=device.type == "cuda")
                             for s in group.shapes(num_cpu_blocks, block_size)]

    def _make_groups(self) -> tuple[list[_Group], list[tuple[_Group, int]]]:
        """The groups of `shapes` (one per shape) and each pool layer's (group, row); tensors not made yet. (A grouped
        cache of layers of several shapes lays them out otherwise: `kv_pages.KVPages`.)"""
        groups: list[_Group] = []
        by_shape: dict[KVShape, _Group] = {}
        place: list[tuple[_Group, int]] = []
        for index, shape in enumerate(self.shapes):
            group = by_shape.get(shape)
            if group is None:
                group = by_shape[shape] = _Group(shape, [])
                groups.append(group)
            place.append((group, len(group.members)))
            group.members.append(index)
        return groups, place

    def __repr__(self) -> str:
        groups = ", ".join(f"{len(g.members)}x{g.shape}" for g in self.groups)
        return f"KVPool(num_blocks={self.num_blocks}, block_size={self.block_size}, groups=[{groups}])"

    @staticmethod
    def bytes_per_block(shapes: list[KVShape], block_size: int, element_size: int) -> int:
        """Bytes of one block over every layer of `shapes` (each layer its own shape: no padding to the widest)."""
        return sum(s.elements_per_token for s in shapes) * block_size * element_size

    @property
    def device(self) -> torch.device:
        return self.groups[0].tensors[0].device if self.groups else self._device

    @property
    def dtype(self) -> torch.dtype:
        return self.groups[0].tensors[0].dtype if self.groups else self._dtype

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every GPU tensor (each group's), block dim `dim() - 4`."""
        return [t for g in self.groups for t in g.tensors]

    @property
    def cpu_tensors(self) -> list[torch.Tensor]:
        return [t for g in self.groups for t in g.cpu]

    @property
    def uniform(self) -> torch.Tensor | None:
        """The one tensor `[layers, 2, num_blocks, heads, block_size, dim]` of a pool whose layers share one shape
        with K and V of one width (the classic layout), else None."""
        return self.groups[0].tensors[0] if len(self.groups) == 1 and self.groups[0].joint else None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def layer_views(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) of pool layer `index`, each `[num_blocks, heads, block_size, dim]` (the same view
        twice when its values are its keys)."""
        group, row = self._place[index]
        return group.views(row)

    def index_view(self, index: int) -> torch.Tensor | None:
        """The indexer keys `[num_blocks, 1, block_size, index_dim]` of pool layer `index` (None: it keeps none)."""
        group, row = self._place[index]
        return group.tensors[-1][row] if group.shape.index_dim else None

    def grow(self, new_blocks: int) -> None:
        """Every tensor takes `new_blocks` blocks, the existing ones copied (ids stay); the views change."""
        old = self.num_blocks
        for group in self.groups:
            grown = []
            for tensor, shape in zip(group.tensors, group.shapes(new_blocks, self.block_size)):
                bigger = torch.zeros(shape, device=tensor.device, dtype=tensor.dtype)
                bigger.narrow(tensor.dim() - 4, 0, old).copy_(tensor)
                grown.append(bigger)
            group.tensors = grown
        self.num_blocks = new_blocks

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Block `dst[i]` of every layer becomes a copy of block `src[i]` (copy-on-write): one launch per tensor."""
        for tensor in self.tensors:
            kernels.copy_blocks(tensor, src, dst)

    def swap_out(self, gpu: torch.Tensor, cpu: torch.Tensor) -> None:
        """CPU block `cpu[i]` of every tensor becomes GPU block `gpu[i]` (an FP8 pool's indexed as bytes)."""
        for tensor, host in zip(self.tensors, self.cpu_tensors):
            lead = (slice(None),) * (tensor.dim() - 4)
            as_bytes(host)[lead + (cpu,)] = as_bytes(tensor)[lead + (gpu.to(tensor.device),)].to("cpu")

    def swap_in(self, cpu: torch.Tensor, gpu: torch.Tensor) -> None:
        """GPU block `gpu[i]` of every tensor becomes CPU block `cpu[i]` again."""
        for tensor, host in zip(self.tensors, self.cpu_tensors):
            lead = (slice(None),) * (tensor.dim() - 4)
            as_bytes(tensor)[lead + (gpu.to(tensor.device),)] = as_bytes(host)[lead + (cpu,)].to(
                tensor.device, non_blocking=True)


class PoolShapes:
    """`PagedCache`'s side of its layers' shapes: set once (and again when a tensor-parallel rank's first write shows
    its share of the heads), read by the memory arithmetic and the runner; `kv` is the cache's `KVPool` (None before
    it is allocated and after it is released)."""

    kv: KVPool | None
    kv_layers: list[int]
    num_layers: int
    block_size: int

    def _set_shapes(self, shapes: list[KVShape]) -> None:
        """Each K/V layer's shape (pool order); `num_kv_heads` / `head_dim` are the first K/V layer's. Indexer keys
        in an FP8 pool are refused (`index_keys.check_index_dtype`)."""
        check_index_dtype(shapes, getattr(self, "kv_cache_dtype", None))
        self.kv_shapes = shapes
        # (a pool without K/V layers, a pure recurrent model's: 0 and 0)
        self.num_kv_heads, self.head_dim = (shapes[0].kv_heads, shapes[0].key_dim) if shapes else (0, 0)
        self._layer_shapes: list[KVShape | None] = [None] * self.num_layers  # by model layer, for `update`
        for layer, shape in zip(self.kv_layers, shapes):
            self._layer_shapes[layer] = shape

    @property
    def max_kv_heads(self) -> int:
        """The most KV heads any layer has (the decode kernels' per-head counters are sized for it)."""
        return max((shape.kv_heads for shape in self.kv_shapes), default=1)

    @property
    def pool(self) -> torch.Tensor | None:
        """The one K/V tensor `[kv layers, 2, num_blocks, kv heads, block_size, head_dim]` of a pool whose layers share
        one shape (None before allocation, and for a pool without K/V layers); a pool of mixed shapes has several:
        `self.kv` (a `KVPool`)."""
        if self.kv is None or not self.kv.groups:
            return None
        if self.kv.uniform is None:
            raise RuntimeError(f"this PagedCache's layers differ in shape ({self.kv!r}): its tensors are cache.kv's")
        return self.kv.uniform

    @property
    def cpu_pool(self) -> torch.Tensor | None:
        """The CPU swap copy of `pool` (a uniform pool's), or None."""
        if self.kv is None or not self.kv.num_cpu_blocks or self.pool is None:
            return None
        return self.kv.cpu_tensors[0]

    def bytes_per_block(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of one block in all K/V layers (each its own shape), stored as `dtype` (default: this pool's, one
        byte for FP8)."""
        element = torch.empty((), dtype=dtype or self.dtype).element_size()
        return KVPool.bytes_per_block(self.kv_shapes, self.block_size, element)
