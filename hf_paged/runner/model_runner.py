"""Turn a scheduler decision into one model forward: inputs, block operations, CUDA graphs.

Prefill-carrying steps run eagerly over the flattened `[1, T]` batch (or, once compiled, replay a graph per token
bucket: `hf_paged.runner.ragged_graphs`). Decode-only steps of at most `max_num_seqs` sequences, each computing one
token and sampling, replay on CUDA a CUDA graph captured for the next larger batch-size bucket
(`hf_paged.runner.shapes.decode_buckets`). The graph reads persistent device buffers:

* `meta [6, max_num_seqs]`: one int64 row each for token ids, positions, slot mapping, sequence lengths, table-store
  rows and the rows of the previous step's tokens (pipelined steps gather their input ids from them on the device),
  refilled by a single host-to-device copy per step from pinned host buffers (two sets, used alternately: a pinned
  copy is read by the GPU after `copy_` returns, and a pipelined step writes its inputs before the step launched
  before it has run);
* `store`: a device-side table store where every sequence keeps its block table in a row of its own across steps.
  Only the rows whose table changed (a new block, a copy-on-write, a new sequence) are uploaded; the graph gathers
  the step's `block_tables` from the store by the `meta` row indices. A sequence that finishes therefore costs
  nothing to the others (no row shifts, no re-upload).

So a decode step costs a few small copies and one graph launch instead of hundreds of kernel launches from Python.
Rows of a bucket beyond the real batch write nowhere (slot -1) and attend to nothing (length 0).

`decode_mode` is "graph" (CUDA graphs), "static" (the same buffers and host path, the forward run eagerly: lets the
CPU tests cover the decode path of the GPU token for token) or "eager".
"""

from __future__ import annotations

import atexit
import threading
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from ..attention import active_cache
from ..cache import GroupedPagedCache, PagedCache, StepMetadata
from ..cache.host_ints import int_tensor
from ..core import SchedulerOutput
from .graphs import GraphCapture, decode_forward
from .group_static import GroupedStatic
from .lora import LoraSlots
from .model_ref import ModelRef
from .ragged_graphs import RaggedGraphs
from .regional import CompiledLayers, own_code
from .shapes import decode_buckets, padded_rows, padded_tokens
from .sibling_linears import fusing_backend, pack_siblings
from .table_store import TableStore, kept_rows
from .warm_up import WarmUpForwards

# Dynamo is not thread-safe while it compiles: two engines in two threads compiling their decode step at once can
# corrupt its caches. A runner's first call of each shape kind (one row / a symbolic batch) holds this lock; the
# calls after it run the compiled code without it.
_COMPILE_LOCK = threading.Lock()

# live runners: `repack` moves a model's projections, so its other runners drop their graphs (old addresses; the old
# memory is freed in stream order, after any replay already launched) and record them again at their next step
_RUNNERS: weakref.WeakSet = weakref.WeakSet()
_MISSING = object()
_META_ROWS = 7  # rows of the static step's `meta` buffer (`_ensure_buffers`)


def _drop_graphs_at_exit() -> None:
    """Drop every live runner's CUDA graphs when the interpreter exits, before torch.distributed's teardown.

    Under tensor parallelism a decode graph records the model's NCCL collectives, and a communicator is not destroyed
    while a graph that recorded it lives: a process whose engine is still open at exit would never end
    (pytorch/pytorch#115388). `atexit` handlers run before the interpreter's teardown frees the process groups. An
    explicit `destroy_process_group()` comes before them: close the engine first (`Engine.close()` drops the graphs
    too)."""
    for runner in list(_RUNNERS):
        runner._graphs.clear()
        runner._pool = None


atexit.register(_drop_graphs_at_exit)

__all__ = ["ModelRunner"]


