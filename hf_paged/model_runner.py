"""Turn a scheduler decision into one model forward: inputs, block operations, CUDA graphs.

Prefill-carrying steps run eagerly over the flattened `[1, T]` batch. Decode-only steps on CUDA replay a CUDA graph
captured for the next larger batch-size bucket: the graph reads persistent device buffers (token ids, positions, slot
mapping, block tables, sequence lengths) that each step refills with one host-to-device copy per buffer, so a decode
step costs a handful of copies and one graph launch instead of hundreds of kernel launches from Python.
Rows of a bucket beyond the real batch write nowhere (slot -1) and attend to nothing (length 0).
"""

from __future__ import annotations

import torch

from .cache import PagedCache, StepMetadata
from .scheduler import SchedulerOutput

__all__ = ["ModelRunner"]


def _buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8]
    size = 16
    while size < max_batch:
        sizes.append(size)
        size += 16 if size < 128 else 32
    sizes.append(max_batch)
    return sorted(set(s for s in sizes if s <= max_batch))


class ModelRunner:
    def __init__(
        self,
        model,
        cache: PagedCache,
        *,
        max_num_seqs: int,
        max_model_len: int | None,
        use_cuda_graph: bool | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.block_size
        self.max_num_seqs = max_num_seqs
        if use_cuda_graph is None:
            use_cuda_graph = self.device.type == "cuda"
        if use_cuda_graph and self.device.type != "cuda":
            raise ValueError("use_cuda_graph=True needs the model on a CUDA device")
        self.use_cuda_graph = use_cuda_graph
        max_len = max_model_len or 8192
        self.max_blocks_per_seq = -(-max_len // self.block_size)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._buffers = None
        self._pool = None
        self.graph_steps = 0
        self.eager_steps = 0

    # ------------------------------------------------------------------ block operations
    def apply_block_ops(self, sched: SchedulerOutput) -> None:
        """Swap out, then swap in, then copy-on-write: before this step's forward writes anything."""
        cache = self.cache
        if sched.swap_out:
            gpu = torch.tensor([g for g, _ in sched.swap_out], device=self.device)
            cpu = torch.tensor([c for _, c in sched.swap_out])
            cache.cpu_pool[:, :, cpu] = cache.pool[:, :, gpu].to("cpu")
        if sched.swap_in:
            cpu = torch.tensor([c for c, _ in sched.swap_in])
            gpu = torch.tensor([g for _, g in sched.swap_in], device=self.device)
            cache.pool[:, :, gpu] = cache.cpu_pool[:, :, cpu].to(self.device, non_blocking=True)
        cache._copy_blocks(sched.copies)

    # ------------------------------------------------------------------ forward
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Run the step; return (logits of the sampling sequences `[S, V]`, their index in `sched.scheduled`)."""
        scheduled = sched.scheduled
        decode_only = all(item.num_tokens == 1 for item in scheduled)
        if self.use_cuda_graph and decode_only and len(scheduled) <= self.max_num_seqs:
            return self._execute_graph(sched)
        return self._execute_eager(sched)

    def _execute_eager(self, sched: SchedulerOutput):
        self.invalidate_tables()
        bm = self.cache.block_manager
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables, lens, q_lens, sample_index, samplers = [], [], [], [], []
        offset = 0
        for k, item in enumerate(sched.scheduled):
            end = item.start + item.num_tokens
            ids.extend(item.seq.token_ids[item.start : end])
            positions.extend(range(item.start, end))
            slots.extend(item.slots)
            tables.append(bm.block_table(item.seq.seq_id))
            lens.append(end)
            q_lens.append(item.num_tokens)
            offset += item.num_tokens
            if item.sample:
                sample_index.append(offset - 1)
                samplers.append(k)
        step = self.cache._make_step("ragged", slots, tables, lens, q_lens, self.device)
        self.cache.set_engine_step(step)
        input_ids = torch.tensor([ids], dtype=torch.long).to(self.device, non_blocking=True)
        position_ids = torch.tensor([positions], dtype=torch.long).to(self.device, non_blocking=True)
        keep = torch.tensor(sample_index if sample_index else [offset - 1], dtype=torch.long).to(self.device)
        output = self.model(
            input_ids=input_ids, position_ids=position_ids, past_key_values=self.cache, use_cache=True,
            logits_to_keep=keep,
        )
        self.eager_steps += 1
        logits = output.logits[0]
        return (logits if sample_index else logits[:0]), samplers

    # ------------------------------------------------------------------ CUDA graphs
    def _ensure_buffers(self) -> None:
        if self._buffers is not None:
            return
        n, mb, dev = self.max_num_seqs, self.max_blocks_per_seq, self.device
        # one int64 buffer for the per-row vectors, so a step uploads them with a single copy:
        # row 0 token ids, 1 positions, 2 slot mapping, 3 sequence lengths (the kernels accept int64 indices)
        meta = torch.zeros((4, n), dtype=torch.long, device=dev)
        self._buffers = {
            "meta": meta,
            "ids": meta[0],
            "pos": meta[1],
            "slots": meta[2],
            "lens": meta[3],
            "tables": torch.zeros((n, mb), dtype=torch.int32, device=dev),
            "cu": torch.arange(n + 1, dtype=torch.int32, device=dev),
        }
        self._host_meta = torch.zeros((4, n), dtype=torch.long).pin_memory()
        self._host_view = self._host_meta.numpy()
        self._row_keys: list[tuple | None] = [None] * n  # what each device block-table row holds

    def invalidate_tables(self) -> None:
        """Forget which block tables the device rows hold (after preemption, swaps or an eager step)."""
        if self._buffers is not None:
            self._row_keys = [None] * self.max_num_seqs

    def _graph_step(self, batch: int) -> StepMetadata:
        b = self._buffers
        return StepMetadata(
            layout="ragged", slot_mapping=b["slots"][:batch], block_tables=b["tables"][:batch],
            seq_lens=b["lens"][:batch], cu_seqlens_q=b["cu"][: batch + 1], max_seqlen_q=1, decode_only=True,
        )

    def _run_model(self, batch: int) -> torch.Tensor:
        b = self._buffers
        self.cache.set_engine_step(self._graph_step(batch))
        out = self.model(
            input_ids=b["ids"][:batch][None], position_ids=b["pos"][:batch][None], past_key_values=self.cache,
            use_cache=True, logits_to_keep=0,
        )
        return out.logits[0]

    def _capture(self, batch: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Record one decode forward of `batch` rows (dummy rows: slot -1, length 0: no writes, no reads)."""
        b = self._buffers
        b["slots"].fill_(-1)
        b["lens"].zero_()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up (Triton autotuning / lazy init) outside the graph
                self._run_model(batch)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._run_model(batch)
        return graph, logits

    def capture_all(self) -> None:
        """Capture every bucket up front (largest first, sharing one memory pool)."""
        self._ensure_buffers()
        with torch.inference_mode():
            for batch in sorted(_buckets(self.max_num_seqs), reverse=True):
                if batch not in self._graphs:
                    self._graphs[batch] = self._capture(batch)
        torch.cuda.synchronize(self.device)

    def _execute_graph(self, sched: SchedulerOutput):
        self._ensure_buffers()
        scheduled = sched.scheduled
        real = len(scheduled)
        bucket = next(s for s in _buckets(self.max_num_seqs) if s >= real)
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
            self.invalidate_tables()
        if sched.preempted or sched.swap_in or sched.swap_out:
            self.invalidate_tables()
        graph, logits = self._graphs[bucket]
        bm = self.cache.block_manager
        ids, pos, slots, lens = [], [], [], []
        changed_rows, changed_tables = [], []
        row_keys = self._row_keys
        for k, item in enumerate(scheduled):
            seq = item.seq
            start = item.start
            ids.append(seq.token_ids[start])
            pos.append(start)
            slots.append(item.slots[0])
            lens.append(start + 1)
            table = bm.block_table(seq.seq_id)
            # a running sequence's table only grows or has its last block replaced (copy-on-write) between
            # two graph steps; anything else (preemption, swap, eager steps) invalidates every row
            key = (seq.seq_id, len(table), table[-1])
            if row_keys[k] != key:
                row_keys[k] = key
                changed_rows.append(k)
                changed_tables.append(table)
        for k in range(real, bucket):
            row_keys[k] = None
        width = max((len(t) for t in changed_tables), default=0)
        if width > self.max_blocks_per_seq:
            self.invalidate_tables()
            return self._execute_eager(sched)
        host = self._host_view
        host[0, :real] = ids
        host[1, :real] = pos
        host[2, :real] = slots
        host[3, :real] = lens
        host[2, real:bucket] = -1
        host[3, real:bucket] = 0
        dev = self._buffers
        dev["meta"][:, :bucket].copy_(self._host_meta[:, :bucket], non_blocking=True)
        if changed_rows:
            rows = torch.tensor([t + [0] * (width - len(t)) for t in changed_tables], dtype=torch.int32)
            index = torch.tensor(changed_rows, dtype=torch.long)
            if len(changed_rows) == changed_rows[-1] + 1:  # a prefix of rows: plain slice copy
                dev["tables"][: len(changed_rows), :width].copy_(rows, non_blocking=True)
            else:
                dev["tables"][index.to(self.device, non_blocking=True), :width] = rows.to(self.device, non_blocking=True)
        graph.replay()
        self.graph_steps += 1
        return logits[:real], list(range(real))
