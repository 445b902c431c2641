"""`IndexKeys`: a `PagedCache`'s sparse-attention indexer keys, kept in paged storage beside each layer's K/V.

A DeepSeek Sparse Attention layer (DeepSeek-V3.2, GLM-5, HY-V4, A.X K2) has an *indexer* with its own projections:
every token gets one index key (`index_head_dim` values), every query scores all its sequence's cached index keys and
attends only its top `index_topk` positions (Qwen4-Exp's indexer pools blocks of raw index keys instead, and keeps
blocks: `hf_paged.attention.adapters.qsa`). transformers keeps the index keys in its cache's `DynamicIndexedLayer`
(`past_key_values.update_indexer(keys, layer_idx)`, which returns all of them, `[B, T, index_head_dim]`).

Here they live in the pool (`KVShape.index_dim`, `KVPool.index_view`): one tensor per layer group,
`[layers, num_blocks, 1, block_size, index_head_dim]`, addressed by the *same* block ids and slots as the layer's K/V.
So nothing about a sequence's lifetime needs a second bookkeeping: freeing, forking (beams, `n`), copy-on-write,
swapping out and in, preemption by recomputation (the keys are written again), prefix caching (a cached block holds
its tokens' index keys too: they depend on the token and its position only, as K/V do) and growth all act on every
tensor of the pool alike. A block costs `index_head_dim` more elements per token and layer, which
`KVShape.elements_per_token` counts, so the pool sizing (`bytes_per_block`, `kv_bytes_per_token`) does too.

The index keys are stored in the pool's dtype; an FP8 pool (one byte per element, scaled per layer) has no scale for
them, so a sparse-attention model with `kv_cache_dtype="fp8"` is refused (`check_index_dtype`).

A mixin of `PagedCache` with no state of its own: it reads the cache's pool, step and layer indices.
"""

from __future__ import annotations

import torch

__all__ = ["IndexKeys", "check_index_dtype", "gather_index_keys"]


def check_index_dtype(shapes, kv_cache_dtype) -> None:
    """ValueError when a pool of quantised storage (`kv_cache_dtype` set: FP8) would hold indexer keys."""
    if kv_cache_dtype is not None and any(getattr(s, "index_dim", 0) for s in shapes):
        raise ValueError("kv_cache_dtype='fp8' is not supported for a sparse-attention model (its indexer keys would "
                         "be stored unscaled): use kv_cache_dtype='auto'")


def gather_index_keys(pool: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """`[R, length, D]`: the index keys at positions `0..length-1` of each of the `R` sequences whose block tables
    are `block_tables [R, W]`, from one layer's `pool [num_blocks, 1, block_size, D]` (positions past a sequence's
    length read whatever its table's blocks hold there: the caller masks them)."""
    block_size = pool.shape[2]
    pos = torch.arange(length, device=pool.device)
    blocks = block_tables.long()[:, pos // block_size]  # [R, length]
    return pool[blocks, 0, (pos % block_size)[None, :].expand_as(blocks)]


class IndexKeys:
    """The indexer keys of a `PagedCache` (module docstring): written by slot, read by block table."""

    def index_pool(self, layer_idx: int) -> torch.Tensor:
        """Layer `layer_idx`'s index keys `[num_blocks, 1, block_size, index_head_dim]`; ValueError naming the layer
        when it keeps none (not a sparse-attention layer, or a "shared" one that reuses another's selection)."""
        if self.kv is None:
            raise RuntimeError("the pool is not allocated yet")
        index = self._kv_index.get(layer_idx)
        pool = self.kv.index_view(index) if index is not None else None
        if pool is None:
            raise ValueError(f"layer {layer_idx} keeps no indexer keys in this PagedCache (its KVShape has no "
                             "index_dim: not a sparse-attention layer of the config)")
        return pool

    @property
    def position_ids(self) -> torch.Tensor:
        """What a model that binds its full position ids to the cache reads back (Qwen4-Exp: `cat(cache.position_ids,
        new)`, then `cache.position_ids = ...`): an empty history, so the model's rotary covers this forward's tokens
        only. Its sparse-attention adapter (`hf_paged.attention.adapters.qsa`) rotates old positions itself; kept,
        the history would grow by every token of every step of an engine's sequences. AttributeError until set."""
        bound = self.__dict__.get("_bound_position_ids")
        if bound is None:
            raise AttributeError("position_ids")
        return bound[..., :0]

    @position_ids.setter
    def position_ids(self, value: torch.Tensor) -> None:
        self.__dict__["_bound_position_ids"] = value

    def write_index_keys(self, layer_idx: int, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Write `keys [N, index_head_dim]` at `slots [N]` (the step's slots of those tokens; a negative slot, a CUDA
        graph's padding row, writes nothing)."""
        pool = self.index_pool(layer_idx)
        if keys.dim() != 2 or keys.shape[-1] != pool.shape[-1] or keys.shape[0] != slots.shape[0]:
            raise ValueError(f"indexer keys of layer {layer_idx} must be [tokens, {pool.shape[-1]}] for "
                             f"{slots.shape[0]} slots, got {tuple(keys.shape)}")
        flat = pool.view(-1, pool.shape[-1])
        keep = slots >= 0
        flat.index_copy_(0, slots[keep].long(), keys[keep].to(flat.dtype))

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """transformers' `Cache.update_indexer` for the drop-in cache's padded batches: write the new index keys
        `[B, q, index_head_dim]` at this forward's slots (the layer's `update()` prepared them) and return every
        row's keys `[B, kv_len, index_head_dim]`, position for position as a `DynamicIndexedLayer` returns them (left
        padding included, masked by the model's mask).

        An engine step (ragged `[1, T]`, many sequences) has no such tensor: each query must score its own
        sequence's keys only, which the sparse-attention adapter (`hf_paged.attention.adapters.dsa`) does per
        sequence through `write_index_keys` and `gather_index_keys`."""
        step = self._step
        if step is None or step.layout != "padded":
            raise ValueError("PagedCache.update_indexer takes a padded (drop-in) batch after the layer's update(); an "
                             "engine step's sequences are scored by hf_paged.attention.adapters.dsa")
        if indexer_key_states.dim() != 3:
            raise ValueError(f"indexer_key_states must be [batch, tokens, index_head_dim], got "
                             f"{tuple(indexer_key_states.shape)}")
        self.write_index_keys(layer_idx, indexer_key_states.reshape(-1, indexer_key_states.shape[-1]),
                              step.slot_mapping)
        keys = gather_index_keys(self.index_pool(layer_idx), step.block_tables, self.get_seq_length())
        return keys.to(indexer_key_states.dtype)
