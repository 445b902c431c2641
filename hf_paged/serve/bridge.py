"""The engine in one background thread, and its outputs delivered to asyncio without blocking the event loop.

`EngineBridge.submit` registers an asyncio queue for a request id, then adds the request (the engine's control
calls are thread-safe and fair: they go in between steps). The stepping thread runs `engine.step()` while anything
is unfinished and hands each `RequestOutput` to its queue with `loop.call_soon_threadsafe`; it sleeps on an event
when idle. `abort` frees the request's blocks at once. A step that fails fails its own requests (the engine marks
them with an error); an error escaping `step()` itself fails every request in flight, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import threading
import time

from ..engine import Engine, RequestOutput, SamplingParams
from .engine_loop import run_engine_loop
from .structured import warm_up_grammars

__all__ = ["EngineBridge", "ReplicaUnavailable", "RequestFailed", "RequestRefused"]



def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


class RequestFailed(RuntimeError):
    """The engine failed a request (its step raised); answered with 500."""


class RequestRefused(RequestFailed):
    """A data-parallel replica's engine refused the request (`add_request` raised ValueError / TypeError there, after
    the front had routed it); answered with 400, as the same refusal by a local engine."""


class ReplicaUnavailable(RequestFailed):
    """The data-parallel replica serving the request went away; answered with 503 (the client may retry)."""


class EngineBridge:
    """Owns the stepping thread of one `Engine`; every method but `shutdown` is safe to call from the event loop."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="hf-paged-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ event-loop side
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               queue: asyncio.Queue | None = None, affinity: str | None = None) -> asyncio.Queue:
        """Add a request; its outputs arrive on `queue` (a new one if None; several requests may share one), the
        last one with `finished`. Raises the engine's ValueError / TypeError for a request it refuses. `affinity`
        (a routing key of data-parallel serving, `ReplicaRouter`) means nothing to one engine."""
        if not self._accepting:
            raise RuntimeError("the server is shutting down")
        queue = asyncio.Queue() if queue is None else queue
        with self._lock:
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
        try:
            self.engine.add_request(prompt_ids, request_id=request_id, params=params)
        except BaseException:
            with self._lock:
                self._queues.pop(request_id, None)
            raise
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone, stop string seen): its blocks are freed now; nothing more is delivered."""
        with self._lock:
            known = self._queues.pop(request_id, None) is not None
        if known:
            self.engine.abort(request_id)

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._queues)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ what the app asks (as of a ReplicaRouter)
    def replica_of(self, request_id: str) -> int | None:
        return None

    @property
    def model_name(self) -> str:
        return str(getattr(self.engine.model, "name_or_path", "") or "hf-paged")

    @property
    def max_model_len(self) -> int | None:
        return self.engine.max_model_len

    def lora_names(self) -> list[str]:
        """The engine's LoRA adapters (a request's `model` may name one)."""
        return self.engine.lora_names()

    def context_limit(self) -> int:
        """Tokens a request (prompt and output) may hold: the model's context or the whole KV pool."""
        pool = self.engine.block_manager.token_capacity(self.engine.scheduler.max_num_batched_tokens)
        return pool if self.engine.max_model_len is None else min(pool, self.engine.max_model_len)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile `params`' grammar into the engine's cache (ValueError: invalid; ImportError: no xgrammar)."""
        self.engine.structured.compiled(params)

    def warm_up_grammars(self) -> bool:
        return warm_up_grammars(self.engine)

    def queue_stats(self) -> dict:
        return self.engine.queue_stats()

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body) of /health."""
        if not self.alive:
            return 503, {"status": "engine thread stopped"}
        return 200, {"status": "ok"}

    # ------------------------------------------------------------------ stepping thread
    def _deliver(self, outs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their queues: one wake-up of each event loop per step, not one per request
        (with a hundred streams, per-output wake-ups kept the loop busy and took the GIL from the stepping thread)."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for out in outs:
                target = (self._queues.pop(out.request_id, None) if out.finished
                          else self._queues.get(out.request_id))
                if target is not None:
                    batches.setdefault(target[0], []).append((target[1], out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed (shutdown): nobody is listening any more
                pass

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            pending, self._queues = self._queues, {}
        for request_id, (loop, queue) in pending.items():
            self.engine.abort(request_id)
            out = RequestOutput(request_id, [], [], True, error=error)
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:
                pass

    def _run(self) -> None:
        run_engine_loop(self.engine, self._wake, lambda: self._stopping, self._deliver, self._fail_all)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, grace: float = 5.0) -> None:
        """Refuse new requests, let those in flight finish for up to `grace` seconds, abort the rest, stop the
        thread and close the engine (its KV pool and graphs go back at once)."""
        self._accepting = False
        deadline = time.monotonic() + grace
        while self.engine.has_unfinished() and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        self.engine.close()  # aborts what is left; the thread reports those outputs, then exits
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._fail_all(RequestFailed("the server shut down"))