class ModelRunner(GraphCapture, RaggedGraphs, TableStore, GroupedStatic, WarmUpForwards):
    """Runs each scheduled step as one forward of the model over the paged cache (see the module docstring).

    Why one class of this size: the eager path, the static decode buffers, the table store and the CUDA graphs (or
    the compiled step) share one set of persistent buffers and one invalidation rule for the tables; splitting them
    would pass that state between objects on the hot path.
    """

    def __init__(
        self,
        model_ref: ModelRef,
        cache: PagedCache,
        *,
        max_num_seqs: int,
        max_model_len: int | None,
        use_cuda_graph: bool | None = None,
        compile_decode: bool = False,
        compile_auto: bool = False,
    ) -> None:
        self.model_ref = model_ref  # weak when the model owns the engine (hf_paged.runner.model_ref)
        self.cache = cache
        self.device = cache.device
        # ragged steps run at `padded_tokens` counts on CUDA (cuBLAS's per-shape heuristic cache); capped by
        # `token_limit` (the engine sets its token budget)
        self.pad_ragged = self.device.type == "cuda"
        self.token_limit: int | None = None
        self.block_size = cache.block_size
        self.max_num_seqs = max_num_seqs
        self.grouped = isinstance(cache, GroupedPagedCache)  # one table per layer group (`group_static`)
        if use_cuda_graph is None:
            use_cuda_graph = self.device.type == "cuda"
        if use_cuda_graph and self.device.type != "cuda":
            raise ValueError("use_cuda_graph=True needs the model on a CUDA device")
        self.decode_mode = "graph" if use_cuda_graph else "eager"
        self.compile_decode = compile_decode
        self.compile_auto = compile_auto  # compile_decode was chosen, not asked for: a failed compile falls back
        # hybrid models: ragged steps call each recurrent layer per prefill chunk (`attention.recurrent`), so they run
        # eagerly (no ragged graphs or compiled prefill); decode steps are compiled and recorded as usual
        self.hybrid = cache.has_states
        # ragged (prefill-carrying) steps run through the decode step's compiled layers once they exist (see
        # `_prefill_layers`); set False to keep them on the model's own code
        self.compile_prefill = compile_decode and not self.hybrid
        self._prefill_checked = False
        self._forward = decode_forward(model_ref, cache)
        self._compiled = None
        self._compiled_kinds: set = set()
        if compile_decode:
            if not use_cuda_graph:
                self.decode_mode = "static"  # the compiled step runs on the static buffers, with or without graphs
            cache._defer_write = True
        # sibling projections (q/k/v, gate/up) stacked in one buffer each: the compiled step runs one GEMM for each
        # group (`hf_paged.runner.sibling_linears`); before the engine's weight watch takes its first fingerprint
        self.packed_groups = self.repack() if compile_decode else 0
        _RUNNERS.add(self)
        # batch sizes a decode step is padded to; a compiled step is traced with a symbolic batch size, and a batch
        # of 1 would be specialised by Dynamo (one more compilation), so compiled steps start at 2
        self._bucket_sizes = [s for s in decode_buckets(max_num_seqs)
                              if not compile_decode or s >= 2 or max_num_seqs == 1]
        self.max_blocks_per_seq = -(-(max_model_len or 8192) // self.block_size)
        # bucket -> callable running the decode forward, returning its logits; ("ragged", tokens) -> a ragged step's
        self._graphs: dict[int | tuple, object] = {}
        self._buffers: dict[str, torch.Tensor] | None = None
        self._pool = None
        self._stream = None  # the stream every recording runs on (`_capture_stream`)
        self._give_back_stream = None  # gives `_stream` back to `recording.lend_stream`
        self.graph_steps = 0
        self.eager_steps = 0  # ragged (prefill-carrying) steps; `compiled_prefill_steps` of them ran compiled layers
        self.compiled_prefill_steps = 0
        self.capture_seconds: dict[int, float] = {}  # bucket -> seconds its capture took (the first one compiles)
        self.table_rows_uploaded = 0
        self.last_static = False
        self.compile_failure: str | None = None  # why an automatic compile_decode was given up (`_give_up_compiling`)
        self.graph_failure: str | None = None  # why the decode step runs without CUDA graphs (`_give_up_graphs`)
        self._init_ragged()  # ragged steps replayed from CUDA graphs too (`hf_paged.runner.ragged_graphs`)

    lora: LoraSlots | None = None  # the LoRA adapters' pools and index, once an adapter is added (the engine sets it)

    @property
    def use_cuda_graph(self) -> bool:
        return self.decode_mode == "graph"

    # ------------------------------------------------------------------ block operations
    def apply_block_ops(self, sched: SchedulerOutput) -> None:
        """Swap out, then swap in, then copy-on-write: before this step's forward writes anything."""
        cache = self.cache
        if sched.swap_out:  # every layer group's tensors (`cache.kv_pool.KVPool`)
            gpu, cpu = torch.tensor(sched.swap_out).T
            cache.kv.swap_out(gpu, cpu)
        if sched.swap_in:
            cpu, gpu = torch.tensor(sched.swap_in).T
            cache.kv.swap_in(cpu, gpu)
        cache._copy_blocks(sched.copies)
        cache.apply_state_ops()  # recurrent-state slots: forks, fresh zeros, swaps, checkpoints (hybrid models)

    # ------------------------------------------------------------------ forward
    def execute(self, sched: SchedulerOutput, input_tokens=None,
                extra_rows: list[tuple[int, int, int]] | None = None) -> tuple[torch.Tensor, list[int]]:
        """`_execute` with each token's LoRA adapter slot set for the forward (`hf_paged.runner.lora`)."""
        with self.lora.step(sched) if self.lora is not None else nullcontext():
            return self._execute(sched, input_tokens, extra_rows)

    def _execute(self, sched: SchedulerOutput, input_tokens, extra_rows) -> tuple[torch.Tensor, list[int]]:
        """Run the step; return (logits of the sampling sequences `[S, V]`, their index in `sched.scheduled`).

        `input_tokens = (tokens, rows)`: the step's input token ids are `tokens[rows]`, gathered on the device (the
        previous step's argmax, not yet on the host: a pipelined decode step). Static decode path only.

        `extra_rows`: (index in `sched.scheduled`, offset in its chunk, count) of further positions whose logits are
        wanted (prompt log-probabilities); their rows follow the `S` sampling rows, in order. Such steps run eagerly.
        """
        if sched.preempted or sched.swap_in or sched.swap_out:
            self.invalidate_tables()  # tables were rebuilt or moved: a row's (length, last block) proves nothing
        if not extra_rows and self.static_eligible(sched):
            self.last_static = True
            return self._execute_static(sched, input_tokens)
        if input_tokens is not None:
            raise ValueError("input_tokens needs a decode step on the static path")
        self.last_static = False
        self._last_rows = None  # this step's reservation may change tables the rows' records do not see
        return self._execute_eager(sched, extra_rows)

    def static_eligible(self, sched: SchedulerOutput) -> bool:
        """Whether `execute` runs this step on the static decode buffers (CUDA graph, or "static" on the CPU).

        Every sequence must compute one token and sample: the static path returns one logits row per sequence, so a
        one-token chunk in the middle of a prompt (what is left of the token budget) goes the eager way; so does every
        step while an FP8 pool calibrates its scales (`PagedCache.kv_scales_pending`).
        """
        scheduled = sched.scheduled
        return (self.decode_mode != "eager" and len(scheduled) <= self.max_num_seqs and not self.cache.kv_scales_pending
                and (sched.decode_step or all(item.num_tokens == 1 and item.sample for item in scheduled)))

    def _execute_eager(self, sched: SchedulerOutput, extra_rows: list[tuple[int, int, int]] | None = None,
                       input_tokens=None):
        """The step's forward over the flattened `[1, T]` batch. `input_tokens`: a pipelined decode step that left
        the static path (a table outgrew the store's rows); its ids are the previous step's picks, on the device.
        Where its token bucket has a CUDA graph (or earns one now), the step replays it instead (`_execute_ragged`)."""
        if not extra_rows and input_tokens is None and (bucket := self._ragged_bucket(sched)) is not None:
            replayed = self._execute_ragged(sched, bucket)
            if replayed is not None:
                return replayed
        bm = self.cache.block_manager
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables, lens, q_lens, sample_index, samplers, firsts = [], [], [], [], [], []
        offset = 0
        for k, item in enumerate(sched.scheduled):
            firsts.append(offset)
            end = item.start + item.num_tokens
            ids.extend(item.seq.token_ids[item.start : end])
            positions.extend(range(item.start, end))
            slots.extend(item.slots)
            tables.append(bm.table_view(item.seq.seq_id))
            lens.append(end)
            q_lens.append(item.num_tokens)
            offset += item.num_tokens
            if item.sample:
                sample_index.append(offset - 1)
                samplers.append(k)
        tokens = offset
        if self.pad_ragged and input_tokens is None and any(n != 1 for n in q_lens):
            pad = padded_tokens(offset, self.token_limit) - offset  # rows of no sequence (see `padded_tokens`)
            ids.extend([0] * pad)
            positions.extend([0] * pad)
            slots.extend([-1] * pad)
            tokens += pad
        pin = self.device.type == "cuda"
        step = self.cache._make_step("ragged", slots, tables, lens, q_lens, self.device)
        if self.grouped:
            self.cache.attach_group_steps(step, sched.scheduled, tokens)
        if self.hybrid:  # each sequence's recurrent-state slot, and its rows (`hf_paged.attention.recurrent`)
            state_slots = int_tensor(bm.state.slots([item.seq.seq_id for item in sched.scheduled]), torch.long, pin=pin)
            step.state_slots = state_slots.to(self.device, non_blocking=True)
            step.state_rows = [(first, item.num_tokens, item.start > 0) for first, item in zip(firsts, sched.scheduled)]
        self.cache.set_engine_step(step)
        if input_tokens is None:
            input_ids = int_tensor(ids, torch.long, pin=pin)[None].to(self.device, non_blocking=True)
        else:  # one token a row, each from the previous step's picks (its placeholder is all the host has)
            src = torch.as_tensor(np.asarray(input_tokens[1], dtype=np.int64)).to(self.device, non_blocking=True)
            input_ids = torch.index_select(input_tokens[0], 0, src)[None]
        position_ids = int_tensor(positions, torch.long, pin=pin)[None].to(self.device, non_blocking=True)
        rows = sample_index + [firsts[k] + at for k, first, count in extra_rows or () for at in
                               range(first, first + count)]
        kept = rows or [offset - 1]
        if self.pad_ragged:  # the output projection at a decode bucket's row count (`shapes.padded_rows`)
            kept = padded_rows(kept, self._bucket_sizes)
        keep = torch.tensor(kept, dtype=torch.long).to(self.device)
        with self._prefill_layers(tokens):
            output = self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=self.cache,
                                use_cache=True, logits_to_keep=keep)
        self.eager_steps += 1
        logits = output.logits[0]
        return logits[: len(rows)], samplers

    def _prefill_layers(self, tokens: int):
        """Where this ragged step's decoder layers run: the decode step's compiled layers when they exist, else the
        model's own code.

        Why it pays: a prefill step of a small model is mostly transformers' elementwise code (RMSNorm in float32,
        rotary, the MLP activation: half the GPU time of a Qwen3-0.6B prefill, with the GEMMs a fifth), which the
        compiled layers fuse. Why it costs no compilation: the layers were compiled with a symbolic token dimension
        (the decode batch, `[1, B, H]`) and the attention is one opaque op that picks the prefill kernel for a
        prefill step at run time (`hf_paged.attention.compiled_op`). One-token forwards would specialise that
        dimension (a recompilation), so they stay on the model's code. The first routed step holds the compile lock
        and counts the graphs it compiled: more than a decode step may compile means the layers keep recompiling
        for prefill shapes, and prefill stays eager from then on (`compile_prefill = False`); `Engine.warm_up()` runs
        one dummy routed step, so that check happens at start-up. On an H100 the prefill MFU of Qwen3-0.6B went from
        19 % to 33 % and that of llama-1b's long prompts from 51 % to 63-64 % (by the MFU count of the time).
        """
        if tokens < 2 or not self._prefill_routable():
            return nullcontext()
        return self._compiled_prefill(self._compiled, tokens)

    def _prefill_routable(self) -> bool:
        """Prefill may run through compiled layers: asked for, regional, compiled for a symbolic batch, not hybrid."""
        return (self.compile_prefill and not self.hybrid and isinstance(self._compiled, CompiledLayers)
                and True in self._compiled_kinds)

    @contextmanager
    def _compiled_prefill(self, compiled: CompiledLayers, tokens: int) -> Iterator[None]:
        from torch._dynamo.utils import counters

        first = not self._prefill_checked
        graphs = counters["stats"]["unique_graphs"]
        try:
            with active_cache(self.cache), _COMPILE_LOCK if first else nullcontext(), \
                    compiled.active(tokens, extras=False):
                yield
        finally:
            self.cache._engine_step_pending = False  # the compiled layers never call `update`, which clears it
        self.compiled_prefill_steps += 1
        if first:
            self._prefill_checked = True
            if counters["stats"]["unique_graphs"] - graphs > compiled.max_graphs:
                self.compile_prefill = False

    @property
    def model(self):
        return self.model_ref()

    # ------------------------------------------------------------------ static decode buffers, CUDA graphs
    def _ensure_buffers(self) -> None:
        if self._buffers is not None:
            return
        n, mb, dev = self.max_num_seqs, self.max_blocks_per_seq, self.device
        pin = dev.type == "cuda"
        # one int64 buffer for the per-row vectors, so a step uploads them with a single copy: row 0 token ids,
        # 1 positions, 2 slot mapping, 3 sequence lengths, 4 table-store rows, 5 rows of the previous step's tokens
        # to take as input ids (pipelined steps; the kernels accept int64 indices), 6 recurrent-state slots
        meta = torch.zeros((_META_ROWS, n), dtype=torch.long, device=dev)
        self._store_capacity = 2 * n + 1  # every live sequence plus as many finished ones before a sweep
        self._buffers = {
            "meta": meta,
            "ids": meta[0],
            "pos": meta[1],
            "slots": meta[2],
            "lens": meta[3],
            "rows": meta[4],
            "src": meta[5],
            "state": meta[6],
            "tables": torch.zeros((n, mb), dtype=torch.int32, device=dev),
            "store": torch.zeros((self._store_capacity, mb), dtype=torch.int32, device=dev),
            "staging": torch.zeros((n, mb), dtype=torch.int32, device=dev),
            "staging_rows": torch.zeros(n, dtype=torch.long, device=dev),
            # single table entries: flat indices into the store, and their blocks (`_changed_rows`)
            "point_index": torch.zeros(n, dtype=torch.long, device=dev),
            "point_block": torch.zeros(n, dtype=torch.int32, device=dev),
            "cu": torch.arange(n + 1, dtype=torch.int32, device=dev),
            # the fused decode op's split counters (`StepMetadata.split_counters`); each launch leaves them at zero
            "counters": torch.zeros(n * self.cache.max_kv_heads, dtype=torch.int32, device=dev),
        }
        # Host sides of the uploads, twice: a copy from pinned memory is read by the GPU after copy_() returns, and a
        # pipelined step writes its inputs before the step launched just before it has run. Alternating two sets,
        # a set is written again only two launches later, when the engine has waited for the step that used it.
        self._host_sets = [
            {
                "meta": torch.zeros((_META_ROWS, n), dtype=torch.long, pin_memory=pin),
                "staging": torch.zeros((n, mb), dtype=torch.int32, pin_memory=pin),
                "staging_rows": torch.zeros(n, dtype=torch.long, pin_memory=pin),
                "point_index": torch.zeros(n, dtype=torch.long, pin_memory=pin),
                "point_block": torch.zeros(n, dtype=torch.int32, pin_memory=pin),
            }
            for _ in range(2)
        ]
        if self.grouped:
            self._ensure_group_buffers()
        self.invalidate_tables()

    def release(self) -> None:
        """Drop the CUDA graphs, the static buffers and the compiled step (the engine is closing)."""
        self._graphs.clear()
        self._buffers = None
        self._host_sets = []
        self._compiled = None
        self._pool = None
        self._stream = None
        if self._give_back_stream is not None:
            self._give_back_stream()  # the next runner records on it (`recording.lend_stream`)
            self._give_back_stream = None

    def repack(self) -> int:
        """Stack the model's sibling projections again (after `param.data = ...`, `load_state_dict(assign=True)`), so
        the compiled step's one GEMM per group applies; returns the groups packed. Not under tensor parallelism."""
        model = self.model
        packed = pack_siblings([model]) if (getattr(model, "tp_size", None) or 1) == 1 else 0
        if packed:
            for runner in [r for r in list(_RUNNERS) if r is not self and r.model_ref.peek() is model]:
                runner.invalidate_graphs()
        return packed

    def invalidate_graphs(self) -> None:
        """Drop the captured CUDA graphs (the weights moved: the graphs read their old addresses); they are captured
        again when next needed."""
        self._graphs.clear()

    def _step_metadata(self, batch: int) -> StepMetadata:
        b = self._buffers
        step = StepMetadata(
            layout="ragged", slot_mapping=b["slots"][:batch], block_tables=b["tables"][:batch],
            seq_lens=b["lens"][:batch], cu_seqlens_q=b["cu"][: batch + 1], max_seqlen_q=1, decode_only=True,
            split_counters=b["counters"], state_slots=b["state"][:batch] if self.hybrid else None,
        )
        return self._with_group_steps(step, batch) if self.grouped else step

    def _run_model(self, batch: int) -> torch.Tensor:
        """The decode forward over the static buffers (what a graph records): gather the tables, run the model.

        With `compile_decode`, the decoder layers run through their compiled form (`hf_paged.runner.regional`: one
        compilation of the layer code for every layer, symbolic in the batch, so every bucket reuses it); a model
        without a list of repeated layers has its whole forward compiled instead.
        """
        b = self._buffers
        torch.index_select(b["store"], 0, b["rows"][:batch], out=b["tables"][:batch])
        self.cache.set_engine_step(self._step_metadata(batch))
        ids, pos = b["ids"][:batch][None], b["pos"][:batch][None]
        if not self.compile_decode:
            return self._forward(ids, pos)
        if self._compiled is None:
            # regional (each decoder layer's code compiled once for all layers), else the whole forward
            self._compiled = CompiledLayers.of(self.model) or self._compile_whole_forward()
            self._compiled_kinds = set()
        regional = isinstance(self._compiled, CompiledLayers)
        # whether this call may compile: once per kind of call (one row / a symbolic batch)
        kind = batch >= 2
        compiled = kind in self._compiled_kinds
        try:
            with active_cache(self.cache):
                if compiled:
                    return self._call_compiled(ids, pos)
                with _COMPILE_LOCK:
                    from torch._dynamo.utils import counters

                    graphs = counters["stats"]["unique_graphs"]
                    try:
                        logits = self._call_compiled(ids, pos)
                    except Exception as error:
                        if not self.compile_auto:
                            raise
                        self._give_up_compiling(error)
                        self.cache.set_engine_step(self._step_metadata(batch))  # as before the failed call
                        return self._forward(ids, pos)
                    if regional and not self._compiled_kinds \
                            and counters["stats"]["unique_graphs"] - graphs > self._compiled.max_graphs:
                        # the layers kept recompiling (constants that differ per layer): compile the whole forward
                        # instead, now (this call is never inside a graph capture: `_capture` warms up first)
                        self._compiled = self._compile_whole_forward()
                        logits = self._call_compiled(ids, pos)
                self._compiled_kinds.add(kind)
                return logits
        finally:
            self.cache._engine_step_pending = False

    def _compile_whole_forward(self):
        """The whole decode forward compiled as one graph: a copy of its code (`regional.own_code`), so this engine's
        Dynamo cache and recompile limit are its own."""
        return torch.compile(own_code(self._forward), backend=fusing_backend)

    def _give_up_compiling(self, error: Exception) -> None:
        """An automatic `compile_decode` (`Engine(compile_decode=None)` on CUDA) that failed to compile: run the
        model's own code from now on, as `compile_decode=False` would, and say why once. (Every architecture hf-paged
        accepts compiled on an H100; a model whose modules Dynamo cannot trace, e.g. a custom quantised linear,
        might not.)"""
        self.compile_decode = self.compile_prefill = False
        self._compiled = None
        self.cache._defer_write = False
        self._graphs.clear()  # nothing was recorded with the compiled code yet (it compiles before any capture)
        self.compile_failure = f"{type(error).__name__}: {error}"
        warnings.warn(f"hf-paged: the decode step of {type(self.model).__name__} could not be compiled "
                      f"({self.compile_failure.splitlines()[0][:200]}); running the model's own code "
                      "(pass compile_decode=False to skip the attempt)", RuntimeWarning, stacklevel=2)

    def _call_compiled(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        batch = ids.shape[1]
        if isinstance(self._compiled, CompiledLayers):
            with self._compiled.active(batch):
                return self._forward(ids, pos)
        if batch >= 2:  # the whole forward: one trace with a symbolic batch serves every bucket
            torch._dynamo.mark_dynamic(ids, 1)
            torch._dynamo.mark_dynamic(pos, 1)
        return self._compiled(ids, pos)

    def _execute_static(self, sched: SchedulerOutput, input_tokens=None):
        self._ensure_buffers()
        scheduled = sched.scheduled
        real = len(scheduled)
        bucket = next(s for s in self._bucket_sizes if s >= real)
        run = self._graphs.get(bucket, _MISSING)  # one lookup: another runner's repack may clear the dict meanwhile
        if run is _MISSING:
            run = self._graphs[bucket] = self._capture(bucket)
        row_of = self._row_of
        batch = sched.batch
        if batch is not None:  # a pipelined step of a `DecodeBatch`: its rows are in arrays already
            pos, slots, seq_ids = batch.starts, batch.slots, batch.seq_ids
        else:
            pos = [item.start for item in scheduled]
            slots = [item.slots[0] for item in scheduled]
            seq_ids = [item.seq.seq_id for item in scheduled]
        last = self._last_rows
        rows = None
        if sched.decode_step and sched.table_changes is not None and last is not None and last[0] is row_of:
            # the sequences of the last static step, nothing else ran since: only the tables this step's reservation
            # changed (a new block, a copy-on-write) need a look
            if last[1] == seq_ids:
                rows = last[2]
            elif batch is not None:  # or some of them: rows left the batch since (stops, length finishes)
                rows = kept_rows(batch, sched.batch_step, last)
        if rows is not None:
            changed, (flat, blocks), too_long = self._changed_rows(seq_ids, sched.table_changes)
        else:
            rows, changed = self._rows_and_changes(seq_ids)
            rows = np.array(rows, dtype=np.int64)  # kept for the next steps of these sequences: copied, not converted
            flat, blocks, too_long = (), (), False
        if too_long or any(len(t) > self.max_blocks_per_seq for _, t in changed):
            # the rows' records already say what this step would have uploaded: forget them all (re-uploaded next)
            self.invalidate_tables()
            return self._execute_eager(sched, input_tokens=input_tokens)
        self._last_rows = (row_of, seq_ids, rows)
        self._host_sets.reverse()
        host_set = self._host_sets[0]
        host = host_set["meta"].numpy()
        if input_tokens is None:
            host[0, :real] = [item.seq.token_ids[item.start] for item in scheduled]
        else:
            host[5, :real] = input_tokens[1]
        host[1, :real] = pos
        host[2, :real] = slots
        np.add(host[1, :real], 1, out=host[3, :real])
        host[4, :real] = rows
        host[2, real:bucket] = -1
        host[3, real:bucket] = 0
        host[4, real:bucket] = 0
        if self.hybrid:  # recurrent-state slots; a bucket's padding rows write the scratch slot
            host[6, :real] = self.cache.block_manager.state.slots(seq_ids)
            host[6, real:bucket] = self.cache.block_manager.state.scratch
        b = self._buffers
        # whole buffers (a few KB): contiguous pinned copies stay asynchronous, column slices would not
        b["meta"].copy_(host_set["meta"], non_blocking=True)
        self._upload_tables(host_set, changed, flat, blocks)
        if self.grouped:
            self._group_inputs(host_set, seq_ids, pos, slots, rows, changed, flat, real, bucket, batch,
                               sched.table_changes)
        if input_tokens is not None:  # after the meta upload, which carries no ids for these rows
            torch.index_select(input_tokens[0], 0, b["src"][:real], out=b["ids"][:real])
        logits = run() if run is not None else self._run_model(bucket)
        self.graph_steps += 1
        return logits[:real], list(range(real))
