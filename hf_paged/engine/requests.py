"""Taking requests in and out of the engine: prompt checks, `add_request`, `abort`, `close`, `reset_prefix_cache`,
and the fair engine lock that lets other threads in between steps. A mixin of `Engine` (state set up by
`Engine.__init__`).

Threads: `add_request`, `abort` and `close` may be called from any thread while one thread steps (`step` /
`stream`); they take the engine lock, which a step holds for its duration. Python's locks are not fair, so these
calls announce themselves and `step()` lets every announced call through before it locks again (`_control`). An
aborted (or closed) request's final output (finish reason "abort") comes from the next `step()`; `stream()` also
yields those left when it ends. Run one stepping loop at a time (two would split the outputs between them).

`close()` aborts every unfinished request, frees its blocks and makes `add_request` raise `EngineClosedError` (a
`RuntimeError`); it is idempotent, and `with Engine(...) as engine:` closes on exit.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..core import Sequence, SequenceGroup, SequenceStatus
from .device_sampling import device_params
from .params import SamplingParams
from .prompt_logprobs import start_scoring

__all__ = ["EngineClosedError", "Requests"]


class EngineClosedError(RuntimeError):
    """A request was added to an engine after `Engine.close()`."""


class Requests:
    """Request registry and thread-safe control calls of `Engine`."""

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
        adapter = self.lora.resolve(params.lora) if params.lora is not None else None  # ValueError naming it
        # the grammar is compiled (or found in the cache) before the lock: a compilation never holds a step
        compiled = self.structured.compiled(params) if params.constraint is not None else None
        scored_prompt = token_ids
        if params.prompt_logprobs_start is not None:
            token_ids = _prompt_to_compute(token_ids, params)
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
        blocks = self.block_manager.blocks_to_hold(total, self.scheduler.max_num_batched_tokens) * width
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
            if request_id in self.registry.groups:
                raise ValueError(f"request_id {request_id!r} is already in use")
            seq = Sequence(token_ids=token_ids, prompt_len=len(token_ids))
            spec = device_params(params, self.picker.request_seed(params.seed))
            single = spec is not None and params.num_return_sequences == 1
            group = SequenceGroup(request_id, [seq], next(self._arrivals), params, width=width,
                                  plain=single and compiled is None, masked=single and compiled is not None)
            group.data["device_params"] = spec
            if adapter is not None:  # its adapter's id: its slot at each step, and its prefix-cache blocks' salt
                group.data["lora"] = group.cache_salt = adapter
            if compiled is not None:
                self.structured.start(group, compiled)
            if params.prompt_logprobs_start is not None:
                start_scoring(group, scored_prompt, params.prompt_logprobs_start, params.prompt_top_logprobs)
            group.metrics["arrival_time"] = time.perf_counter()
            self.registry.groups[request_id] = group
            self.scheduler.add(group)
            self.weights.due = True  # the next step checks the weights before admitting it
        return request_id

    def abort(self, request_id) -> bool:
        """Stop a request now and free its blocks; True if it was still running."""
        with self._control():
            self._drain()
            group = self.scheduler.abort(request_id)
            if group is None:
                return False
            self.sampler.forget(request_id)
            self.registry.unreported.append(group)
            return True

    def has_unfinished(self) -> bool:
        """Requests still running or waiting, or finished outputs not yet returned by `step()` (those a `generate()`
        call on a shared engine finished for other callers). Reports of aborted requests do not count (as before a
        `generate()` stepped them): the next `step()` still returns them, but nothing is left to wait for."""
        return self.scheduler.has_unfinished() or any(
            any(c.finish_reason != "abort" for c in out.outputs) for out in self.registry.handed_back)

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
                self.registry.unreported.append(group)
            self.runner.release()
            self.cache.release_pool()
            self.lora.close()

    def add_lora(self, name: str, path: str) -> None:
        """Load the PEFT LoRA adapter saved in directory `path` as `name`; requests pick it with
        `SamplingParams(lora=name)` (`hf_paged.engine.lora`). The first adapter that targets a linear wraps it in the
        model (the CUDA graphs are recorded again): add adapters before `warm_up()` where that matters."""
        self.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload the adapter `name` (a ValueError while unfinished requests use it, or for an unknown name)."""
        self.lora.remove(name)

    def lora_names(self) -> list[str]:
        """The names of the loaded LoRA adapters."""
        return self.lora.names()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Requests:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def reset_prefix_cache(self, recompute_running: bool = False) -> int:
        """Forget every cached prefix block (returns how many); new requests compute their K/V afresh.

        `recompute_running`: also send the running and swapped requests back to be recomputed from their tokens
        (their blocks are freed), e.g. after changing the weights in the middle of their generation. Without it they
        go on with the K/V they hold, which is never shared with other requests (`hf_paged.engine.kv_lifetime`).
        """
        if not isinstance(recompute_running, bool):
            raise TypeError(f"recompute_running must be a bool, got {recompute_running!r}")
        with self._control():
            self._drain()
            dropped = self.block_manager.reset_prefix_cache()
            if recompute_running:
                for group in list(self.scheduler.running) + list(self.scheduler.swapped):
                    self.recovery.requeue(group)
                self.runner.invalidate_tables()
            self.weights.rebase()  # the reset is the new reference point
        return dropped

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


def _prompt_to_compute(token_ids: list[int], params: SamplingParams) -> list[int]:
    """The tokens a prompt-scoring request computes: all of them, or all but the last when it only scores
    (`max_new_tokens=0`: the last token is a target, its K/V never needed). Checks `prompt_logprobs_start`."""
    start = params.prompt_logprobs_start
    if not start < len(token_ids):
        raise ValueError(f"prompt_logprobs_start must be in [1, len(prompt) - 1] = [1, {len(token_ids) - 1}] "
                         f"(the index of the first prompt token to score), got {start}")
    return token_ids[:-1] if params.max_new_tokens == 0 else token_ids
