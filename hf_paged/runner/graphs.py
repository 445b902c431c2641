"""CUDA graphs of the decode step: one recording per batch bucket, and the way back when a model cannot be recorded.

A graph replays the decode forward over the runner's static buffers (ids, positions, slots, lengths, table rows)
with no host work per kernel. All buckets share one memory pool, captured largest first. A model whose forward does
host work (a copy from an unpinned CPU tensor, a `.tolist()`: Gemma3n, X-MOD, Aria text, mixture-of-experts layers in
float32) runs eagerly but cannot be recorded: the runner then decodes on the same static buffers without graphs
(`_give_up_graphs`: `decode_mode = "static"`, still pipelined, compiled layers kept), with a warning and
`graph_failure` set, instead of failing every request as such models did before.
"""

from __future__ import annotations

import time
import warnings

import torch

from . import recording

__all__ = ["GraphCapture", "decode_forward", "replayer"]


def decode_forward(model_ref, cache):
    """The model's forward of one decode step over `cache` (the step's metadata set already), returning `[B, V]`.

    A closure over the model reference and the cache, not a method: the compiled form is kept by the runner, and a
    bound method would make a runner <-> compiled-function reference cycle (see `Engine.warm_up`'s `gc.freeze`).
    """

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        out = model_ref()(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True,
                          logits_to_keep=0)
        return out.logits[0]

    return forward


def replayer(graph: torch.cuda.CUDAGraph, out: torch.Tensor):
    """A callable that replays `graph` and returns its static output `out` (it holds no reference to the runner: no
    reference cycle keeps a dropped engine alive)."""

    def replay(graph=graph, out=out):
        graph.replay()
        return out

    return replay


class GraphCapture:
    """Mixed into `ModelRunner` (which provides the buffers, `_run_model`, the bucket sizes and the model)."""

    def _dummy_rows(self) -> None:
        """Fill the static buffers with dummy rows (slot -1, length 0, table row 0): no writes, no reads."""
        b = self._buffers
        b["slots"].fill_(-1)
        if "group_slots" in b:  # a grouped cache's other layer groups (`group_static`)
            b["group_slots"].fill_(-1)
        b["lens"].zero_()
        b["rows"].zero_()
        if self.hybrid:  # recurrent states: every row reads and writes the scratch slot, never a sequence's
            b["state"].fill_(self.cache.block_manager.state.scratch)

    def _capture(self, batch: int):
        """Record one decode forward of `batch` rows (dummy rows: slot -1, length 0: no writes, no reads).

        Every bucket runs its forward once outside the graph first, not only the first one recorded: recorded without
        it, the buckets after the first replayed about 5 % slower on an H100 (llama-1b compiled: 1,283 against 1,213
        us at 2 rows, 1,665 against 1,607 at 256, the same in two processes each; `benchmarks/results/h100_2026-11-27f`),
        for the 0.4 s of a warm start those forwards cost."""
        self._dummy_rows()
        if self.decode_mode != "graph":
            if self.compile_decode:
                with torch.inference_mode():
                    self._run_model(batch)  # compile now (warm_up), not in a serving step
            return None  # no graph: `_execute_static` runs `_run_model` (no closure over self: no reference cycle)
        stream = self._capture_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._run_model(batch)  # warm up (Triton compilation, lazy init) outside the graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:  # (`torch.cuda.graph` syncs the device and empties the allocator's cache first)
            with recording.RECORDING, torch.cuda.graph(graph, pool=self._graph_pool(), stream=stream,
                                                       capture_error_mode=recording.CAPTURE_ERROR_MODE):
                logits = self._run_model(batch)
        except Exception as error:  # the forward ran above, outside a capture: it is not capturable
            self._give_up_graphs(error)
            return None
        return replayer(graph, logits)

    def _graph_pool(self):
        """The memory pool every graph of this runner (decode and ragged) is recorded in."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def _capture_stream(self) -> torch.cuda.Stream:
        """The stream every recording of this runner (decode and ragged) runs on.

        One stream, not a new one per recording: the caching allocator hands a freed block only to allocations on
        the stream that allocated it, so recordings on streams of their own could not reuse each other's memory in
        the shared pool. Recorded that way (each prefill bucket on a stream of its own), a llama-1b server's pool
        grew by 3.8-4.0 GiB on an H100 as its buckets were recorded, against 0.3 GiB on one stream
        (`hf_paged.runner.ragged_graphs`). The stream is lent by `recording.lend_stream` and given back by
        `release` (or when the runner is dropped), so the next runner records on it: cuBLAS's workspace for it
        (33 MiB) is not left behind by every engine."""
        if self._stream is None:
            self._stream, self._give_back_stream = recording.lend_stream(self, self.device)
        return self._stream

    def _give_up_graphs(self, error: Exception) -> None:
        """Decode without CUDA graphs from now on: the model's forward cannot be recorded in one.

        Some transformers models do host work in their forward, e.g. a copy from an unpinned CPU tensor (Gemma3n's
        decoder; the mixture-of-experts layers' `grouped_mm` in float32) or a `.tolist()` (their compiled float32
        fallback). They run eagerly, but a capture of them fails, and before this every request of such a model
        failed with the capture's error. The decode steps now keep the static buffers (and the compiled layers, with
        `compile_decode`) and run the model each step; `graph_failure` says why.
        """
        try:
            recording.device_synchronize(self.device)  # a failed capture leaves no sticky error; surface any other now
        except Exception:  # noqa: BLE001 - nothing more to learn: the warning below names the capture's error
            pass
        self._graphs.clear()
        self._pool = None
        self.decode_mode = "static"
        self.graph_failure = f"{type(error).__name__}: {error}"
        warnings.warn(f"hf-paged: the decode step of {type(self.model).__name__} cannot be recorded in a CUDA graph "
                      f"({self.graph_failure.splitlines()[0][:200]}); decoding without CUDA graphs", RuntimeWarning,
                      stacklevel=2)

    def capture_all(self) -> None:
        """Capture every bucket up front (largest first, sharing one memory pool)."""
        self._ensure_buffers()
        with torch.inference_mode():
            for batch in sorted(self._bucket_sizes, reverse=True):
                if batch not in self._graphs:
                    start = time.perf_counter()
                    self._graphs[batch] = self._capture(batch)
                    self.capture_seconds[batch] = time.perf_counter() - start
        if self.device.type == "cuda":
            recording.device_synchronize(self.device)
