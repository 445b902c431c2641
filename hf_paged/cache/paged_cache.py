"""`PagedCache`: a transformers `Cache` whose keys and values live in a pool of fixed-size blocks.

Two ways to drive it:

* **Drop-in** (transformers' own `generate()` or a manual forward loop): every batch row is one sequence in the
  block manager. The first `update()` of a forward reserves slots for the new tokens of every row (copy-on-write
  for a shared partial block), later layers reuse that step. Left padding is written like any token and masked by
  the attention function through a per-row `kv_start`, exactly as transformers masks pads in a dense cache.
  `reorder_cache` / `batch_select_indices` / `batch_repeat_interleave` fork block tables instead of copying tensors.
* **Engine** (`hf_paged.engine`): the engine builds one ragged step (all tokens of all sequences in a `[1, T]` batch)
  and hands its metadata to `set_engine_step`; `update()` then only writes K/V by slot mapping.

Either way `update()` returns the layer's *pool* tensors `[num_blocks, kv_heads, block_size, head_dim]`, tagged with
the cache, and the registered attention function (`hf_paged.attention`) reads them through the block
tables of the current step. Nothing is ever gathered into a dense cache on the hot path. The tensors are a `KVPool`'s
(`hf_paged.cache.kv_pool`): layers of different shapes (head sizes, KV heads, value widths, values that are the keys)
each keep their own, all under one block manager.
"""

from __future__ import annotations

import math
import weakref

import torch
from transformers.cache_utils import Cache

from .. import kernels
from ..core import BlockManager
from .drop_in_rows import DropInRows
from .gradients import cut_gradients
from .index_keys import IndexKeys
from .kv_pool import KVPool, KVShape, PoolShapes
from .kv_quant import FP8_DTYPE, KVScales, resolve_kv_cache_dtype
from .layers import PagedLayer, window_bound
from .memory import (
    BLOCKLESS_POOL_BLOCKS,
    attention_shape,
    check_pool_arguments,
    cpu_pool_memory,
    cross_attention_layer_indices,
    kv_layer_indices,
    kv_shared_sources,
    memory_fraction,
    num_decoder_layers,
    parse_memory,
    pool_budget,
    pool_kv_shapes,
)
from .state_pool import StateKey, StateSpec
from .states import RecurrentStates
from .step import StepMetadata, device_table, make_step

__all__ = ["PagedCache", "CacheFullError", "device_table"]

_GROW_MIN_BLOCKS = 16  # first size of a pool that grows on demand (then doubled as needed)


class CacheFullError(RuntimeError):
    """The drop-in cache has no free block left for the next tokens (the engine preempts instead of raising)."""


