"""Continuous-batching engine: one ragged forward per step through the model's own transformers code.

Each `step()` asks the scheduler which tokens to compute, applies the block operations it decided (swap out, swap in,
copy-on-write), flattens every scheduled token of every sequence into one `[1, T]` batch with position ids, hands the
block tables / slot mapping to the `PagedCache`, runs the model once (logits only for the sequences that sample) and
samples on the device with one host sync. Requests join and leave at every step; nothing is padded.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import threading
import time
import weakref
from collections.abc import Iterator

import torch

from ..attention import prepare_model
from ..cache import PagedCache, resolve_kv_cache_dtype
from ..core import Scheduler, SchedulerOutput, SequenceGroup
from ..kernels.parallel_jit import compile_only, prefetch_compiler_key
from ..runner import ModelRef, ModelRunner, TensorParallel, WeightWatch, compile_submodules
from . import defaults
from .beam import BeamSearch, SharingStats, sharing_stats, track_sharing
from .defaults import default_admission_batch, default_compile_decode, default_max_num_batched_tokens, sparse_step_modes
from .device_sampling import DevicePicker
from .faults import StepRecovery
from .grammar import StructuredOutputs
from .kv_lifetime import WeightGuard
from .lora import LoraAdapters
from .outputs import CompletionOutput, RequestOutput, RequestRegistry, stamp_first_token
from .params import SamplingParams, copy_params
from .pipelined import PipelinedDecode, _InFlight
from .pool_sizing import build_engine_cache
from .prompt_logprobs import finish_scoring_only, record_prompt_logprobs, score_rows
from .requests import EngineClosedError, Requests
from .sampling import Sampler
from .updates import TokenUpdates

__all__ = ["Engine", "EngineClosedError", "RequestOutput", "CompletionOutput", "default_compile_decode",
           "default_max_num_batched_tokens"]


_UNFREEZE_REGISTERED = False


def _unfreeze_at_exit() -> None:
    """Give the frozen objects back to the collector when the interpreter exits, so its last collection finalises
    them (extension modules such as triton's otherwise report them as leaked at exit)."""
    global _UNFREEZE_REGISTERED
    if not _UNFREEZE_REGISTERED:
        atexit.register(gc.unfreeze)
        _UNFREEZE_REGISTERED = True


class Engine(Requests, PipelinedDecode, TokenUpdates):
    """A continuous-batching server loop around a transformers causal LM.

    Args:
        model: a transformers causal LM of a supported family (`hf_paged.enable` is applied to it).
        tokenizer: optional; needed for string prompts and `stop_strings`.
        block_size, num_blocks, kv_cache_memory, gpu_memory_utilization: KV pool (see `PagedCache`). On CUDA, when
            neither `num_blocks` nor `kv_cache_memory` is given, a forward at the full token budget is profiled first
            and `gpu_memory_utilization` of the GPU minus weights and activations goes to the pool; a `ValueError`
            if less than that is free (another process on the GPU, say; `hf_paged.engine.pool_sizing`).
        kv_cache_dtype, kv_scales: "auto" (default) keeps K/V in the model's dtype; "fp8" (or "fp8_e4m3") stores them
            as float8_e4m3fn, one scale per layer: twice the tokens of a bf16 pool in the same memory. Scales: the
            checkpoint's (`k_scale` / `v_scale`) if the model ships them, else calibrated from the first prompt; or
            `kv_scales` (`hf_paged.cache.kv_quant`).
        max_num_seqs, max_num_batched_tokens: per-step limits; longer prompts are prefilled in chunks. The token
            budget defaults to `default_max_num_batched_tokens(device)` (16,384 on an H100-class GPU, 8,192 on other
            GPUs, 2,048 on the CPU); `hf-paged serve` uses 8,192.
        preemption_mode: "recompute" (default) or "swap"; `swap_space` GiB of (pinned) CPU memory back the swap.
        admission_batch, admission_max_wait: while requests run, waiting ones are admitted when `admission_batch`
            sequences (or all that wait) fit at once, in places and in their prompts' blocks, or after
            `admission_max_wait` steps left room unused; an idle engine admits at once (`Scheduler.admission_due`).
            Default `None`: `max_num_seqs // 8` with CUDA graphs, 1 (each as soon as it fits) without
            (`default_admission_batch`).
        seed: seed of the engine's generator for requests without their own `seed`.
        use_cuda_graph: replay CUDA graphs for decode-only steps (default: on CUDA).
        enable_prefix_caching: reuse the KV blocks of earlier prompts' common prefixes (default on; see
            `hf_paged.core.prefix_caching`). Hits and saved prefill tokens: `stats` / `prefix_cache_stats()`.
        compile_modules: `torch.compile` the model's RMSNorm, rotary-embedding and MLP submodules (their own code,
            kernels fused by Inductor; `hf_paged.runner.compile`). Fewer kernels per decode step; compiling
            takes a while on first use (`warm_up()`). Default off.
        compile_decode: compile the decode step with `torch.compile`, one decoder layer at a time
            (`hf_paged.runner.regional`: the layer code compiled once for every layer, the whole forward for models
            whose layers differ too much): Dynamo traces transformers' own modeling code, Inductor fuses everything
            around the attention, which stays one opaque hf_paged op (K/V write + paged decode). Symbolic in the batch
            size, then captured as a CUDA graph per batch bucket. A decode step of a 1B llama drops from ~42 to ~16
            kernels per layer (1.4-1.6x faster on an H100); compiling takes ~10 s on cold caches (~4 s warm, through
            torch's on-disk caches; llama-1b and Qwen3-0.6B on an H100), paid in `warm_up()` or the first decode
            step. Once compiled, the same layers also run prefill steps (not one-token forwards;
            `runner.compile_prefill = False` keeps them eager). Default `None`: on for CUDA with CUDA graphs, off
            elsewhere (`default_compile_decode`); `False` keeps the model's own code.
        release_window_blocks: when every attention layer of the model slides (Mistral v0.1, Phi-3-mini-4k, Qwen2
            with `use_sliding_window` on all layers, ...), give the KV blocks that fell wholly out of the largest
            window back to the pool after each step, so a sequence holds about `ceil(window / block_size) + 1`
            blocks however long it grows (`hf_paged.core.scheduler`, `BlockManager.release_before`). The windows are
            those the layers pass to the attention function, learnt on the first forward. Mixed stacks (Gemma 2/3's
            local and global layers, gpt-oss, Cohere 2: `layer_types` in the config) get one block table per layer
            group (`hf_paged.cache.grouped_cache`): the local groups release their blocks, the global ones keep them.
            Default on; `kv_stats()` counts the released entries.
        state_checkpoints: hybrid models (recurrent layers beside attention: Qwen3.5, Granite 4, Falcon-H1, LFM2,
            Jamba, ...) keep each running sequence's recurrent state in a slot of their own (`max_num_seqs` slots,
            counted in the KV memory budget, so admission never runs more sequences than there are slots). With
            prefix caching, a prefix hit also needs the state at the prefix's end: this many slots keep such states
            (at the last full block of prompts, and where a prompt's cached K/V of an earlier prompt ends: a shared
            system prompt), least recently used evicted first. Default `max(8, max_num_seqs // 8)`; 0 turns
            prefix hits off for hybrid models.
        experts_implementation: mixture-of-experts layers run hf_paged's fused Triton experts (`"hf_paged"`, the
            default; `hf_paged.attention.experts`), one of transformers' (`"grouped_mm"`, `"eager"`, ...), or as the
            model has them (None). `hf_paged.disable` gives the model back its own.
        max_loras, max_lora_rank: LoRA adapters (`add_lora`, `SamplingParams(lora=name)`): at most `max_loras` of
            them resident at once (requests of others wait), of rank up to `max_lora_rank` (`hf_paged.engine.lora`).
        weak_model_ref: hold the model by weak reference (what `generate(cache_implementation="paged")` and
            `hf_paged.pipeline` use, where the model owns its engine: no model <-> engine cycle, so dropping the model
            frees both and the KV pool by reference counting). Default False: the engine keeps its model alive.

    Cached K/V never outlives the weights that computed it: before admitting requests the engine checks whether the
    model's weights changed (in-place updates, replaced tensors, PEFT adapter switches) and drops the prefix cache if
    so (`hf_paged.engine.kv_lifetime`; `reset_prefix_cache()` does it explicitly).

    A model sharded by transformers' tensor parallelism (`DistributedConfig(tp_plan="auto")` under `torchrun`) is
    served by one engine per rank: each holds its KV heads, all hold the same blocks and make the same decisions
    (`hf_paged.runner.distributed`). Every rank must add the same requests in the same order. CUDA graphs and the
    compiled step are on by default there as in one process; the graphs record the model's collectives, so close the
    engine (`close()`, or `with Engine(...)`) before `torch.distributed.destroy_process_group()`, which otherwise
    waits forever for the recorded collectives (pytorch/pytorch#115388).

    The step loop and the set-up; parts: scheduler, block manager, runner, `recovery`, `weights`, `structured`,
    `registry` (requests and outputs). Jobs still sharing `self`, mixins: `Requests`, `PipelinedDecode`, `TokenUpdates`.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | str | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        preemption_mode: str = "recompute",
        admission_batch: int | None = None,
        admission_max_wait: int = 16,
        swap_space: float = 0.0,
        seed: int | None = None,
        show_progress: bool = False,
        use_cuda_graph: bool | None = None,
        enable_prefix_caching: bool = True,
        compile_modules: bool = False,
        compile_decode: bool | None = None,
        weak_model_ref: bool = False,
        release_window_blocks: bool = True,
        state_checkpoints: int | None = None,
        experts_implementation: str | None = "hf_paged",
        kv_cache_dtype: str = "auto",
        kv_scales=None,
        max_loras: int = 4,
        max_lora_rank: int = 16,
    ) -> None:
        # validate cheap arguments before anything is allocated
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("admission_batch", admission_batch)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(admission_max_wait, int) or isinstance(admission_max_wait, bool) or admission_max_wait < 0:
            raise ValueError(f"admission_max_wait must be a non-negative int, got {admission_max_wait!r}")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        for name, value in (("compile_modules", compile_modules), ("release_window_blocks", release_window_blocks)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        if compile_decode is not None and not isinstance(compile_decode, bool):
            raise TypeError(f"compile_decode must be a bool or None (automatic), got {compile_decode!r}")
        if state_checkpoints is not None and (not isinstance(state_checkpoints, int)
                                              or isinstance(state_checkpoints, bool) or state_checkpoints < 0):
            raise ValueError(f"state_checkpoints must be a non-negative int, got {state_checkpoints!r}")
        resolve_kv_cache_dtype(kv_cache_dtype)  # a ValueError naming the argument, before anything is built
        self.lora = LoraAdapters(self, max_loras, max_lora_rank)  # LoRA adapters per request (`add_lora`)
        self.tp = TensorParallel.of(model)
        prepare_model(model, experts_implementation)
        if compile_modules:
            compile_submodules(model)
        self._model_ref = ModelRef(model, weak=weak_model_ref)
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        prefetch_compiler_key(self.device)  # Triton's key hashed while the pool is sized, not when warm-up waits for it
        self.dtype = next(model.parameters()).dtype
        text_config = model.config.get_text_config(decoder=True)
        self.vocab_size = int(text_config.vocab_size)
        self.max_model_len = getattr(text_config, "max_position_embeddings", None)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = default_max_num_batched_tokens(self.device)
        if not isinstance(swap_space, (int, float)) or swap_space < 0:
            raise ValueError(f"swap_space must be a non-negative number of GiB, got {swap_space!r}")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.show_progress = show_progress
        kv_heads = None
        if self.tp is not None:  # this rank's share of the KV heads (and a check that the query heads split too)
            self.tp.local_heads(int(text_config.num_attention_heads), "num_attention_heads")
            kv_heads = self.tp.local_kv_heads(model.config,
                                              PagedCache(config=model.config, num_blocks=1).num_kv_heads)
        compile_auto = compile_decode is None
        if compile_auto:
            compile_decode = default_compile_decode(self.device, use_cuda_graph, compile_modules)
        compile_decode = defaults.compile_decode_for(model, compile_decode, compile_auto)  # (Zamba, HRM: eager)
        self.cache, self.state_specs = build_engine_cache(
            model, self.tp, self.device, self.dtype, block_size=block_size, kv_heads=kv_heads, num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization, swap_space=swap_space,
            preemption_mode=preemption_mode, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, state_checkpoints=state_checkpoints,
            kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales, group_layers=release_window_blocks)
        use_cuda_graph, compile_decode = sparse_step_modes(self.cache, use_cuda_graph, compile_decode, compile_auto)
        self.block_manager = self.cache.block_manager
        self.block_manager.set_prefix_caching(enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            preemption_mode=preemption_mode,
            admission_max_wait=admission_max_wait,
        )
        self.sampler = Sampler(self.device, seed)
        self.picker = DevicePicker(self.device, max_num_seqs, seed)
        self.runner = ModelRunner(
            self._model_ref, self.cache, max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
            use_cuda_graph=use_cuda_graph, compile_decode=compile_decode, compile_auto=compile_auto,
        )
        self.recovery = StepRecovery(self.scheduler, self.block_manager, self.runner)
        self.scheduler.admission_batch = admission_batch or default_admission_batch(
            max_num_seqs, self.runner.use_cuda_graph)
        self.runner.token_limit = max_num_batched_tokens  # ragged steps are padded up to it at most
        self._lock = threading.RLock()
        self._waiters = 0  # calls from other threads waiting for the lock; the stepping thread lets them in first
        self._waiters_lock = threading.Lock()
        self._closed = False
        self._arrivals = itertools.count()
        self._auto_ids = itertools.count()
        self._in_flight: _InFlight | None = None  # pipelined decode: launched, tokens not applied yet
        self._token_hosts: list[torch.Tensor] = []  # two pinned buffers: the step in flight and the one launching
        self.pipelined_steps = 0
        self.warm_up_seconds: dict[str, float] = {}  # where `warm_up()` spent its time (start-up profiling)
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "max_running": 0, "running_sum": 0,
                      "prefix_query_tokens": 0, "prefix_hit_tokens": 0, "prefix_hit_rate": 0.0}
        self.beam_search = BeamSearch(self)
        self.release_window_blocks = release_window_blocks
        self._window_known = not release_window_blocks  # nothing to learn when releasing is off
        self.weights = WeightGuard(WeightWatch(self._model_ref), self.block_manager, self.runner, self.stats,
                                   self.dtype, self.device)
        self.structured = StructuredOutputs(self.device, self)  # grammar-constrained requests (xgrammar on first use)
        ref = weakref.ref(self)  # (no engine <-> registry cycle: a dropped engine is freed by reference counting)
        self.registry = RequestRegistry(self.sampler, self.structured, lambda: ref().tokenizer)

    @property
    def model(self):
        """The model served (raises `hf_paged.runner.ModelFreedError` if it was freed while weakly held)."""
        return self._model_ref()

    def warm_up(self, freeze_gc: bool = True, prefill_graphs: bool = False) -> None:
        """Compile the kernels and capture the decode graphs now (seconds), instead of in the first serving steps.

        Optional: without it the same happens lazily, the first time each kernel shape or batch bucket is needed.
        Where the time went is left in `warm_up_seconds`: on CUDA `kernel_jit` (the Triton kernels of the prefill, the
        sampler and the decode buckets compiled in parallel threads while this thread traces and compiles the decode
        step with `compile_decode`), else the `prefill`, `sampler` and `compiled_prefill` forwards and, in the first
        decode bucket's time, the compilation; then the graph captures of the buckets.

        `freeze_gc`: then move every object alive (the model, transformers' and torch's modules, ...) to the garbage
        collector's permanent generation (`gc.freeze()`, as vLLM does after graph capture). A busy engine allocates
        thousands of objects a step (beam forks above all), which makes Python run full collections often, and each
        one scanned those hundreds of thousands of objects: 8 of the 33 ms of host time of a 100 x 8-beam step on the
        CPU profile. Frozen objects are still freed by reference counting; only garbage cycles among them stay.

        `prefill_graphs`: also record now the CUDA graph of every token bucket of a prefill or mixed step
        (`hf_paged.runner.ragged_graphs`; 48 buckets up to 4,096 tokens by default), which serving would otherwise
        record at each bucket's second run, so that no request of a fresh server pays an eager step or a recording.
        About 45 ms a bucket for llama-1b on an H100, 2.2 s for 48 (`warm_up_seconds["prefill_graphs"]`). `hf-paged
        serve` does it; off by default, where start-up time counts more than the first prompts' latency. Nothing to do
        where prefill steps are not replayed from graphs (no CUDA graphs, tensor parallelism, no compiled decode
        step).
        """
        if not isinstance(prefill_graphs, bool):
            raise TypeError(f"prefill_graphs must be a bool, got {type(prefill_graphs).__name__}")
        with self._control():
            runner = self.runner
            start = time.perf_counter()
            # every Triton kernel the warm-up launches is compiled at once, in threads, by running the warm-up code
            # with launches that only compile (`kernels.parallel_jit`), while this thread traces and compiles the
            # decode step (`compile_decode`); what is left to run then finds them compiled
            with compile_only(device=runner.device) as dry:
                if dry:
                    runner.import_compiler()  # while Triton's key is hashed, which the first launch below waits for
                    self._warm_up_sampler()  # first launch: the longest compilation (2-3 s)
                    runner.warm_up_prefill(self.max_num_batched_tokens)
                    runner.warm_up_decode_kernels()
                    runner.warm_up_compiled_prefill()
            kernel_jit = time.perf_counter() - start
            prefill = sampler = compiled_prefill = 0.0
            if not dry:  # after a dry run these forwards would compile nothing more
                prefill = _timed(runner.warm_up_prefill, self.max_num_batched_tokens)
            # the picks run for real once, also after a dry run (which compiled them): a kernel's first launch loads its
            # module, and the first prefill step paid it otherwise (0.02-0.03 s more prefill in 6 of 8 greedy
            # llama-1b runs on an H100; none in 3 of 3 with this)
            sampler = _timed(self._warm_up_sampler)
            if runner.decode_mode == "graph" or runner.compile_decode:
                runner.capture_all()
            runner.warm_up_uploads()
            if not dry:
                compiled_prefill = _timed(runner.warm_up_compiled_prefill)  # through the layers just compiled
            prefill_buckets, prefill_graph_s = 0, 0.0
            if prefill_graphs:
                start = time.perf_counter()
                prefill_buckets = runner.record_ragged_buckets()
                prefill_graph_s = time.perf_counter() - start
            captures = sorted(runner.capture_seconds.items(), reverse=True)
            # the largest bucket is captured first: with compile_decode (and no dry run) its time holds the compilation
            self.warm_up_seconds = {
                "kernel_jit": kernel_jit, "prefill": prefill, "sampler": sampler,
                "first_decode_bucket": captures[0][1] if captures else 0.0,
                "other_decode_buckets": sum(t for _, t in captures[1:]), "decode_buckets": len(captures),
                "compiled_prefill": compiled_prefill, "prefill_graphs": prefill_graph_s,
                "prefill_buckets": prefill_buckets,
            }
            if freeze_gc:
                gc.collect()
                gc.freeze()
                _unfreeze_at_exit()

    def _warm_up_sampler(self) -> None:
        """Compile the device sampler for this model's logits rows (width and dtype), so the first sampled step does
        not wait for it."""
        weight = self._head_weight()
        self.picker.warm_up(self.logits_width(), weight.dtype if weight is not None else self.dtype)

    def _head_weight(self) -> torch.Tensor | None:
        model = self._model_ref()
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        weight = getattr(head, "weight", None)
        return weight if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None

    def logits_width(self) -> int:
        """Columns of the model's logits: its output projection's rows (may exceed the tokenizer's vocabulary)."""
        width = getattr(self, "_logits_width", None)
        if width is None:
            weight = self._head_weight()
            width = self._logits_width = int(weight.shape[0]) if weight is not None else self.vocab_size
        return width

    def stop_token_ids(self) -> tuple[int, ...]:
        """The model's end-of-sequence ids (generation config and tokenizer): what ends a grammar's output."""
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids = [eos] if isinstance(eos, int) else list(eos or ())
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(tok_eos, int) and tok_eos not in ids:
            ids.append(tok_eos)
        return tuple(ids)

    # ------------------------------------------------------------------ stepping
    def step(self, *, finished_only: bool = False) -> list[RequestOutput]:
        """Run one iteration; return the requests that advanced (or finished) in it (only finished ones if asked).

        Decode steps of plain requests (greedy or sampled on the device, constrained or not) on the CUDA-graph path
        are pipelined: the next step is scheduled and launched before this one's tokens reach the host, its input ids
        taken from this step's picks on the device, so the GPU does not wait for the host in between. A call still
        reports one step's tokens (those of the step before the one it leaves in flight); `finished_only=True` (what
        `generate()` uses) reports the finished requests only.
        """
        while self._waiters:  # add_request / abort / close from other threads go first (see _control)
            time.sleep(0.0002)
        with self._lock:
            if self.weights.due and self._in_flight is None:
                self.weights.check()  # before admitting new requests: none may be handed K/V of older weights
            current, self._in_flight = self._in_flight, None
            if not self._window_known:
                self._learn_release_window()
            if current is None:
                sched = self.scheduler.schedule()
                if sched.is_empty:
                    if self.scheduler.has_unfinished() and not self.scheduler.running:
                        raise RuntimeError("the scheduler could not admit any request (this is a bug: please report it)")
                    return self.registry.collect_finished()
                phase = "blocks"  # how far the step got: decides what a failure or an interrupt must undo
                try:
                    self.runner.apply_block_ops(sched)
                    track_sharing(self.stats, *self.block_manager.usage())
                    phase = "forward"
                    with torch.inference_mode():
                        scored_rows = score_rows(sched)
                        if scored_rows:
                            logits, samplers = self.runner.execute(sched, extra_rows=scored_rows)
                        else:
                            logits, samplers = self.runner.execute(sched)
                        phase = "sample"
                        self.scheduler.commit_launched(sched)  # host work while the GPU runs the forward
                        self.scheduler.prepare_admissions()
                        if self.structured.active:  # grammar bitmasks: filled on the host, applied on the device
                            masks = self.structured.fill(sched)
                            if masks is not None:
                                self.structured.apply(logits, masks)
                        scored: list[SequenceGroup] = []
                        rest = sched
                        if scored_rows:  # prompt log-probabilities (hf_paged.engine.prompt_logprobs)
                            logits = record_prompt_logprobs(sched, scored_rows, logits, len(samplers))
                            rest, logits, scored = finish_scoring_only(sched, logits, self.scheduler)
                        if self._can_pipeline(rest, logits):
                            current = self._launch(rest, logits)
                        else:
                            advanced = self._sample_and_update(rest, logits) if rest.scheduled else []
                            advanced += scored
                except Exception as error:  # a failing step fails its own requests only
                    advanced = self.recovery.fail(sched, error, phase)
                except BaseException as error:  # KeyboardInterrupt & co: leave the engine consistent, then propagate
                    self.registry.unreported.extend(self.recovery.interrupted(sched, error, phase))  # next step
                    raise
                if current is None:
                    self._track(sched)
                    return self.registry.outputs(stamp_first_token(advanced), finished_only)
            advanced, finished = self._advance_pipeline(current)
            return self.registry.outputs(stamp_first_token(advanced), finished_only, finished)

    def _learn_release_window(self) -> None:
        """Once a forward has shown every layer's window, let the scheduler release what no layer reads any more."""
        known, window = self.cache.sliding_window_bound()
        if known:
            self._window_known = True
            self.scheduler.release_window = window

    def _track(self, sched: SchedulerOutput) -> None:
        self.stats["steps"] += 1
        if sched.decode_step:  # one token per item (`Scheduler.schedule_decode_step`)
            self.stats["decode_tokens"] += len(sched.scheduled)
        else:
            for item in sched.scheduled:
                key = "decode_tokens" if item.num_tokens == 1 else "prefill_tokens"
                self.stats[key] += item.num_tokens
        running = self.scheduler.num_running_seqs()
        self.stats["max_running"] = max(self.stats["max_running"], running)
        self.stats["running_sum"] += running
        bm = self.block_manager  # prefix cache: tokens looked up at admission, served from the cache (prefill saved)
        if bm.prefix_query_tokens != self.stats["prefix_query_tokens"]:
            self.stats["prefix_query_tokens"] = bm.prefix_query_tokens
            self.stats["prefix_hit_tokens"] = bm.prefix_hit_tokens
            self.stats["prefix_hit_rate"] = bm.prefix_hit_tokens / bm.prefix_query_tokens

    # ------------------------------------------------------------------ convenience
    def stream(self) -> Iterator[RequestOutput]:
        """Step until every request is done, yielding each request's state whenever it advances."""
        while self.has_unfinished():
            yield from self.step()
        with self._control():  # aborted (or closed) after the last step, e.g. from another thread: still report them
            self._drain()
            leftovers = self.registry.collect_finished()
        yield from leftovers

    def generate(self, prompts, params=None, *, use_tqdm: bool | None = None, **kwargs) -> list[RequestOutput]:
        """Run `prompts` (token lists, 1-D tensors or strings) to completion; outputs in input order.

        `params` is one `SamplingParams` for all or a list with one per prompt; `kwargs` build a shared one.

        On an engine shared with other callers (a server, another thread's `stream()`), the steps run here also
        advance their requests; the outputs of those that finish are handed back: the next `step()` / `stream()`
        returns them, and `has_unfinished()` stays true until it has.
        """
        prompts = list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"params has {len(params)} entries for {len(prompts)} prompts")
            per_request = list(params)
        else:
            shared = params if params is not None else SamplingParams(**kwargs)
            per_request = [shared] * len(prompts)
        ids = []
        try:
            for prompt, p in zip(prompts, per_request):
                ids.append(self.add_request(prompt, params=copy_params(p)))
        except Exception:
            for request_id in ids:
                self.abort(request_id)
            raise
        wanted = set(ids)
        results: dict[object, RequestOutput] = {}
        show = self.show_progress if use_tqdm is None else use_tqdm
        bar = None
        if show:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="hf_paged", unit="req")
        try:
            while len(results) < len(ids):
                if not self.scheduler.has_unfinished():  # (handed-back outputs are not ours to wait for)
                    break
                for out in self.step(finished_only=True):
                    if out.request_id not in wanted:  # another caller's request (a shared engine): hand it back
                        self.registry.handed_back.append(out)
                    elif out.finished and out.request_id not in results:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in ids:
                self.abort(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        with self._control():
            self._drain()
            for request_id in ids:  # aborted from another thread while we were stepping
                if request_id not in results and request_id in self.registry.groups:
                    results[request_id] = self.registry.output(self.registry.groups[request_id])
        return [results[request_id] for request_id in ids]

    def kv_stats(self):
        """Block usage of the KV pool now (`hf_paged.core.BlockStats`): used / free / shared blocks, and with
        `release_window_blocks` the table entries released out of the sliding window (`released_blocks` now,
        `window_released` in all)."""
        return self.block_manager.stats()

    def queue_stats(self) -> dict:
        """Request queues, KV pool usage, preemptions and prefix-cache hit rate now (for a server's metrics)."""
        with self._control():
            sched, pool = self.scheduler, self.block_manager.stats()
            return {"waiting": len(sched.waiting), "running": len(sched.running), "swapped": len(sched.swapped),
                    "kv_blocks_total": pool.num_blocks, "kv_blocks_used": pool.used_blocks,
                    "preemptions": sum(sched.num_preemptions.values()),
                    "prefix_cache_hit_rate": self.block_manager.prefix_cache_stats().hit_rate,
                    "steps": self.stats["steps"]}

    def prefix_cache_stats(self):
        """Prefix-cache hits, saved prefill tokens and cached blocks (`hf_paged.core.PrefixCacheStats`)."""
        return self.block_manager.prefix_cache_stats()

    def sharing_stats(self) -> SharingStats:
        """Blocks saved by sharing (parallel sampling, beam search) now and averaged over the engine's steps."""
        return sharing_stats(self.stats, self.block_manager.stats())


def _timed(fn, *args) -> float:
    """Seconds `fn(*args)` took."""
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start
