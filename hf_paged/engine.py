"""Continuous-batching engine: one ragged forward per step through the model's own transformers code.

Each `step()` asks the scheduler which tokens to compute, applies the block operations it decided (swap out, swap in,
copy-on-write), flattens every scheduled token of every sequence into one `[1, T]` batch with position ids, hands the
block tables / slot mapping to the `PagedCache`, runs the model once (logits only for the sequences that sample) and
samples on the device with one host sync. Requests join and leave at every step; nothing is padded.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import itertools
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from .beam import BeamSearch, SharingStats, sharing_stats, track_sharing
from .cache import PagedCache, parse_memory
from .model_runner import ModelRunner
from .sampling import Sampler, SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = ["Engine", "EngineClosedError", "RequestOutput", "CompletionOutput"]


class EngineClosedError(RuntimeError):
    """A request was added to an engine after `Engine.close()`."""


_IN_FLIGHT = -1  # token id standing for a token a launched step has not delivered to the host yet


@dataclass
class _InFlight:
    """A launched plain decode step: its argmax is on the device, on its way to `host` (done when `event` is)."""

    sched: SchedulerOutput
    tokens: torch.Tensor  # [n] int64 on the device: input of the next pipelined step
    host: torch.Tensor  # [n] int64 on the host (pinned on CUDA)
    event: torch.cuda.Event | None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    finish_reason: str | None
    text: str | None = None
    scores: list[torch.Tensor] | None = None
    score: float | None = None  # beam search: the hypothesis' score (transformers' `sequences_scores`)


@dataclass
class RequestOutput:
    """State of one request after a step: cumulative tokens of each of its sequences."""

    request_id: object
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_preemptions: int = 0
    error: BaseException | None = None
    metrics: dict = field(default_factory=dict)


_UNFREEZE_REGISTERED = False


def _unfreeze_at_exit() -> None:
    """Give the frozen objects back to the collector when the interpreter exits, so its last collection finalises
    them (extension modules such as triton's otherwise report them as leaked at exit)."""
    global _UNFREEZE_REGISTERED
    if not _UNFREEZE_REGISTERED:
        atexit.register(gc.unfreeze)
        _UNFREEZE_REGISTERED = True


class Engine:
    """A continuous-batching server loop around a transformers causal LM.

    Args:
        model: a transformers causal LM of a supported family (`hf_paged.enable` is applied to it).
        tokenizer: optional; needed for string prompts and `stop_strings`.
        block_size, num_blocks, kv_cache_memory, gpu_memory_utilization: KV pool (see `PagedCache`). On CUDA, when
            neither `num_blocks` nor `kv_cache_memory` is given, a forward at the full token budget is profiled first
            and `gpu_memory_utilization` of the GPU minus weights and activations goes to the pool.
        max_num_seqs, max_num_batched_tokens: per-step limits; longer prompts are prefilled in chunks.
        preemption_mode: "recompute" (default) or "swap"; `swap_space` GiB of (pinned) CPU memory back the swap.
        seed: seed of the engine's generator for requests without their own `seed`.
        use_cuda_graph: replay CUDA graphs for decode-only steps (default: on CUDA).
        enable_prefix_caching: reuse the KV blocks of earlier prompts' common prefixes (default on; see
            `hf_paged.block_manager`). Hits and saved prefill tokens: `stats` / `prefix_cache_stats()`.
        compile_modules: `torch.compile` the model's RMSNorm, rotary-embedding and MLP submodules (their own code,
            kernels fused by Inductor; `hf_paged.integrations.compile`). Fewer kernels per decode step; compiling
            takes a while on first use (`warm_up()`). Default off.
        compile_decode: compile the whole decode step with `torch.compile`: Dynamo traces transformers' own modeling
            code, Inductor fuses everything around the attention, which stays one opaque hf_paged op (K/V write +
            paged decode). Compiled once with a symbolic batch size, then captured as a CUDA graph per batch bucket.
            A decode step of a 1B llama drops from ~42 to ~16 kernels per layer (1.4-1.5x faster on an H100);
            compiling takes tens of seconds, paid in `warm_up()`. Prefill steps stay eager. Default off.

    A model sharded by transformers' tensor parallelism (`DistributedConfig(tp_plan="auto")` under `torchrun`) is
    served by one engine per rank: each holds its KV heads, all hold the same blocks and make the same decisions
    (`hf_paged.integrations.distributed`). Every rank must add the same requests in the same order. CUDA graphs are
    off by default there (`use_cuda_graph=True` asks for them).
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
        swap_space: float = 0.0,
        seed: int | None = None,
        show_progress: bool = False,
        use_cuda_graph: bool | None = None,
        enable_prefix_caching: bool = True,
        compile_modules: bool = False,
        compile_decode: bool = False,
    ) -> None:
        from .integrations.generate import enable

        # validate cheap arguments before anything is allocated
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        for name, value in (("compile_modules", compile_modules), ("compile_decode", compile_decode)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        from .integrations.distributed import TensorParallel

        self.tp = TensorParallel.of(model)
        if compile_decode and self.tp is not None:
            raise ValueError("compile_decode is not supported under tensor parallelism (the compiled step would have to "
                             "trace the collectives); leave it off")
        enable(model)
        if compile_modules:
            from .integrations.compile import compile_submodules

            compile_submodules(model)
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        text_config = model.config.get_text_config(decoder=True)
        self.vocab_size = int(text_config.vocab_size)
        self.max_model_len = getattr(text_config, "max_position_embeddings", None)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 8192 if self.device.type == "cuda" else 2048
        if not isinstance(swap_space, (int, float)) or swap_space < 0:
            raise ValueError(f"swap_space must be a non-negative number of GiB, got {swap_space!r}")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.show_progress = show_progress
        kv_heads = None
        if self.tp is not None:  # this rank's share of the KV heads (and a check that the query heads split too)
            self.tp.local_heads(int(text_config.num_attention_heads), "num_attention_heads")
            kv_heads = self.tp.local_heads(PagedCache(config=model.config, num_blocks=1).num_kv_heads,
                                           "num_key_value_heads")
            if use_cuda_graph is None:
                use_cuda_graph = False
        probe = PagedCache(config=model.config, num_blocks=1, block_size=block_size, num_kv_heads=kv_heads)
        per_block = probe.bytes_per_block(self.dtype)
        num_cpu_blocks = int(swap_space * 1024**3) // per_block
        if preemption_mode == "swap" and num_cpu_blocks == 0:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (GiB of CPU memory for swapped blocks)")
        kv_bytes = parse_memory(kv_cache_memory, "kv_cache_memory")
        if num_blocks is None and kv_bytes is None and self.device.type == "cuda":
            num_blocks = self._profile_num_blocks(per_block, gpu_memory_utilization)
        if self.tp is not None:  # one block table for all ranks: every rank's pool gets the smallest block count
            if num_blocks is None:
                num_blocks = probe._auto_num_blocks(self.device, self.dtype) if kv_bytes is None else max(
                    1, kv_bytes // per_block)
            num_blocks = self.tp.agree_min(num_blocks, self.device)
        self.cache = PagedCache(
            config=model.config,
            num_kv_heads=kv_heads,
            num_blocks=num_blocks,
            block_size=block_size,
            device=self.device,
            dtype=self.dtype,
            kv_cache_memory=kv_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            num_cpu_blocks=num_cpu_blocks,
        )
        self.block_manager = self.cache.block_manager
        self.block_manager.set_prefix_caching(enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            preemption_mode=preemption_mode,
        )
        self.sampler = Sampler(self.device, seed)
        self.runner = ModelRunner(
            model, self.cache, max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
            use_cuda_graph=use_cuda_graph, compile_decode=compile_decode,
        )
        self._lock = threading.RLock()
        self._waiters = 0  # calls from other threads waiting for the lock; the stepping thread lets them in first
        self._waiters_lock = threading.Lock()
        self._closed = False
        self._arrivals = itertools.count()
        self._auto_ids = itertools.count()
        self._groups: dict[object, SequenceGroup] = {}
        self._unreported: list[SequenceGroup] = []  # finished outside a step (abort, close): reported by the next
        self._in_flight: _InFlight | None = None  # pipelined decode: launched, tokens not applied yet
        self._token_hosts: list[torch.Tensor] = []  # two pinned buffers: the step in flight and the one launching
        self.pipelined_steps = 0
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "max_running": 0, "running_sum": 0,
                      "prefix_query_tokens": 0, "prefix_hit_tokens": 0, "prefix_hit_rate": 0.0}
        self.beam_search = BeamSearch(self)

    # ------------------------------------------------------------------ memory
    def _profile_num_blocks(self, per_block: int, utilization: float) -> int:
        """vLLM-style sizing: peak memory of a forward at the full token budget, then the rest to the KV pool."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = torch.zeros((1, self.max_num_batched_tokens), dtype=torch.long, device=self.device)
        with torch.inference_mode():
            self.model(input_ids=tokens, use_cache=False, logits_to_keep=min(256, self.max_num_batched_tokens))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(total * utilization) - peak
        torch.cuda.empty_cache()
        if budget < per_block:
            raise ValueError(
                f"gpu_memory_utilization={utilization} leaves no room for the KV cache "
                f"(weights + activations peak at {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB)"
            )
        return budget // per_block

    def warm_up(self, freeze_gc: bool = True) -> None:
        """Compile the kernels and capture the decode graphs now (seconds), instead of in the first serving steps.

        Optional: without it the same happens lazily, the first time each kernel shape or batch bucket is needed.

        `freeze_gc`: then move every object alive (the model, transformers' and torch's modules, ...) to the garbage
        collector's permanent generation (`gc.freeze()`, as vLLM does after graph capture). A busy engine allocates
        thousands of objects a step (beam forks above all), which makes Python run full collections often, and each
        one scanned those hundreds of thousands of objects: 8 of the 33 ms of host time of a 100 x 8-beam step on the
        CPU profile. Frozen objects are still freed by reference counting; only garbage cycles among them stay.
        """
        with self._control():
            self.runner.warm_up_prefill(self.max_num_batched_tokens)
            if self.runner.decode_mode == "graph" or self.runner.compile_decode:
                self.runner.capture_all()
            if freeze_gc:
                gc.collect()
                gc.freeze()
                _unfreeze_at_exit()

    # ------------------------------------------------------------------ requests
    def _normalize_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError("prompt is a string but the engine has no tokenizer; pass token ids or a tokenizer")
            prompt = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if isinstance(prompt, torch.Tensor):
            if prompt.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
                raise TypeError(f"prompt tensor must hold integer token ids, got dtype {prompt.dtype}")
            if prompt.dim() != 1:
                raise ValueError(f"prompt tensor must be 1-D, got shape {tuple(prompt.shape)}")
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise TypeError(f"prompt must be a list of token ids, a 1-D tensor or a string, got {type(prompt).__name__}")
        if any(not isinstance(t, int) or isinstance(t, bool) for t in prompt):
            raise TypeError("prompt must contain only int token ids")
        if not prompt:
            raise ValueError("prompt is empty: give at least one token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        return list(prompt)

    def add_request(self, prompt, request_id=None, params: SamplingParams | None = None, **kwargs) -> object:
        """Queue a request; returns its id. `kwargs` are `SamplingParams` fields (unknown names raise TypeError)."""
        if self._closed:
            raise EngineClosedError("the engine is closed: add_request is refused (create a new Engine)")
        unknown = set(kwargs) - SamplingParams.names()
        if unknown:
            raise TypeError(f"unknown sampling argument(s): {sorted(unknown)}")
        if params is None:
            params = SamplingParams(**kwargs)
        elif kwargs:
            raise TypeError("pass either params or keyword arguments, not both")
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id is not None:
            try:
                hash(request_id)
            except TypeError:
                raise TypeError(f"request_id must be hashable, got {type(request_id).__name__}") from None
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings needs a tokenizer: create the engine with tokenizer=...")
        if not params.eos_token_id and not params.ignore_eos:
            eos = getattr(self.model.generation_config, "eos_token_id", None)
            params.eos_token_id = (eos,) if isinstance(eos, int) else tuple(eos or ())
        token_ids = self._normalize_prompt(prompt)
        total = len(token_ids) + params.max_new_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise ValueError(
                f"prompt length {len(token_ids)} + max_new_tokens {params.max_new_tokens} exceeds the model's "
                f"max_position_embeddings ({self.max_model_len})"
            )
        width, name = max((params.num_return_sequences, "num_return_sequences"), (params.num_beams, "num_beams"))
        if width > self.scheduler.max_num_seqs:
            raise ValueError(f"{name}={width} exceeds max_num_seqs={self.scheduler.max_num_seqs}")
        if width > self.scheduler.max_num_batched_tokens:
            raise ValueError(
                f"{name}={width} exceeds max_num_batched_tokens="
                f"{self.scheduler.max_num_batched_tokens}: its samples are scheduled together, one token each"
            )
        blocks = self.block_manager.blocks_for(total) * width
        if blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"request needs {blocks} KV blocks (prompt {len(token_ids)} + max_new_tokens {params.max_new_tokens})"
                f" but the whole pool has {self.block_manager.num_blocks}; raise num_blocks / kv_cache_memory"
            )
        with self._control():
            if self._closed:
                raise EngineClosedError("the engine is closed: add_request is refused (create a new Engine)")
            if request_id is None:
                request_id = f"req-{next(self._auto_ids)}"
            if request_id in self._groups:
                raise ValueError(f"request_id {request_id!r} is already in use")
            seq = Sequence(token_ids=token_ids, prompt_len=len(token_ids))
            plain = width == 1 and not (params.do_sample or params.needs_processing or params.output_scores)
            group = SequenceGroup(request_id, [seq], next(self._arrivals), params, width=width, plain=plain)
            self._groups[request_id] = group
            self.scheduler.add(group)
        return request_id

    def abort(self, request_id) -> bool:
        """Stop a request now and free its blocks; True if it was still running."""
        with self._control():
            self._drain()
            group = self.scheduler.abort(request_id)
            if group is None:
                return False
            self.sampler.forget(request_id)
            self._unreported.append(group)
            return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def close(self) -> None:
        """Stop serving: abort every unfinished request (its blocks are freed now) and refuse new ones.

        The aborted requests are still reported (finish reason "abort") by the next `step()` or the end of a running
        `stream()`. Thread-safe and idempotent; `with Engine(...) as engine:` closes on exit.

        The GPU memory goes back at once: the KV pool, the CUDA graphs and the compiled step are dropped here, not
        when the last reference to the engine goes (a reference cycle, e.g. a wrapper around one of its methods,
        would otherwise hold the pool until the cycle collector runs, or forever for objects `warm_up()` froze).
        """
        with self._control():
            self._drain()
            self._closed = True
            for group in self.scheduler.groups():
                self.scheduler.finish_group(group, SequenceStatus.FINISHED_ABORTED)
                self._unreported.append(group)
            self.runner.release()
            self.cache.release_pool()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ------------------------------------------------------------------ stepping
    def step(self, *, finished_only: bool = False) -> list[RequestOutput]:
        """Run one iteration; return the requests that advanced (or finished) in it (only finished ones if asked).

        With `finished_only=True` (what `generate()` uses), decode steps of plain greedy requests on the CUDA-graph
        path are pipelined: the next step is scheduled and launched before this one's tokens reach the host, its
        input ids taken from this step's argmax on the device, so the GPU does not wait for the host in between.
        """
        while self._waiters:  # add_request / abort / close from other threads go first (see _control)
            time.sleep(0.0002)
        with self._lock:
            current, self._in_flight = self._in_flight, None
            if current is None:
                sched = self.scheduler.schedule()
                if sched.is_empty:
                    if self.scheduler.has_unfinished() and not self.scheduler.running:
                        raise RuntimeError("the scheduler could not admit any request (this is a bug: please report it)")
                    return self._collect_finished()
                phase = "blocks"  # how far the step got: decides what a failure or an interrupt must undo
                try:
                    self.runner.apply_block_ops(sched)
                    track_sharing(self.stats, *self.block_manager.usage())
                    phase = "forward"
                    with torch.inference_mode():
                        logits, _ = self.runner.execute(sched)
                        phase = "sample"
                        if finished_only and self._can_pipeline(sched, logits):
                            current = self._launch(sched, logits)
                        else:
                            advanced = self._sample_and_update(sched, logits)
                except Exception as error:  # a failing step fails its own requests only
                    advanced = self._fail(sched, error, phase)
                except BaseException as error:  # KeyboardInterrupt & co: leave the engine consistent, then propagate
                    self._interrupted(sched, error, phase)
                    raise
                if current is None:
                    self._track(sched)
                    return self._outputs(advanced, finished_only)
            return self._outputs(self._advance_pipeline(current, finished_only), finished_only)

    def _share(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tensor parallelism: every rank takes the first rank's picks (no-op in a single process)."""
        return tokens if self.tp is None else self.tp.share(tokens)

    def _outputs(self, advanced: list[SequenceGroup], finished_only: bool) -> list[RequestOutput]:
        if finished_only:
            advanced = [g for g in advanced if g.is_finished]
        return [self._output(g) for g in advanced] + self._collect_finished(exclude=advanced)

    # ------------------------------------------------------------------ pipelined decode
    def _can_pipeline(self, sched: SchedulerOutput, logits: torch.Tensor) -> bool:
        """A static-path decode step of plain greedy requests covering every running request, none waiting."""
        scheduler = self.scheduler
        scheduled = sched.scheduled
        return (
            self.runner.last_static
            and not (scheduler.waiting or scheduler.swapped or sched.copies)
            and logits.shape[0] == len(scheduled) == len(scheduler.running)
            and all(item.group.plain for item in scheduled)
        )

    def _launch(self, sched: SchedulerOutput, logits: torch.Tensor) -> _InFlight:
        """Pick the step's tokens on the device and start their copy to the host; do not wait for it.

        Each sequence counts its step as computed and holds `_IN_FLIGHT` where the token will go, so the scheduler
        can plan the next step (one more token for each) before the token is known.
        """
        tokens = self._share(logits.argmax(dim=-1))
        n = tokens.shape[0]
        event = None
        if tokens.is_cuda:
            if not self._token_hosts or self._token_hosts[0].shape[0] < n:
                size = max(n, self.scheduler.max_num_seqs)
                self._token_hosts = [torch.empty(size, dtype=torch.long, pin_memory=True) for _ in range(2)]
            self._token_hosts.reverse()  # never the buffer of the step still in flight
            host = self._token_hosts[0][:n]
            host.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = tokens
        for item in sched.scheduled:
            item.seq.num_computed += item.num_tokens
            item.seq.token_ids.append(_IN_FLIGHT)
        return _InFlight(sched, tokens, host, event)

    def _schedule_next(self, current: _InFlight) -> SchedulerOutput | None:
        """The next decode step of every running request that `current` does not finish by length, if it fits."""
        scheduler = self.scheduler
        if scheduler.waiting or scheduler.swapped:
            return None  # admissions need the normal scheduler: let the pipeline drain
        done = {id(item.group) for item in current.sched.scheduled
                if len(item.seq.token_ids) - item.seq.prompt_len >= item.group.params.max_new_tokens}
        sched = scheduler.schedule_decode_step(done)
        if sched is None:
            return None  # nothing was reserved
        assert self.runner.static_eligible(sched), "a batched decode step is always a static-path step"
        return sched

    def _advance_pipeline(self, current: _InFlight, finished_only: bool) -> list[SequenceGroup]:
        """Launch the step after `current` (when it can), then wait for `current`'s tokens and apply them."""
        sched = self._schedule_next(current) if finished_only else None
        launched, failure, interrupt = None, None, None
        if sched is not None:
            try:
                self.runner.apply_block_ops(sched)
                track_sharing(self.stats, *self.block_manager.usage())
                rows = {id(item.seq): k for k, item in enumerate(current.sched.scheduled)}
                source = (current.tokens, [rows[id(item.seq)] for item in sched.scheduled])
                with torch.inference_mode():
                    logits, _ = self.runner.execute(sched, input_tokens=source)
                    launched = self._launch(sched, logits)
            except Exception as error:
                failure = error
            except BaseException as error:
                interrupt = error
        try:
            advanced = self._apply(current)
        except BaseException as error:  # tokens half applied: fail both steps' requests (as in _interrupted)
            failed = []
            for step in (sched, current.sched):
                if step is not None:
                    self._drop_in_flight(step)
                    failed += [g for g in self._fail(step, error, "sample") if g not in failed]
            if isinstance(error, Exception):
                return failed
            self._unreported.extend(failed)
            raise
        self._track(current.sched)
        if failure is not None:  # the next step's forward failed: its requests fail, as in a normal step
            self._drop_in_flight(sched)
            failed = self._fail(sched, failure, "forward")
            advanced += [g for g in failed if g not in advanced]
        elif interrupt is not None:  # nothing of it was applied: requeue its requests, lose nothing
            self._drop_in_flight(sched)
            self._interrupted(sched, interrupt, "forward")
            self._unreported.extend(g for g in advanced if g.is_finished)  # the applied step's results
            raise interrupt
        elif launched is not None:
            self._in_flight = launched
            self.pipelined_steps += 1
        return advanced

    def _apply(self, current: _InFlight) -> list[SequenceGroup]:
        """Wait for a launched step's tokens; put each where `_IN_FLIGHT` stands, then apply the stop conditions.

        A request that stops here may already be in the next launched step: its token from that step is dropped
        (its blocks are freed now; the stream runs that step before any later use of them). A request aborted while
        its step was in flight keeps the tokens it had before that step.
        """
        if current.event is not None:
            current.event.synchronize()
        tokens = current.host.tolist()
        check_stop = self._check_stop
        advanced, finished = [], []
        for item, token in zip(current.sched.scheduled, tokens):
            seq = item.seq
            ids = seq.token_ids
            at = item.start + item.num_tokens  # where this step's token goes
            if seq.status.is_finished:  # stopped in the step before (reported then) or aborted (reported by abort)
                del ids[at:]
                continue
            later = ids[at + 1 :]  # the next launched step's placeholder, if any
            del ids[at:]
            ids.append(token)
            check_stop(seq, item.group.params)
            advanced.append(item.group)
            if seq.status.is_finished:
                finished.append(item.group)
            else:
                ids.extend(later)
        if finished:
            self.scheduler.remove_finished(finished)
        return advanced

    def _drop_in_flight(self, sched: SchedulerOutput) -> None:
        """Undo `_launch`'s bookkeeping of a step whose tokens will never arrive (its forward failed)."""
        for item in sched.scheduled:
            seq = item.seq
            del seq.token_ids[item.start + item.num_tokens :]
            seq.num_computed = min(seq.num_computed, item.start)

    def _drain(self) -> None:
        """Apply the launched step, if any, before the engine's state is read or changed outside a step."""
        current, self._in_flight = self._in_flight, None
        if current is not None:
            advanced = self._apply(current)
            self._track(current.sched)
            self._unreported.extend(g for g in advanced if g.is_finished)

    def _sample_and_update(self, sched: SchedulerOutput, logits: torch.Tensor) -> list[SequenceGroup]:
        """Pick the next tokens, append them, apply stop conditions and forks; return the groups that advanced."""
        scheduled = sched.scheduled
        if logits.shape[0] == len(scheduled) and all(item.group.plain for item in scheduled):
            return self._update_plain(scheduled, logits)
        rows, params, histories, num_out, keys, owners = [], [], [], [], [], []
        beam_entries = []
        logit_row = 0
        for item in scheduled:
            item.seq.num_computed += item.num_tokens
            if not item.sample:
                continue
            p = item.group.params
            if p.num_beams > 1:  # beam groups are scored together by hf_paged.beam
                beam_entries.append((item, logit_row))
                logit_row += 1
                continue
            copies = p.num_return_sequences if (len(item.group.seqs) == 1 and not item.seq.output_ids) else 1
            for _ in range(copies):
                rows.append(logit_row)
                params.append(p)
                histories.append(item.seq.token_ids)
                num_out.append(item.seq.num_tokens - item.seq.prompt_len)
                keys.append(item.group.request_id)
                owners.append(item)
            logit_row += 1
        advanced: dict[int, SequenceGroup] = {}
        if rows:
            if rows == list(range(logits.shape[0])):
                picked = logits  # one row per sampling sequence, in order: no gather, no index upload
            else:
                picked = logits.index_select(0, torch.tensor(rows, device=logits.device))
            tokens, scores = self.sampler(picked, params, histories, num_out, keys)
            token_list = self._share(tokens).tolist()
            forks: dict[int, int] = {}
            for j, (item, token) in enumerate(zip(owners, token_list)):
                seq = item.seq
                if forks.get(id(item), 0) > 0:
                    seq = self._fork(item)
                forks[id(item)] = forks.get(id(item), 0) + 1
                seq.token_ids.append(int(token))
                if item.group.params.output_scores:
                    item.group.data.setdefault(seq.seq_id, []).append(scores[j].detach().to("cpu"))
                self._check_stop(seq, item.group.params)
                advanced.setdefault(id(item.group), item.group)
        if beam_entries:
            for group in self.beam_search.step(beam_entries, logits):
                advanced.setdefault(id(group), group)
        groups = list(advanced.values())
        for group in groups:
            for seq in group.seqs:
                if seq.status.is_finished:
                    self.scheduler.free_seq(seq)
        self.scheduler.remove_finished(groups)
        return groups

    def _update_plain(self, scheduled, logits: torch.Tensor) -> list[SequenceGroup]:
        """The hot path: every scheduled sequence is a plain greedy one that samples; its token is the argmax."""
        tokens = self._share(logits.argmax(dim=-1)).tolist()  # the step's one host sync
        check_stop = self._check_stop
        finished = []
        for item, token in zip(scheduled, tokens):
            seq = item.seq
            seq.num_computed += item.num_tokens
            seq.token_ids.append(token)
            check_stop(seq, item.group.params)
            if seq.status.is_finished:
                finished.append(item.group)
        if finished:
            self.scheduler.remove_finished(finished)
        return [item.group for item in scheduled]

    def _fork(self, item) -> Sequence:
        """Parallel sampling: a new sample shares every block of the prompt (ref counts, copy-on-write later)."""
        parent = item.seq
        child = Sequence(token_ids=parent.token_ids[: parent.num_computed], prompt_len=parent.prompt_len)
        child.num_computed = parent.num_computed
        child.status = SequenceStatus.RUNNING
        self.block_manager.fork(parent.seq_id, child.seq_id)
        item.group.seqs.append(child)
        return child

    def _check_stop(self, seq: Sequence, p: SamplingParams) -> None:
        token_ids = seq.token_ids
        produced = len(token_ids) - seq.prompt_len
        if not p.ignore_eos and token_ids[-1] in p.eos_token_id and produced >= p.min_new_tokens:
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, "eos"
        elif produced >= p.max_new_tokens:
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_LENGTH, "length"
        elif p.stop_strings and self._hits_stop_string(seq, p):
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, "stop_string"

    def _hits_stop_string(self, seq: Sequence, p: SamplingParams) -> bool:
        window = max(len(s) for s in p.stop_strings) + 8
        text = self.tokenizer.decode(seq.output_ids[-window:], skip_special_tokens=False)
        return any(s in text for s in p.stop_strings)

    def _fail(self, sched: SchedulerOutput, error: BaseException, phase: str = "forward") -> list[SequenceGroup]:
        """Fail the requests scheduled in a step that raised (finish reason "error", `error` attached).

        If the block operations raised (`phase == "blocks"`), the step's swaps may be incomplete: the groups they
        moved are not failed (their tokens are intact) but recomputed from scratch instead of resumed.
        """
        failed = []
        for item in sched.scheduled:
            if item.group not in failed:
                failed.append(item.group)
        for group in failed:
            group.error = error
            self.scheduler.finish_group(group, SequenceStatus.FINISHED_ERROR)
        if phase == "blocks":
            for group in self._swapped_in_step(sched):
                if group not in failed:
                    self._requeue(group)
        self.runner.invalidate_tables()
        return failed

    def _interrupted(self, sched: SchedulerOutput, error: BaseException, phase: str) -> None:
        """A step was interrupted (KeyboardInterrupt, SystemExit): keep every request whole and the engine usable.

        Before sampling began nothing of the step's requests changed but their reserved slots and possibly half
        written K/V: they go back to the waiting queue and are recomputed (with the groups of the step's swaps, whose
        copies may be incomplete). During sampling their tokens and forks may be half applied: they are failed.
        """
        if phase == "sample":
            self._unreported.extend(self._fail(sched, error, phase))  # the step returns nothing: report them next
            return
        groups = []
        for group in [item.group for item in sched.scheduled] + (self._swapped_in_step(sched) if phase == "blocks"
                                                                  else []):
            if group not in groups:
                groups.append(group)
        for group in groups:
            self._requeue(group)
        self.runner.invalidate_tables()

    def _swapped_in_step(self, sched: SchedulerOutput) -> list[SequenceGroup]:
        """Groups whose blocks this step's swaps moved (swapped out, or swapped in and still running)."""
        groups = [g for g in sched.preempted if g in self.scheduler.swapped] if sched.swap_out else []
        if sched.swap_in:
            moved = {gpu for _, gpu in sched.swap_in}
            bm = self.block_manager
            for group in self.scheduler.running:
                if any(bm.has_seq(s.seq_id) and moved.intersection(bm.block_table(s.seq_id))
                       for s in group.live_seqs()):
                    groups.append(group)
        return groups

    def _requeue(self, group: SequenceGroup) -> None:
        """Send a running or swapped group back to the waiting queue, to be recomputed (its blocks are freed)."""
        scheduler = self.scheduler
        for seq in group.live_seqs():
            scheduler.free_seq(seq)
            seq.num_computed = 0
            seq.status = SequenceStatus.WAITING
        for queue in (scheduler.running, scheduler.swapped):
            if group in queue:
                queue.remove(group)
        if group not in scheduler.waiting:
            scheduler._insert(scheduler.waiting, group)

    def _track(self, sched: SchedulerOutput) -> None:
        self.stats["steps"] += 1
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

    @contextlib.contextmanager
    def _control(self):
        """The engine lock, for calls that may come from any thread (add_request, abort, close, ...).

        Python's locks are not fair: a thread that steps in a loop would take the lock back before a waiting
        `abort()` woke up, and a streaming server's aborts and new requests could wait for many steps. So these calls
        announce themselves, and `step()` waits for every announced call to get through before it locks.
        """
        with self._waiters_lock:
            self._waiters += 1
        try:
            self._lock.acquire()
        finally:
            with self._waiters_lock:
                self._waiters -= 1
        try:
            yield
        finally:
            self._lock.release()

    def _collect_finished(self, exclude: Iterable[SequenceGroup] = ()) -> list[RequestOutput]:
        """Outputs of the requests finished outside a step (aborted, closed) that were not reported yet."""
        if not self._unreported:
            return []
        skip = {id(g) for g in exclude}
        done, self._unreported = self._unreported, []
        # `is g`: an id may already belong to a new request (ids are reusable once reported)
        return [self._output(g) for g in done if id(g) not in skip and self._groups.get(g.request_id) is g]

    def _output(self, group: SequenceGroup) -> RequestOutput:
        finished = group.is_finished
        if finished:
            self._groups.pop(group.request_id, None)
            self.sampler.forget(group.request_id)
        outputs = []
        for index, seq in enumerate(group.seqs):
            reason = seq.stop_reason if seq.status.is_finished else None
            if seq.status == SequenceStatus.FINISHED_ABORTED:
                reason = "abort"
            elif seq.status == SequenceStatus.FINISHED_ERROR:
                reason = "error"
            text = None
            if finished and self.tokenizer is not None:
                text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
            beam_done = finished and getattr(group.params, "num_beams", 1) > 1 and reason in ("eos", "length")
            score = seq.cumulative_logprob if beam_done else None
            scores = group.data.get(seq.seq_id)
            outputs.append(CompletionOutput(index, list(seq.output_ids), reason, text, scores, score))
        prompt = group.seqs[0].token_ids[: group.seqs[0].prompt_len]
        return RequestOutput(group.request_id, prompt, outputs, finished, group.num_preemptions, group.error)

    # ------------------------------------------------------------------ convenience
    def stream(self) -> Iterator[RequestOutput]:
        """Step until every request is done, yielding each request's state whenever it advances."""
        while self.has_unfinished():
            yield from self.step()
        with self._control():  # aborted (or closed) after the last step, e.g. from another thread: still report them
            self._drain()
            leftovers = self._collect_finished()
        yield from leftovers

    def generate(self, prompts, params=None, *, use_tqdm: bool | None = None, **kwargs) -> list[RequestOutput]:
        """Run `prompts` (token lists, 1-D tensors or strings) to completion; outputs in input order.

        `params` is one `SamplingParams` for all or a list with one per prompt; `kwargs` build a shared one.
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
                ids.append(self.add_request(prompt, params=_copy_params(p)))
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
                if not self.has_unfinished():
                    break
                for out in self.step(finished_only=True):
                    if out.finished and out.request_id in wanted and out.request_id not in results:
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
                if request_id not in results and request_id in self._groups:
                    results[request_id] = self._output(self._groups[request_id])
        return [results[request_id] for request_id in ids]

    def kv_stats(self):
        return self.block_manager.stats()

    def prefix_cache_stats(self):
        """Prefix-cache hits, saved prefill tokens and cached blocks (`hf_paged.block_manager.PrefixCacheStats`)."""
        return self.block_manager.prefix_cache_stats()

    def sharing_stats(self) -> SharingStats:
        """Blocks saved by sharing (parallel sampling, beam search) now and averaged over the engine's steps."""
        return sharing_stats(self.stats, self.block_manager.stats())


def _copy_params(p: SamplingParams) -> SamplingParams:
    clone = SamplingParams.__new__(SamplingParams)
    clone.__dict__.update(p.__dict__)
    clone.extra = dict(p.extra)
    return clone
