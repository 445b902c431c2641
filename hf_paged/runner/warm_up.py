"""The runner's warm-up forwards: dummy steps that make Triton compile now what serving steps will launch.

Nothing they compute is kept: every row writes to slot -1 (nowhere) and reads block 0. `Engine.warm_up` runs them
inside `kernels.parallel_jit.compile_only()`, where the launches only compile, in parallel threads; without it they
run for real and compile one kernel after another.

The order of `Engine.warm_up()` on CUDA: in the dry block, the compiler's imports (`import_compiler`, while Triton's
compiler key is still being hashed in the thread the engine started when it was built:
`parallel_jit.prefetch_compiler_key`), the sampler, dummy ragged prefill forwards for a few tile shapes, one decode
bucket per decode-kernel variant (`kernels.decode_variant`) and, with `compile_decode`, the compiled prefill; the
main thread meanwhile traces and compiles the decode step. Then the picks once for real, the capture of every decode
bucket (each after one forward outside the graph: `graphs._capture`), and `warm_up_uploads`. Measured on H100 hosts:
hashing the key from the engine's construction saved 0.39-0.41 s of a warm start
(`benchmarks/results/h100_2026-11-27f/`), and the imports under the hash took a warm llama-1b start from a median
5.6 to 4.6 s with a fixed pool and 5.0 to 4.4 s with a profiled one (`benchmarks/results/h100_2026-11-27g/`).
Launching the picks and uploads once saved the first decode steps about 35 ms of kernel loading
(`benchmarks/results/h100_2026-11-26c/`, call 06).
"""

from __future__ import annotations

import importlib
from contextlib import nullcontext

import torch

from .. import kernels
from ..attention import gated_deltanet, mamba2
from ..cache import attention_heads, layer_kv_shapes
from . import recording

__all__ = ["COMPILER_MODULES", "WarmUpForwards"]

#: what compiling the decode step imports (`torch.compile`'s debug wrappers, Inductor's entry point and what it pulls
#: in): about 1.3 s of a warm start on an H100 host (`benchmarks/results/h100_2026-11-27f`, call d)
COMPILER_MODULES = ("torch._dynamo.repro.after_dynamo", "torch._inductor.compile_fx")