class PagedCache(PoolShapes, DropInRows, IndexKeys, Cache):
    """KV cache in fixed-size blocks shared by reference between sequences (vLLM's PagedAttention for transformers).

    Args:
        config: the model config (or its decoder text config); gives layers, KV heads and head size.
        num_blocks: blocks in the pool. Default (neither `num_blocks` nor `kv_cache_memory`): the pool grows on
            demand, like a `DynamicCache`: it starts with what the first forward needs and doubles (copying the
            blocks) whenever a forward needs more, up to `gpu_memory_utilization` of the free CUDA memory (on the CPU,
            up to $HF_PAGED_CPU_KV_MEMORY, 512 MiB by default). A drop-in cache for one `generate()` call thus costs
            about what that call needs, not most of the GPU. The `Engine` sizes its pool up front instead (vLLM-style).
        block_size: tokens per block, a power of two (default 16).
        device, dtype: where the pool lives; default: those of the first key states written.
        kv_cache_dtype: "auto" (default: the pool stores K/V in `dtype`) or "fp8" / "fp8_e4m3": one byte an element
            (float8_e4m3fn), scaled per layer (`hf_paged.cache.kv_quant`), twice the tokens of a bf16 pool.
        kv_scales: an FP8 pool's scales: None or "calibrate" (from the first K/V each layer writes), a float for
            every layer, `{layer: (k_scale, v_scale)}`, or a model / state dict that ships them (`k_scale`, ...).
        gpu_memory_utilization: fraction of the free CUDA memory a growing pool may take (or an automatically sized
            fixed one, with `grow=False`).
        grow: whether the pool grows on demand (default: when neither `num_blocks` nor `kv_cache_memory` is given).
        kv_cache_memory: bytes (or "2GiB") for the pool; overrides the automatic size.
        num_cpu_blocks: size of the CPU swap pool (engine preemption by swapping), 0 = no swap.
        num_layers, num_kv_heads, head_dim: override what `config` says (e.g. the KV heads of one tensor-parallel
            rank; where layers differ in shape, the first K/V layer's, every layer split alike). Without an
            override, a pool allocated on first use takes its KV head count from the key states it is given, so the
            drop-in cache follows a model sharded by transformers' tensor parallelism.
        kv_shapes: one `KVShape` per K/V layer (heads, key width, value width, whether the values are the keys),
            overriding what the config says (`memory.layer_kv_shapes`, `memory.pool_kv_shapes`).
        num_state_slots, num_state_checkpoints, state_specs: hybrid models' recurrent states
            (`hf_paged.cache.state_pool`): slots for sequences, slots for prefix-cache checkpoints, and the states'
            shapes, all known up front (the engine's). Default: the drop-in cache learns the states from the first
            forward and keeps one slot per batch row.

    Hybrid models: only the layers that keep K/V (`kv_layer_indices`: not the recurrent ones) have blocks in the
    pool; each sequence also holds a state slot (`StateSlots`, through the block manager), which the recurrent
    mixers read and write through `hf_paged.attention.recurrent`.

    Why one class of this size: transformers' `Cache` contract is one object (update, lengths and mask sizes, beam
    reordering / batch selection / repetition, crop, reset); the step metadata (`StepMetadata`), memory arithmetic
    (`cache.memory`), layer shapes and tensors (`PoolShapes`, `KVPool`), FP8 scales (`KVScales`), the drop-in rows'
    beam and batch operations (`DropInRows`) and a sparse-attention model's indexer keys (`IndexKeys`) live apart.
    """

    def __init__(
        self,
        config=None,
        *,
        num_blocks: int | None = None,
        block_size: int = 16,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory: int | str | None = None,
        num_cpu_blocks: int = 0,
        num_layers: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        grow: bool | None = None,
        num_state_slots: int | None = None,
        num_state_checkpoints: int = 0,
        state_specs: dict[StateKey, StateSpec] | None = None,
        num_cpu_state_slots: int = 0,
        kv_cache_dtype: str | torch.dtype = "auto",
        kv_scales=None,
        kv_shapes: list[KVShape] | None = None,
    ):
        self._fixed_kv_heads = num_kv_heads is not None or kv_shapes is not None
        kv_layers = None
        if config is not None:
            if num_layers is None:  # (a pure recurrent model has no attention sizes: `attention_shape` raises)
                kv_layers = kv_layer_indices(config)
                num_layers = attention_shape(config)[0] if kv_layers else num_decoder_layers(config)
        if num_layers is None or config is None and (num_kv_heads is None or head_dim is None) and kv_shapes is None:
            raise ValueError("PagedCache needs `config` (or num_layers, num_kv_heads and head_dim)")
        check_pool_arguments(block_size, num_blocks, dtype)
        gpu_memory_utilization = memory_fraction(gpu_memory_utilization)
        # the storage: None keeps K/V in the model's dtype (`dtype=torch.float8_e4m3fn` is the same as "fp8")
        self.kv_cache_dtype = resolve_kv_cache_dtype(dtype if dtype == FP8_DTYPE else kv_cache_dtype)
        dtype = None if dtype == FP8_DTYPE else dtype
        if kv_scales is not None and self.kv_cache_dtype is None:
            raise ValueError("kv_scales needs kv_cache_dtype='fp8' (a 16/32-bit pool has no scales)")
        self._kv_scales_arg = kv_scales
        self.kv_scales: KVScales | None = None
        self.config = config
        self.num_layers = int(num_layers)
        # the layers that keep K/V, and each one's index in the pool (hybrid models: not the recurrent layers)
        self.kv_layers: list[int] = kv_layers if kv_layers is not None else list(range(self.num_layers))
        self._kv_index = {layer: i for i, layer in enumerate(self.kv_layers)}
        # layers that read another layer's K/V (Gemma 3n / 4 KV sharing): its views and scales are theirs too
        self._kv_sources = kv_shared_sources(config) if kv_layers is not None else {}
        self._cross_layers = set(cross_attention_layer_indices(config)) if kv_layers is not None else set()
        self._kv_index.update({layer: self._kv_index[source] for layer, source in self._kv_sources.items()})
        self._set_shapes(pool_kv_shapes(config, len(self.kv_layers), num_kv_heads, head_dim, kv_shapes))
        self._state_config = (num_state_slots, num_state_checkpoints, dict(state_specs or {}), num_cpu_state_slots)
        if num_state_slots is not None and (not isinstance(num_state_slots, int) or num_state_slots < 1):
            raise ValueError(f"num_state_slots must be a positive int, got {num_state_slots!r}")
        self.states: RecurrentStates | None = None
        self.block_size = block_size
        self.gpu_memory_utilization = gpu_memory_utilization  # memory_fraction's float, checked above
        self.kv_cache_memory = parse_memory(kv_cache_memory, "kv_cache_memory")
        self.num_cpu_blocks = int(num_cpu_blocks)
        self._requested_blocks = num_blocks
        if grow is not None and not isinstance(grow, bool):
            raise TypeError(f"grow must be a bool or None, got {grow!r}")
        self.grow = (num_blocks is None and self.kv_cache_memory is None) if grow is None else grow
        self._device = torch.device(device) if device is not None else None
        self._dtype = dtype
        self.kv: KVPool | None = None
        self.block_manager: BlockManager | None = None
        self._layer_views: list[tuple[torch.Tensor, torch.Tensor]] = []
        super().__init__(layers=[PagedLayer(self, i) for i in range(self.num_layers)])
        # drop-in state
        self._rows: list[int] = []
        self._next_seq_id = 0
        self._seen_tokens = 0
        self._step: StepMetadata | None = None
        self._engine_step_pending = False
        self._entered: set[tuple[int, int]] = set()  # (layer, 0 attention / 1 recurrent) entered in this forward
        self._defer_write = False  # set by an engine with compile_decode (see `update`)
        self._released = False
        # layer index -> the sliding window its attention calls pass (None: full attention), recorded by the
        # attention function on eager forwards; see `sliding_window_bound`
        self.layer_windows: dict[int, int | None] = {}
        if self._device is not None and self._dtype is not None:
            self._ensure_pool(self._device, self._dtype)

    # ------------------------------------------------------------------ pool
    @property
    def num_blocks(self) -> int | None:
        return self.block_manager.num_blocks if self.block_manager is not None else self._requested_blocks

    @property
    def device(self) -> torch.device | None:
        return self.kv.device if self.kv is not None else self._device

    @property
    def dtype(self) -> torch.dtype | None:
        """The pool's storage dtype (``float8_e4m3fn`` for an FP8 pool)."""
        return self.kv.dtype if self.kv is not None else self.kv_cache_dtype or self._dtype

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype of the K/V written and of the queries: the pool's, or the model's for an FP8 pool."""
        return self._compute_dtype if self.kv is not None else self._dtype

    @property
    def kv_scales_pending(self) -> bool:
        """An FP8 pool still calibrates a layer's scales: no step may replay a CUDA graph then (`cache.kv_quant`)."""
        return self.kv_scales is not None and bool(self.kv_scales.pending)

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale, v_scale) `[kv heads]` of an FP8 pool's layer (what the kernels take); (None, None) otherwise."""
        if self.kv_scales is None:
            return None, None
        return self.kv_scales.layer(self._kv_index[layer_idx])

    def write_layer(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, step: StepMetadata) -> None:
        """Write one layer's new K/V `[T, kv heads, D]` at `step`'s slots: cast to the pool's dtype, or for an FP8 pool
        quantised with the layer's scales (calibrated first if they are still pending and the step writes)."""
        key_cache, value_cache = self.layer_caches(layer_idx)
        k_scale, v_scale = self.layer_scales(layer_idx)
        if k_scale is None and keys.dtype != key_cache.dtype:
            keys, values = keys.to(key_cache.dtype), values.to(key_cache.dtype)
        self.calibrate_layer(layer_idx, keys, values, step)
        if value_cache is key_cache:  # values are the keys (`kv_pool`): stored once
            values = value_cache = None
        kernels.write_kv(keys, values, key_cache, value_cache, step.slot_mapping, k_scale=k_scale, v_scale=v_scale)

    def calibrate_layer(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, step: StepMetadata) -> None:
        """An FP8 pool's layer without its scales takes them from the first step that writes tokens (on the host's
        word: `step.host_writes`), never inside a CUDA-graph capture (`kv_quant.KVScales.calibrate`)."""
        if self.kv_scales_pending and step.host_writes and not (keys.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.kv_scales.calibrate(self._kv_index[layer_idx], keys, values, step.slot_mapping)

    @property
    def has_states(self) -> bool:
        """Whether sequences hold recurrent-state slots (a hybrid model's cache, once its states are known)."""
        return self.states is not None

    def _auto_num_blocks(self, device: torch.device, dtype: torch.dtype) -> int:
        """Blocks of storage `dtype` in `kv_cache_memory`, else in the memory `memory.pool_budget` gives a pool."""
        per_block = self.bytes_per_block(dtype)
        if per_block == 0:  # no K/V layers (a pure recurrent model): blocks cost nothing
            return BLOCKLESS_POOL_BLOCKS
        budget = self.kv_cache_memory or pool_budget(device, self.gpu_memory_utilization)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory/gpu_memory_utilization leave no room for a single KV block ({per_block} bytes)"
            )
        return int(num_blocks)

    def _ensure_pool(self, device: torch.device, dtype: torch.dtype, kv_heads: int | None = None,
                     min_blocks: int = 0, layer_idx: int | None = None) -> None:
        """Allocate the pool once, on first use (so CUDA sizing sees the memory left after the weights).
        `min_blocks`: what the first forward needs (a growing pool starts there).

        `kv_heads`: the heads of the key states `layer_idx` (default: the first K/V layer) is writing. A rank of a
        tensor-parallel model writes its share of the config's KV heads; the pool is sized for what it gets (every
        layer split alike), unless `num_kv_heads` or `kv_shapes` was given explicitly.
        """
        if self._released:
            raise RuntimeError("this PagedCache's pool was released (its engine is closed): create a new one")
        shape = self._layer_shapes[layer_idx] if layer_idx is not None else next(iter(self.kv_shapes), None)
        expected = shape.kv_heads if shape is not None else kv_heads
        if self.kv is not None or kv_heads is None or kv_heads == expected:
            if kv_heads is not None and kv_heads != expected:
                raise ValueError(f"the model writes {kv_heads} KV heads in layer {layer_idx} but this PagedCache "
                                 f"holds {expected} there")
            if self.kv is not None:
                return
        elif self._fixed_kv_heads or expected % kv_heads:
            raise ValueError(f"the model writes {kv_heads} KV heads in layer {layer_idx} but this PagedCache holds "
                             f"{expected} there")
        else:  # one tensor-parallel rank's share
            self._set_shapes([s.split_heads(expected // kv_heads) for s in self.kv_shapes])
        device = self._device or torch.device(device)
        self._compute_dtype = self._dtype or dtype  # what the model writes; stored as `kv_cache_dtype` if set
        dtype = self.kv_cache_dtype or self._compute_dtype
        if self._requested_blocks:
            num_blocks = self._requested_blocks
        elif self.grow:
            num_blocks = max(_GROW_MIN_BLOCKS, min_blocks)
        else:
            num_blocks = self._auto_num_blocks(device, dtype)
        self.kv, self.block_manager = self._new_pool(num_blocks, device, dtype)
        if self.kv_cache_dtype is not None:
            self.kv_scales = KVScales(self._kv_scales_arg, self.kv_layers, [s.kv_heads for s in self.kv_shapes],
                                      device, values_are_keys=[s.values_are_keys for s in self.kv_shapes])
        self._tag_layers()
        if self._state_config[0] is not None:  # the engine's: every state known, slots sized up front
            self._ensure_states(device)

    def _new_pool(self, num_blocks: int, device: torch.device, dtype: torch.dtype) -> tuple[KVPool, BlockManager]:
        """A new pool's K/V tensors and block manager (`GroupedPagedCache` lays its layers out in groups)."""
        return (KVPool(self.kv_shapes, num_blocks, self.block_size, device, dtype, self.num_cpu_blocks),
                BlockManager(num_blocks, self.block_size, num_cpu_blocks=self.num_cpu_blocks))

    def _ensure_states(self, device: torch.device) -> None:
        """Give sequences recurrent-state slots (a hybrid model): the engine's sizes, or one per drop-in row (now)."""
        if self.states is None:
            slots, checkpoints, specs, cpu_slots = self._state_config
            self.states = RecurrentStates(self.block_manager, device, num_slots=slots, num_checkpoints=checkpoints,
                                          specs=specs, num_cpu_slots=cpu_slots)

    def _tag_layers(self) -> None:
        self._layer_views = [None] * self.num_layers
        for index, layer in enumerate(self.kv_layers):
            key_cache, value_cache = self.kv.layer_views(index)
            # the attention function finds the step metadata through this tag; a weak reference, so dropping the
            # cache frees the pool at once instead of waiting for the cycle collector
            key_cache._hf_paged_cache = value_cache._hf_paged_cache = weakref.ref(self)
            key_cache._hf_paged_scales = value_cache._hf_paged_scales = self.layer_scales(layer)  # FP8: the kernels'
            key_cache._hf_paged_layer = value_cache._hf_paged_layer = layer  # (the attention's `_cache_layer`)
            self._layer_views[layer] = (key_cache, value_cache)
        for layer, source in self._kv_sources.items():  # (the compiled step's op looks its layer's views up)
            self._layer_views[layer] = self._layer_views[source]

    def _grow_pool(self, required: int) -> None:
        """A growing pool takes at least `required` blocks in all (twice its size if that is more), within its cap;
        the blocks are copied, ids and tables stay. Leaves it as it is when even `required` does not fit."""
        old = self.block_manager.num_blocks
        per_block = self.bytes_per_block(self.kv.dtype)
        if per_block == 0:  # no K/V layers: blocks cost nothing
            cap = max(old, required, BLOCKLESS_POOL_BLOCKS)
        elif self.kv.device.type == "cuda":
            cap = old + max(0, pool_budget(self.kv.device, self.gpu_memory_utilization)) // per_block
        else:
            cap = max(old, cpu_pool_memory() // per_block)
        new = min(max(2 * old, required), cap)
        if new < required:
            return
        self.kv.grow(new)
        self.block_manager.grow(new)
        self._tag_layers()

    def release_pool(self) -> None:
        """Free the pool's memory now (a closing engine). The block manager and its statistics stay; the cache holds
        nothing any more and must not be used for another forward."""
        self.kv = None
        self._layer_views = []
        if self.states is not None:
            self.states.release()
        self._step = None
        self._released = True

    def layer_caches(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) of one layer, each `[num_blocks, kv_heads, block_size, head_dim]` (the same tensor
        twice for a layer whose values are its keys)."""
        if self.kv is None:
            raise RuntimeError("the pool is not allocated yet")
        views = self._layer_views[layer_idx]
        if views is None:
            raise ValueError(f"layer {layer_idx} keeps no K/V in this PagedCache (its config's layer type is "
                             f"{self._layer_type(layer_idx)!r}); K/V layers: {self.kv_layers}")
        return views

    def _layer_type(self, layer_idx: int):
        text = self.config.get_text_config(decoder=True) if hasattr(self.config, "get_text_config") else self.config
        types = getattr(text, "layer_types", None) or ()
        return types[layer_idx] if layer_idx < len(types) else None

    # ------------------------------------------------------------------ Cache API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write this step's K/V of `layer_idx` into the pool; return the layer's pool tensors (tagged)."""
        if self._defer_write and torch.compiler.is_dynamo_compiling():
            # hf_paged's compiled decode step: the attention op writes and reads in one call
            # (`hf_paged.attention.compiled_op.write_and_decode`), so hand the new tokens through
            return key_states, value_states
        if key_states.dim() != 4 or value_states.dim() != 4:
            raise ValueError(f"expected key/value states [batch, heads, tokens, head_dim], got "
                             f"{tuple(key_states.shape)} and {tuple(value_states.shape)}")
        if isinstance(layer_idx, int) and not 0 <= layer_idx < self.num_layers:  # (symbolic in a compiled layer)
            raise ValueError(f"layer_idx={layer_idx} is not one of this PagedCache's {self.num_layers} layers")
        batch, heads, q_len, _ = key_states.shape
        self._ensure_pool(key_states.device, key_states.dtype, heads,
                          min_blocks=batch * (-(-q_len // self.block_size) + 1), layer_idx=layer_idx)
        shape = self._layer_shapes[layer_idx]
        if shape is None:
            raise ValueError(f"layer {layer_idx} keeps no K/V of its own in this PagedCache (its config's layer type "
                             f"is {self._layer_type(layer_idx)!r}; K/V layers: {self.kv_layers})")
        if (value_states.shape[:3] != key_states.shape[:3] or key_states.shape[-1] != shape.key_dim
                or value_states.shape[-1] != shape.value_dim
                or shape.values_are_keys and value_states.data_ptr() != key_states.data_ptr()):
            raise ValueError(f"layer {layer_idx} writes keys {tuple(key_states.shape)} and values "
                             f"{tuple(value_states.shape)} but this PagedCache holds {shape} there (values_are_keys: "
                             "pass the keys themselves as the values)")
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            key_states, value_states = cut_gradients(key_states, value_states)
        self._enter(layer_idx, 0, batch, q_len, key_states.device)
        # [B, H, q, D] -> [B*q, H, D] in row-major token order, matching slot_mapping
        keys = key_states.transpose(1, 2).reshape(-1, heads, shape.key_dim)
        values = keys if shape.values_are_keys else value_states.transpose(1, 2).reshape(-1, heads, shape.value_dim)
        self.write_layer(layer_idx, keys, values, self._step)
        return self.layer_caches(layer_idx)

    def _enter(self, layer_idx: int, kind: int, batch: int, q_len: int, device: torch.device) -> None:
        """A layer (`kind` 0: attention, 1: recurrent mixer) starts its part of a forward: the first one of a forward
        prepares the step (the drop-in cache), or takes the one the engine prepared."""
        if self._engine_step_pending:
            self._engine_step_pending = False  # the engine prepared this forward's step
            self._entered = set()
        elif self._step is None or (layer_idx, kind) in self._entered:
            self._begin_forward(batch, q_len, device)
            self._entered = set()
        self._entered.add((layer_idx, kind))

    def enter_recurrent_layer(self, layer_idx: int, hidden_states: torch.Tensor) -> StepMetadata:
        """Before a recurrent mixer (`attention.recurrent`) runs: the pools and state slots exist; the step returned."""
        if hidden_states.dim() != 3:
            raise ValueError(f"expected hidden states [batch, tokens, hidden], got {tuple(hidden_states.shape)}")
        batch, q_len = hidden_states.shape[:2]
        device = hidden_states.device
        self._ensure_pool(device, hidden_states.dtype, None, min_blocks=batch * (-(-q_len // self.block_size) + 1))
        self._ensure_states(device)
        self._enter(layer_idx, 1, batch, q_len, device)
        if self._step.state_slots is None and self._step.layout == "padded":  # an attention layer began it (MiniMax)
            self.states.fill_step(self._step, self._rows, device)
        return self._step

    def _begin_forward(self, batch: int, q_len: int, device: torch.device) -> None:
        """A new forward starts (first layer): prepare this step's metadata once for all layers."""
        # composite models: the decoder's text config is the one that runs (a vision tower may stay on eager)
        text = self.config.get_text_config(decoder=True) if hasattr(self.config, "get_text_config") else self.config
        attn = getattr(text, "_attn_implementation", None) if text is not None else None
        if attn is not None and attn != "hf_paged":
            raise ValueError(
                f"this model runs attention_implementation={attn!r}, which cannot read a PagedCache: call "
                "hf_paged.enable(model) first"
            )
        bm = self.block_manager
        if not self._rows:
            if self.states is not None:
                self.states.make_room(batch)
            self._rows = [self._new_seq(0) for _ in range(batch)]
        elif batch != len(self._rows):
            raise ValueError(
                f"PagedCache holds {len(self._rows)} sequences but the model was called with a batch of {batch}; "
                "use reorder_cache / batch_select_indices / batch_repeat_interleave to change the batch"
            )
        needed = bm.blocks_needed_to_append_many((seq, q_len) for seq in self._rows)
        if needed > bm.gpu.num_free and self.grow:
            self._grow_pool(bm.num_blocks - bm.gpu.num_free + needed)
            bm = self.block_manager
        if needed > bm.gpu.num_free:
            raise CacheFullError(
                f"PagedCache is full: {q_len} more tokens for {batch} sequences need {needed} blocks but "
                f"{bm.gpu.num_free} of {bm.num_blocks} are free; create it with a larger num_blocks or kv_cache_memory"
            )
        slots: list[int] = []
        copies: list[tuple[int, int]] = []
        for seq in self._rows:
            result = bm.append_slots(seq, q_len)
            slots.extend(result.slots)
            copies.extend(result.copies)
        self._copy_blocks(copies)
        continues = self._seen_tokens > 0
        self._seen_tokens += q_len
        tables = [bm.block_table(seq) for seq in self._rows]
        lens = [bm.num_tokens(seq) for seq in self._rows]
        self._step = self._make_step("padded", slots, tables, lens, [q_len] * batch, device)
        self._step.state_prev = continues
        if self.states is not None:
            self.states.fill_step(self._step, self._rows, device)

    def apply_state_ops(self) -> None:
        """Apply the recurrent-state slot operations decided since the last forward (forks, fresh slots, swaps,
        checkpoints): before this forward reads any state."""
        if self.states is not None:
            self.states.apply_ops()

    def _make_step(self, layout, slots, tables, lens, q_lens, device) -> StepMetadata:
        return make_step(layout, slots, tables, lens, q_lens, device)

    def sliding_window_bound(self) -> tuple[bool, int | None]:
        """``(known, window)``: whether every layer's attention was seen, and then the largest sliding window when
        every layer slides (None when some layer attends everything); from the windows the layers' calls passed
        (`layers.window_bound` says why)."""
        return window_bound(self.layer_windows, len(self.kv_layers))

    def set_engine_step(self, step: StepMetadata) -> None:
        """Engine entry point: the next forward uses this ragged step (blocks were reserved by the engine)."""
        self._step = step
        self._engine_step_pending = True

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=self.kv.device)
            dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=self.kv.device)
            self.kv.copy_blocks(src, dst)

    def _new_seq(self, num_tokens: int) -> int:
        seq = self._next_seq_id
        self._next_seq_id += 1
        self.block_manager.allocate(seq, num_tokens)
        return seq

    def get_seq_length(self, layer_idx: int = 0) -> int:  # (Mllama's image layers hold nothing: it skips them)
        return 0 if layer_idx in self._cross_layers else self._seen_tokens

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._seen_tokens + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.kv is not None

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    def reset(self) -> None:
        """Forget every sequence; the pool stays allocated for reuse."""
        if self.block_manager is not None:
            self.block_manager.reset()
        self._rows = []
        self._seen_tokens = 0
        self._step = None
        self._engine_step_pending = False
        self._entered = set()

    # ------------------------------------------------------------------ introspection
    def stats(self):
        """Block statistics of the pool (`hf_paged.core.BlockStats`)."""
        if self.block_manager is None:
            raise RuntimeError("the pool is not allocated yet")
        return self.block_manager.stats()

    def __repr__(self) -> str:
        blocks = self.num_blocks if self.num_blocks is not None else "auto"
        return (
            f"PagedCache(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
            f"{'' if len(set(self.kv_shapes)) <= 1 else ' (first layer; shapes differ)'}, "
            f"block_size={self.block_size}, num_blocks={blocks}, sequences={len(self._rows)})"
        )

    @staticmethod
    def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
        return math.ceil(num_tokens / block_size)
