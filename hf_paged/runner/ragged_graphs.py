"""CUDA graphs of ragged steps (prompts prefilled, alone or beside running decodes): one recording per token bucket.

Why: such a step ran the compiled layers one call at a time with the host in the loop. For llama-1b on an H100 that
was ~27 ms of host time a step with the GPU idle ~90 % of it (`benchmarks/results/h100_2026-11-26i/`, call f), and an
engine with a backlog (or a server under steady arrivals) takes such a step every few decode steps, which take ~2 ms.
Replayed from a graph, the step costs its uploads and one launch.

What makes a ragged step recordable is that every launch's shape depends on the bucket alone:

* token tensors (ids, positions, slots) are padded to the bucket `T` (`graph_tokens`): padding rows write nowhere
  (slot -1), attend to nothing and are not kept;
* the prefill kernel's grid is `(query tiles, KV heads, sequences)`, and the step's sequences and their query lengths
  vary. The graph launches it over "virtual sequences" of one query tile each, as many as the bucket can need
  (`ceil(T / tile) + min(T, max_num_seqs)`): every sequence of the step is cut into pieces of at most `tile` queries
  (the kernel's own tile, `kernels.prefill_query_tile`), each a virtual sequence with its parent's block table and
  the length up to its last query. A query attends to the keys up to its own position either way, so the output is
  the same; the unused virtual sequences have no queries;
* the logits of `min(T, max_num_seqs)` rows are kept (the sampling rows, then padding) and copied into one buffer
  that every bucket shares: each graph holding its own `[rows, vocab]` output would cost ~65 MB a bucket.

A bucket runs on these buffers without a graph the first time it comes up, and is recorded right after its second
run (`ragged_capture_after`), which serves as the recording's warm-up; from then on it is replayed. A recording costs
about one eager step of host time (~22 ms for llama-1b), and a size seen once costs none. Steps above
`ragged_graph_tokens` tokens, steps that want prompt log-probabilities, and pipelined steps that left the decode path
stay eager, as do ragged steps under tensor parallelism. Block tables come from the decode path's device-side table
store (`TableStore`), so a sequence's table is uploaded once and then only when it changes. A recording that raises
turns the path off with a warning (`ragged_graph_failure`). `Engine.warm_up(prefill_graphs=True)` (what `hf-paged
serve` does) records every bucket up front instead (`record_ragged_buckets`, each after one run on rows that write
and read nothing), largest first, on the runner's one recording stream, so the smaller buckets carve their
activations out of the largest one's blocks: llama-1b's 48 buckets took 0.3 GiB (`graphs._capture_stream`).
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch

from .. import kernels
from ..cache import StepMetadata, attention_heads, layer_kv_shapes
from ..core import SchedulerOutput
from . import recording
from .graphs import replayer

__all__ = ["RaggedGraphs", "graph_tokens"]

#: most tokens of a ragged step replayed from a graph; above, the GPU time of a step outweighs its host time (a
#: llama-8b step of 4,096 tokens is ~60 ms of GEMMs)
RAGGED_GRAPH_TOKENS = 4096


def graph_tokens(tokens: int, limit: int | None = None) -> int:
    """The bucket a ragged step of `tokens` tokens is recorded at: a multiple of 16 up to 256, then of 32, 64, 128 and
    256 up to 512, 1,024, 2,048 and above (less than 1/8 padding above 256 tokens; 48 buckets up to 4,096), never
    past `limit` (the token budget the activations were sized for) unless `tokens` already is."""
    grain = 16 if tokens <= 256 else 32 if tokens <= 512 else 64 if tokens <= 1024 else 128 if tokens <= 2048 else 256
    padded = -(-tokens // grain) * grain
    return max(tokens, min(padded, limit)) if limit is not None else padded


class RaggedGraphs:
    """Mixed into `ModelRunner` (which provides the model, the cache, the compiled layers, the table store and the
    memory pool of the decode graphs)."""

    def _init_ragged(self) -> None:
        # None: on where the decode step is replayed from CUDA graphs (not under tensor parallelism); True also runs
        # the path without graphs on the static buffers (what the CPU tests cover); False: ragged steps stay eager
        self.ragged_graphs: bool | None = None
        self.ragged_graph_tokens = RAGGED_GRAPH_TOKENS
        self.ragged_capture_after = 1  # a bucket is recorded right after its (ragged_capture_after + 1)-th run
        self.ragged_graph_steps = 0  # ragged steps run on the ragged buffers
        self.ragged_graph_replays = 0  # of which replayed a bucket's recording
        self.ragged_graph_failure: str | None = None  # why ragged steps stopped being recorded
        self._ragged_seen: dict[int, int] = {}
        self._ragged_tile: int | None = None
        self._ragged_out: dict = {}  # (vocab, dtype) -> the logits buffer every bucket's graph copies into
        self.ragged_capture_seconds: dict[int, float] = {}  # bucket -> seconds its recording took
        self.ragged_dummy_recorded: set[int] = set()  # buckets recorded on dummy rows (`_record_dummy`)

    # ------------------------------------------------------------------ eligibility
    def _ragged_enabled(self) -> bool:
        if self.hybrid:  # a hybrid model's ragged step calls its recurrent layers once per chunk: never recorded
            return False
        mode = self.ragged_graphs
        if mode is None:
            mode = self.decode_mode == "graph" and (getattr(self.model, "tp_size", None) or 1) == 1
        # the compiled layers ran a ragged step already (`_compiled_prefill` checked they do not recompile)
        return bool(mode) and self._prefill_routable() and self._prefill_checked

    def _ragged_bucket(self, sched: SchedulerOutput) -> int | None:
        """The bucket this ragged step runs at on the ragged buffers, or None when it runs eagerly (also while an FP8
        pool calibrates its scales: the calibration runs in eager steps only)."""
        if not self._ragged_enabled() or len(sched.scheduled) > self.max_num_seqs or self.cache.kv_scales_pending:
            return None
        tokens = sum(item.num_tokens for item in sched.scheduled)
        bucket = graph_tokens(tokens, self.token_limit)
        return bucket if 2 <= tokens and bucket <= self.ragged_graph_tokens else None

    # ------------------------------------------------------------------ buffers
    def _ragged_sizes(self, bucket: int) -> tuple[int, int]:
        """(virtual sequences, kept logits rows) a bucket's graph is recorded for."""
        rows = min(bucket, self.max_num_seqs)
        return -(-bucket // self._ragged_tile) + rows, rows

    def _ensure_ragged(self) -> None:
        self._ensure_buffers()
        if "ragged" in self._host_sets[0]:
            return
        if self._ragged_tile is None:
            heads, _ = attention_heads(self.cache.config)  # (whole model: the group sizes are every rank's)
            # layers of different shapes (`cache.kv_pool`) may tile differently: a piece must fit every layer's tile
            self._ragged_tile = min(
                kernels.prefill_query_tile(heads, s.kv_heads, s.key_dim, self.device, self.cache.compute_dtype)
                for s in set(layer_kv_shapes(self.cache.config)))
        t = self._ragged_capacity = self.ragged_graph_tokens  # set `ragged_graph_tokens` before the first ragged step
        nv, rows = self._ragged_sizes(t)
        # two flat buffers, one upload each a step. The kernels' index vectors are int32, as the eager path makes them:
        # Triton compiles a kernel per argument dtype (and per 16-byte alignment), and the eager steps' variants are
        # the ones `warm_up` compiled; the token ids and positions (and the gathers' indices) are int64
        spans = {torch.long: {"ids": t, "pos": t, "vrows": nv, "keep": rows},
                 torch.int32: {"slots": t, "cu": nv + 1, "lens": nv}}
        pin = self.device.type == "cuda"
        self._ragged_offsets, self._ragged_flat, self._ragged = {}, {}, {}
        for dtype, fields in spans.items():
            at = 0
            for name, size in fields.items():
                self._ragged_offsets[name] = (dtype, at, size)
                at += -(-size // 16) * 16  # every vector 64-byte aligned
            flat = self._ragged_flat[dtype] = torch.zeros(at, dtype=dtype, device=self.device)
            self._ragged.update({name: flat[a : a + n] for name, (d, a, n) in self._ragged_offsets.items()
                                 if d is dtype})
            for host_set in self._host_sets:
                host_set.setdefault("ragged", {})[dtype] = torch.zeros(at, dtype=dtype, pin_memory=pin)
        self._ragged["tables"] = torch.zeros((nv, self.max_blocks_per_seq), dtype=torch.int32, device=self.device)
        for host_set in self._host_sets:  # the named vectors of each set, as numpy views (made once, not per step)
            flats = {dtype: tensor.numpy() for dtype, tensor in host_set["ragged"].items()}
            host_set["ragged_views"] = {name: flats[dtype][a : a + n]
                                        for name, (dtype, a, n) in self._ragged_offsets.items()}
        if self.grouped:  # a grouped cache's other layer groups (`group_static`)
            self._ensure_ragged_groups(t, nv)

    # ------------------------------------------------------------------ the step
    def _execute_ragged(self, sched: SchedulerOutput, bucket: int) -> tuple[torch.Tensor, list[int]] | None:
        """Run the ragged step on the ragged buffers, from its bucket's graph where there is one (see the module
        docstring); None if it must run eagerly."""
        self._ensure_ragged()
        if bucket > self._ragged_capacity:
            return None
        run = self._graphs.get(("ragged", bucket))
        if run is None and self.decode_mode == "graph" and self._ragged_seen.get(bucket, 0) >= self.ragged_capture_after:
            largest = graph_tokens(self._ragged_top(), self.token_limit)  # (a recording is due after this step)
            if largest != bucket and ("ragged", largest) not in self._graphs and not self._record_dummy(largest):
                return None  # the prefill cannot be recorded (warned): this step and the later ones run eagerly
        scheduled = sched.scheduled
        seq_ids = [item.seq.seq_id for item in scheduled]
        rows, changed = self._rows_and_changes(seq_ids)
        if any(len(table) > self.max_blocks_per_seq for _, table in changed):
            self.invalidate_tables()  # the records already say what this step would have uploaded
            return None
        self._host_sets.reverse()
        host_set = self._host_sets[0]
        samplers = self._fill_ragged(host_set["ragged_views"], scheduled, rows, bucket)
        for dtype, flat in self._ragged_flat.items():
            flat.copy_(host_set["ragged"][dtype], non_blocking=True)
        self._upload_tables(host_set, changed, (), ())
        if self.grouped:
            self._ragged_group_inputs(host_set, scheduled, rows, changed, bucket)
        if run is not None:
            logits = run()
            self.ragged_graph_replays += 1
        else:  # the forward itself; in graph mode, it also warms up the recording made right after it
            logits = self._ragged_forward(bucket)
            if self.decode_mode == "graph":
                seen = self._ragged_seen[bucket] = self._ragged_seen.get(bucket, 0) + 1
                if seen > self.ragged_capture_after:
                    self._capture_ragged(bucket, logits)
        self.ragged_graph_steps += 1
        self.eager_steps += 1
        return logits[: len(samplers)], samplers

    def _fill_ragged(self, view: dict[str, np.ndarray], scheduled, rows: list[int], bucket: int) -> list[int]:
        """Write the step's rows into the host buffers (padding included); return the sampling items' indices."""
        nv, kept = self._ragged_sizes(bucket)
        ids, pos, slots = view["ids"], view["pos"], view["slots"]
        q_lens = np.empty(len(scheduled), dtype=np.int64)
        ends = np.empty(len(scheduled), dtype=np.int64)
        keep, samplers = [], []
        at = 0
        for k, item in enumerate(scheduled):
            n, start = item.num_tokens, item.start
            end = start + n
            if n == 1:  # a running decode: scalars (most rows of a mixed step)
                ids[at], pos[at], slots[at] = item.seq.token_ids[start], start, item.slots[0]
            else:
                ids[at : at + n] = item.seq.token_ids[start:end]
                pos[at : at + n] = np.arange(start, end)
                slots[at : at + n] = item.slots
            q_lens[k], ends[k] = n, end
            at += n
            if item.sample:
                keep.append(at - 1)
                samplers.append(k)
        ids[at:bucket] = 0
        pos[at:bucket] = 0
        slots[at:bucket] = -1
        # virtual sequences: each sequence cut into pieces of at most `tile` queries, in order (cu_seqlens ascend)
        tile = self._ragged_tile
        pieces = -(-q_lens // tile)
        parent = np.repeat(np.arange(len(scheduled)), pieces)
        index = np.arange(parent.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        first = np.cumsum(q_lens) - q_lens  # each sequence's first row in the step
        starts = first[parent] + index * tile
        lengths = np.minimum(tile, q_lens[parent] - index * tile)
        real = parent.size
        cu, lens, vrows = view["cu"], view["lens"], view["vrows"]
        cu[:real] = starts
        cu[real : nv + 1] = at  # no queries: the unused virtual sequences
        lens[:real] = ends[parent] - q_lens[parent] + index * tile + lengths
        lens[real:nv] = 0
        vrows[:real] = np.asarray(rows, dtype=np.int64)[parent]
        vrows[real:nv] = 0
        view["keep"][: len(keep)] = keep
        view["keep"][len(keep) : kept] = 0
        return samplers

    def _ragged_forward(self, bucket: int) -> torch.Tensor:
        """The model's forward over the ragged buffers at `bucket` tokens (what a graph records): `[K, vocab]`."""
        r = self._ragged
        nv, kept = self._ragged_sizes(bucket)
        torch.index_select(self._buffers["store"], 0, r["vrows"][:nv], out=r["tables"][:nv])
        step = StepMetadata(
            layout="ragged", slot_mapping=r["slots"][:bucket], block_tables=r["tables"][:nv], seq_lens=r["lens"][:nv],
            cu_seqlens_q=r["cu"][: nv + 1], max_seqlen_q=self._ragged_tile, decode_only=False)
        self.cache.set_engine_step(self._with_ragged_group_steps(step, nv, bucket) if self.grouped else step)
        with self._compiled_prefill(self._compiled, bucket):
            output = self.model(input_ids=r["ids"][:bucket][None], position_ids=r["pos"][:bucket][None],
                                past_key_values=self.cache, use_cache=True, logits_to_keep=r["keep"][:kept])
        return output.logits[0]

    def record_ragged_buckets(self, max_tokens: int | None = None) -> int:
        """Record now every bucket of up to `max_tokens` tokens (default and cap: `ragged_graph_tokens`, and the token
        budget) that has no recording yet, the largest first; return how many were recorded. Nothing when ragged steps
        are not replayed from graphs here (no CUDA graphs, tensor parallelism, a model whose prefill is not compiled,
        turned off).

        Why: a bucket is otherwise recorded while serving, after its second run, so a server's first prompts of each
        size pay an eager step and the recording (~40 ms for llama-1b on an H100, against ~3 ms replayed). Each
        bucket runs once on rows that write and read nothing (`_record_dummy`), which warms it up as its second run
        would, and is recorded: a recording depends on its bucket's shapes alone, and every later step of the bucket
        fills the same buffers."""
        if self.decode_mode != "graph" or not self._ragged_enabled():
            return 0
        self._ensure_ragged()
        top = self._ragged_top(max_tokens)
        buckets = sorted({graph_tokens(t, self.token_limit) for t in range(2, top + 1)}, reverse=True)
        recorded = 0
        for bucket in buckets:
            if bucket <= top and ("ragged", bucket) not in self._graphs:
                if not self._record_dummy(bucket):
                    break  # the prefill cannot be recorded (warned): the path is off
                recorded += 1
        return recorded

    def _ragged_top(self, max_tokens: int | None = None) -> int:
        """The most tokens a recorded ragged step can have: no step has more than the token budget."""
        cap = self.ragged_graph_tokens
        return min(self._ragged_capacity, cap, max_tokens or cap, self.token_limit or cap)

    def _record_dummy(self, bucket: int) -> bool:
        """Run `bucket` once on rows that write and read nothing (every slot -1, no virtual sequence has a query) and
        record it; return whether it was recorded.

        Also what a lazily recorded bucket does first when the largest bucket has no recording yet
        (`_execute_ragged`). Why the largest first: the recordings share one memory pool (and one stream:
        `_capture_stream`), and a recording reuses memory that earlier ones freed only where it fits in their blocks;
        recorded from the largest down, each smaller bucket carves its activations out of the blocks the largest
        left. On an H100, llama-1b's 48 buckets take 0.3 GiB of pool this way, at warm-up or while serving."""
        self._ensure_ragged()
        cuda = self.device.type == "cuda"
        if cuda:  # no upload of an earlier step still reads the host buffers
            recording.device_synchronize(self.device)
        host_set = self._host_sets[0]
        self._fill_ragged(host_set["ragged_views"], [], [], bucket)  # a step of no rows: all padding
        try:
            with torch.inference_mode():  # (the buffers are inference tensors: a step made them)
                for dtype, flat in self._ragged_flat.items():
                    flat.copy_(host_set["ragged"][dtype])  # synchronous: the next step rewrites the host buffers
                if self.grouped:  # (every layer group's slots)
                    self._ragged["group_slots"].fill_(-1)
                logits = self._ragged_forward(bucket)
        except Exception as error:  # noqa: BLE001 - as a failed recording: ragged steps run eagerly from now on
            self._give_up_ragged(error)
            return False
        with torch.inference_mode():  # as a step's recording: the compiled layers' guards include the grad mode
            self._capture_ragged(bucket, logits)
        del logits
        if cuda:
            recording.device_synchronize(self.device)
        if ("ragged", bucket) not in self._graphs:
            return False
        self.ragged_dummy_recorded.add(bucket)
        return True

    def _capture_ragged(self, bucket: int, logits: torch.Tensor) -> None:
        """Record the bucket's forward (over the step's rows, which it has just run: no warm-up needed) in the decode
        graphs' memory pool. Recording executes nothing, so the step's own `logits` stand.

        Captured with `capture_begin` rather than `torch.cuda.graph`, whose entry empties the caching allocator and
        the pinned host cache: every eager step after it would allocate its memory from CUDA again."""
        start = time.perf_counter()
        _, kept = self._ragged_sizes(bucket)
        out_key = (logits.shape[-1], logits.dtype)
        if out_key not in self._ragged_out:
            self._ragged_out[out_key] = torch.empty((self.max_num_seqs, logits.shape[-1]), dtype=logits.dtype,
                                                    device=self.device)
        out = self._ragged_out[out_key][:kept]
        pool = self._graph_pool()
        stream = self._capture_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        try:
            with recording.RECORDING, torch.cuda.stream(stream):
                graph.capture_begin(pool, capture_error_mode=recording.CAPTURE_ERROR_MODE)
                try:
                    out.copy_(self._ragged_forward(bucket))  # the forward's own logits go back to the pool
                finally:
                    graph.capture_end()
        except Exception as error:  # noqa: BLE001 - ragged steps run eagerly from now on
            self._give_up_ragged(error)
            return
        self._graphs[("ragged", bucket)] = replayer(graph, out)
        self.ragged_capture_seconds[bucket] = time.perf_counter() - start

    def _give_up_ragged(self, error: Exception) -> None:
        """Ragged steps run eagerly from now on: this model's ragged forward cannot be recorded (host work in it)."""
        try:
            recording.device_synchronize(self.device)
        except Exception:  # noqa: BLE001 - the warning below names the capture's error
            pass
        for key in [k for k in self._graphs if isinstance(k, tuple)]:
            del self._graphs[key]
        self.ragged_graphs = False
        self.ragged_graph_failure = f"{type(error).__name__}: {error}"
        warnings.warn(f"hf-paged: the prefill steps of {type(self.model).__name__} cannot be recorded in a CUDA "
                      f"graph ({self.ragged_graph_failure.splitlines()[0][:200]}); running them eagerly",
                      RuntimeWarning, stacklevel=2)