class WarmUpForwards:
    """Mixed into `ModelRunner` (which provides the cache, the model, the buffers, `_dummy_rows`, `_run_model` and
    `_prefill_layers`)."""

    def import_compiler(self) -> None:
        """With `compile_decode`: import now the parts of torch that compiling the decode step imports
        (`COMPILER_MODULES`), which that compilation would import a moment later anyway.

        Why: `Engine.warm_up` calls this first in its dry block, while a thread hashes Triton's compiler key (0.4 s on
        an H100 host, `kernels.parallel_jit`) that the block's first Triton launch must wait for. Hashing releases the
        GIL, so the imports run in its shadow instead of after it. A module missing from this torch, or one that fails
        to import, is skipped: the compilation imports what its version needs, and raises where an automatic
        `compile_decode` falls back to the model's own code."""
        if not self.compile_decode:
            return
        for name in COMPILER_MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # raised again, where it belongs, by the compilation
                pass

    def warm_up_prefill(self, max_tokens: int) -> None:
        """Run dummy ragged prefill forwards so the JIT compiles their kernels now, not in a serving step.

        Triton specialises the prefill kernel on the tile shape, which depends on the longest query of a step: one
        query length per tile shape the kernel can pick for this model's heads is run
        (`kernels.prefill_tile_lengths`), so each is compiled (a missed one cost a serving step about a second of
        JIT), and each forward is run once (four of the nine powers of two up to 512, typically). Nothing is written
        (slot -1) and every table points at block 0. A hybrid's gated DeltaNet layers then warm flash-linear-attention's
        variable-length call over the token and sequence counts that compile anew (`gated_deltanet.warm_up`), and its
        Mamba 2 layers the variable-length scan of each layer shape (`mamba2.warm_up`).
        """
        heads, _ = attention_heads(self.cache.config)  # the group sizes: the same on every TP rank
        # every layer shape's tile shapes (Gemma 4's global layers tile by their own head size and group)
        lengths = sorted({q_len for s in set(layer_kv_shapes(self.cache.config))
                          for q_len in kernels.prefill_tile_lengths(heads, s.kv_heads, s.key_dim, max_tokens,
                                                                    self.device, self.cache.compute_dtype)})
        with torch.inference_mode():
            for q_len in lengths:
                self._dummy_prefill(q_len, max(1, min(4, max_tokens // q_len)))
        if self.hybrid:
            gated_deltanet.warm_up(self.model, max_tokens)
            mamba2.warm_up(self.model, max_tokens)
        if self.device.type == "cuda":
            recording.device_synchronize(self.device)

    def warm_up_decode_kernels(self) -> None:
        """Run the decode step over the static buffers, once per distinct kernel variant of the batch buckets, so
        their attention kernels are compiled before the graphs are captured; with `compile_decode` the step runs in
        its compiled form, so its Dynamo trace and Inductor compilation happen here too.

        The decode kernels' variant depends on the batch only through its split count, and only through whether it
        is 1 and how Triton specialises the integers it makes (`kernels.decode_variant`): one bucket per variant is
        run (two of the fifteen buckets for llama-1b), the largest first (the one `capture_all` would compile the
        step with). The rows are the capture's dummies (slot -1, length 0). Meant for `compile_only()`: there the
        torch.compile work of the main thread overlaps the Triton compilations of the pool; run for real it adds
        forwards without compiling anything the captures would not.
        """
        if self.decode_mode != "graph":
            return
        self._ensure_buffers()
        self._dummy_rows()
        heads, kv_heads = attention_heads(self.cache.config)
        local_q = self.cache.num_kv_heads * max(1, heads // max(1, kv_heads))  # this rank's (first layer's group)
        max_context = self.max_blocks_per_seq * self.block_size
        shapes = set(self.cache.kv_shapes)  # (layers of other shapes launch other variants)
        seen = set()
        with torch.inference_mode():
            for batch in sorted(self._bucket_sizes, reverse=True):
                variants = {kernels.decode_variant(batch, local_q, s.kv_heads, s.key_dim, max_context, self.device,
                                                   s.value_dim) for s in shapes}
                if variants <= seen:
                    continue
                seen |= variants
                self._run_model(batch)  # compiled (and compiling, the first time) with `compile_decode`

    def warm_up_uploads(self) -> None:
        """Launch once, for real, the torch kernels a static decode step runs outside its graph: the block-table
        store's `index_copy_` (rows and single entries) and the pipelined step's input-id `index_select`. CUDA loads
        a kernel's code at its first launch (lazy module loading): on an H100 these cost the first decode step of a
        run about 30 ms otherwise.
        Nothing changes: the copied store row is its own content, the selected ids are thrown away."""
        if self.decode_mode == "eager" or self.device.type != "cuda":  # no static step
            return
        self._ensure_buffers()
        b = self._buffers
        with torch.inference_mode():
            row = b["staging_rows"][:1]  # a row index below the store's capacity
            b["store"].index_copy_(0, row, torch.index_select(b["store"], 0, row))
            flat = b["store"].view(-1)  # and its single entries (`point_index` holds 0s until a step writes it)
            flat.index_copy_(0, b["point_index"][:1], torch.index_select(flat, 0, b["point_index"][:1]))
            torch.index_select(b["ids"], 0, b["src"][:1])
        recording.device_synchronize(self.device)

    def warm_up_compiled_prefill(self) -> None:
        """Run one dummy ragged step through the compiled layers (once the decode step compiled them:
        `warm_up_decode_kernels` or `capture_all`), so that the first routed prefill's check (`_prefill_layers`) and
        any compilation it needs happen now."""
        if not self._prefill_routable():
            return
        with torch.inference_mode():
            self._dummy_prefill(8, 2, compiled=True)
        if self.device.type == "cuda":
            recording.device_synchronize(self.device)

    def _dummy_prefill(self, q_len: int, num_seqs: int, compiled: bool = False) -> None:
        """A prefill forward of `num_seqs` sequences of `q_len` tokens that writes nothing (slot -1) and reads block
        0; through the compiled layers when `compiled`."""
        cache = self.cache
        tokens = num_seqs * q_len
        table = [0] * -(-q_len // self.block_size)  # every position reads block 0
        step = cache._make_step("ragged", [-1] * tokens, [table] * num_seqs, [q_len] * num_seqs,
                                [q_len] * num_seqs, self.device)
        if self.hybrid:  # recurrent states: every sequence starts from nothing and writes the scratch slot
            step.state_slots = torch.full((num_seqs,), cache.block_manager.state.scratch, dtype=torch.long,
                                          device=self.device)
            step.state_rows = [(i * q_len, q_len, False) for i in range(num_seqs)]
        cache.set_engine_step(step)
        positions = torch.arange(q_len, device=self.device).repeat(num_seqs)[None]
        with self._prefill_layers(tokens) if compiled else nullcontext():
            self.model(
                input_ids=torch.zeros((1, tokens), dtype=torch.long, device=self.device), position_ids=positions,
                past_key_values=cache, use_cache=True,
                logits_to_keep=torch.arange(q_len - 1, tokens, q_len, device=self.device),
            )
