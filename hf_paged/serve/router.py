"""Data parallelism on one host: N replica processes (one engine each, one device each) behind one HTTP front.

`ReplicaRouter` is what `build_app` serves instead of an `Engine` (`hf-paged serve --data-parallel-size N`). It
offers the app the same calls as `EngineBridge` (submit, abort, limits, stats, health, shutdown), so the whole API
layer (tokenising, chat templates, stop strings, tool calls, admission limits, latency metrics) runs once, in the
front, as with one engine; only engine requests cross to the replicas (`hf_paged.serve.replica`: `multiprocessing`
processes, each with a command queue and a one-way output pipe). This is vLLM's data-parallel layout (one
API server, N engine cores) rather than N whole servers behind a proxy.

* Routing: `AffinityPolicy` (prefix affinity on the tokenised prompt, least-outstanding-requests otherwise, an
  `X-HF-Paged-Affinity` key pins).
* Streaming: a replica sends one message per engine step with the tokens new in it; a watcher thread per replica
  rebuilds the cumulative `RequestOutput`s and hands them to the event loop, as `EngineBridge` does.
* Aborts (client gone, stop string, `--request-timeout`) travel to the replica, which frees the blocks at once.
  `--max-queue-len` is counted in the front, so it bounds the whole server.
* Failure: a replica process that exits is seen within `_POLL` seconds; its requests in flight end with
  `ReplicaUnavailable` (HTTP 503, also as a stream's last event), the others keep serving, and it is restarted (after
  a back-off that doubles while restarts keep failing quickly). A replica that fails at start-up fails `start()`.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass, field

from ..engine import CompletionOutput, RequestOutput, SamplingParams
from ..engine.grammar import grammar_cache
from .affinity import AffinityPolicy
from .bridge import ReplicaUnavailable, RequestFailed, RequestRefused
from .replica import ReplicaSpec, replica_main

__all__ = ["ReplicaRouter"]

log = logging.getLogger("hf_paged.serve.router")

_POLL = 0.2  # seconds between checks that a quiet replica is still alive
_STAT_KEYS = ("waiting", "running", "swapped", "kv_blocks_total", "kv_blocks_used", "preemptions", "steps")


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


@dataclass
class _Pending:
    """One engine request in flight: where its outputs go, and its output so far (rebuilt from deltas)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    replica: int
    prompt_ids: list[int]
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list] = field(default_factory=dict)
    prompt: tuple | None = None

    def assemble(self, encoded: tuple) -> RequestOutput:
        """The cumulative `RequestOutput` of a replica's delta (`replica.encode`)."""
        request_id, finished, error, preemptions, metrics, prompt, completions = encoded
        outputs = []
        for index, start, new, reason, text, score, lp_start, new_lps in completions:
            tokens = self.tokens[index] = self.tokens.get(index, [])[:start] + new
            lps = None
            if new_lps is not None:
                lps = self.logprobs[index] = self.logprobs.get(index, [])[:lp_start] + new_lps
            outputs.append(CompletionOutput(index, tokens, reason, text, None, score, lps))
        if prompt is not None:
            self.prompt = prompt
        scores, tops = self.prompt if self.prompt is not None else (None, None)
        return RequestOutput(request_id, self.prompt_ids, outputs, finished, preemptions, _error(error), metrics,
                             scores, tops)


def _context():
    """The forkserver start method, its server having imported torch, transformers and the engine once: a replica
    then starts (and restarts) in the time of building its model, not of importing torch again, and still
    from a process that never touched CUDA (which cannot be forked). Spawn where there is no forkserver, or where
    `HF_PAGED_REPLICA_START=spawn` asks for a fresh interpreter per replica (slower starts, nothing inherited)."""
    method = os.environ.get("HF_PAGED_REPLICA_START", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"HF_PAGED_REPLICA_START must be forkserver or spawn, got {method!r}")
    if method == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["hf_paged.serve.replica"])
    return ctx


def _error(error: tuple | None) -> BaseException | None:
    if error is None:
        return None
    kind, name, message = error
    if kind == "refused":
        return RequestRefused(message)
    if kind == "unavailable":
        return ReplicaUnavailable(message)
    return RequestFailed(f"{name}: {message}")


class _Replica:
    """The front's handle on one replica process (replaced wholesale, queues included, when it restarts)."""

    def __init__(self, index: int, device: str) -> None:
        self.index, self.device = index, device
        self.state = "starting"  # starting -> ready -> (restarting -> starting -> ready ...) | failed | stopped
        self.process = None
        self.inbox = self.outbox = None
        self.pending: set = set()
        self.restarts = 0
        self.routed = 0
        self.failure: str | None = None
        self.info: dict = {}
        self.started_at = 0.0
        self.stats_waiters: dict[int, list] = {}


class ReplicaRouter:
    """N engine replicas behind one front (see the module docstring). `devices[i]` is replica i's device."""

    def __init__(self, spec: ReplicaSpec, devices: list[str], *, imbalance: int = 8, restart: bool = True,
                 max_backoff: float = 30.0) -> None:
        if not devices:
            raise ValueError("devices must name at least one device (one replica each)")
        self.spec, self.devices, self.restart = spec, list(devices), restart
        self.max_backoff = max_backoff
        self.imbalance = imbalance
        self._ctx = _context()
        self._replicas = [_Replica(i, d) for i, d in enumerate(self.devices)]
        self._pending: dict[object, _Pending] = {}
        self._lock = threading.Lock()
        self._tokens = itertools.count()
        self._accepting = False
        self._closing = False
        self._started = False
        self._watchers: list[threading.Thread] = []
        self.policy: AffinityPolicy | None = None
        self.tokenizer = None
        self.info: dict = {}
        atexit.register(self._kill_all)  # runs before multiprocessing's own exit hook would wait for the replicas

    @property
    def num_replicas(self) -> int:
        return len(self._replicas)

    @property
    def started(self) -> bool:
        """`start()` returned: every replica got ready once (some may be restarting now)."""
        return self._started

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 900.0) -> ReplicaRouter:
        """Spawn every replica and wait until all are ready; RuntimeError (with the replica's traceback) if one
        fails or does not get ready within `timeout` seconds."""
        for r in self._replicas:
            self._spawn(r)
            watcher = threading.Thread(target=self._watch, args=(r,), name=f"hf-paged-replica-{r.index}-watch",
                                       daemon=True)
            self._watchers.append(watcher)
            watcher.start()
        deadline = time.monotonic() + timeout
        while any(r.state == "starting" for r in self._replicas):
            if time.monotonic() > deadline:
                self.shutdown(0)
                raise RuntimeError(f"the replicas did not get ready within {timeout:g} s")
            time.sleep(0.05)
        failed = [r for r in self._replicas if r.state != "ready"]
        if failed:
            self.shutdown(0)
            raise RuntimeError(f"replica {failed[0].index} ({failed[0].device}) failed to start:\n"
                               f"{failed[0].failure or f'it exited with code {failed[0].process.exitcode}'}")
        first = self._replicas[0].info
        self.tokenizer = first.pop("tokenizer", None)
        for r in self._replicas[1:]:
            r.info.pop("tokenizer", None)
        # the front checks requests against the smallest replica (their pools may differ on unequal GPUs)
        pools = [r.info["pool_tokens"] for r in self._replicas]
        self.info = {**first, "pool_tokens": min(pools)}
        self.policy = AffinityPolicy(self.num_replicas, first["block_size"], imbalance=self.imbalance)
        self._started = self._accepting = True
        return self

    def _spawn(self, r: _Replica) -> None:
        r.inbox = self._ctx.Queue()
        r.outbox, writer = self._ctx.Pipe(duplex=False)
        r.process = self._ctx.Process(target=replica_main, args=(self.spec, r.index, r.device, r.inbox, writer),
                                      name=f"hf-paged-replica-{r.index}")
        r.state, r.started_at = "starting", time.monotonic()
        r.process.start()
        writer.close()  # the replica's copy is the only write end left: its death is an end-of-file here

    def shutdown(self, grace: float = 5.0) -> None:
        """Refuse new requests, let each replica finish what runs for up to `grace` seconds, then stop them all
        (whatever is left is aborted and answered with an error)."""
        self._accepting = False
        self._closing = True
        with self._lock:
            for r in self._replicas:
                if r.process is not None and r.process.is_alive() and r.state in ("starting", "ready"):
                    r.inbox.put(("stop", grace))  # one that is starting reads it once it is ready
        for r in self._replicas:
            if r.process is not None:
                r.process.join(timeout=grace + 15)
                if r.process.is_alive():
                    r.process.kill()
                    r.process.join(timeout=5)
        for watcher in self._watchers:
            watcher.join(timeout=5)
        self._fail(list(self._pending), RequestFailed("the server shut down"))

    def _kill_all(self) -> None:
        self._closing = True
        for r in self._replicas:
            if r.process is not None and r.process.is_alive():
                r.process.kill()

    # ------------------------------------------------------------------ the watcher of one replica
    def _watch(self, r: _Replica) -> None:
        """Read the replica's messages; when its process is gone, fail its requests and restart it."""
        quick_failures = 0
        while True:
            try:
                msg = r.outbox.recv() if r.outbox.poll(_POLL) else None
                if msg is None and r.process.is_alive():
                    continue
            except (EOFError, OSError):  # the replica closed its pipe: it exits, or died
                msg = None
            if msg is not None:
                self._handle(r, msg)
                continue
            r.process.join(timeout=10)
            if r.process.is_alive():  # it closed the pipe but hangs: it serves nobody now
                r.process.kill()
                r.process.join(timeout=5)
            code = r.process.exitcode
            restart = self.restart and self._started and not self._closing
            with self._lock:  # from now on nothing is routed to it, and its queue is not written to
                r.state = "restarting" if restart else ("stopped" if self._closing else "failed")
                lost, r.pending = list(r.pending), set()
                r.outbox.close()
                r.inbox.close()
                r.inbox.cancel_join_thread()  # commands nobody will read: do not wait for them at exit
            if not self._closing:
                log.error("replica %d (%s, pid %s) exited with code %s; %d requests lost%s", r.index, r.device,
                          r.process.pid, code, len(lost), "; restarting it" if restart else "")
            self._fail(lost, ReplicaUnavailable(f"replica {r.index} exited (code {code}) while serving this "
                                                f"request; retry"))
            if not restart:
                return
            quick_failures = quick_failures + 1 if time.monotonic() - r.started_at < 60 else 0
            wait = min(self.max_backoff, 0.5 * 2 ** max(0, quick_failures - 1))
            end = time.monotonic() + wait
            while time.monotonic() < end and not self._closing:
                time.sleep(0.05)
            if self._closing:
                r.state = "stopped"
                return
            r.restarts += 1
            self._spawn(r)

    def _handle(self, r: _Replica, msg: tuple) -> None:
        op = msg[0]
        if op == "out":
            self._deliver(msg[1])
        elif op == "ready":
            r.info = msg[1]
            r.failure = None
            with self._lock:
                r.state = "ready"
            if self._started:
                log.warning("replica %d (%s) is serving again (restart %d)", r.index, r.device, r.restarts)
        elif op == "failed":
            r.failure = msg[1]
            log.error("replica %d (%s) failed:\n%s", r.index, r.device, msg[1])
        elif op == "stats":
            waiter = r.stats_waiters.pop(msg[1], None)
            if waiter is not None:
                waiter[1] = msg[2]
                waiter[0].set()

    def _deliver(self, batch: list[tuple]) -> None:
        found = []
        with self._lock:  # held briefly: the event loop takes it to submit and abort
            for encoded in batch:
                request_id, finished = encoded[0], encoded[1]
                p = self._pending.pop(request_id, None) if finished else self._pending.get(request_id)
                if p is None:
                    continue  # aborted in the front already
                if finished:
                    self._replicas[p.replica].pending.discard(request_id)
                found.append((p, encoded))
        per_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for p, encoded in found:  # a request's outputs are only rebuilt here, by its replica's watcher
            per_loop.setdefault(p.loop, []).append((p.queue, p.assemble(encoded)))
        for loop, items in per_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: nobody listens any more
                pass

    def _fail(self, request_ids: list, error: BaseException) -> None:
        per_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for request_id in request_ids:
                p = self._pending.pop(request_id, None)
                if p is not None:
                    self._replicas[p.replica].pending.discard(request_id)
                    per_loop.setdefault(p.loop, []).append(
                        (p.queue, RequestOutput(request_id, p.prompt_ids, [], True, error=error)))
        for loop, items in per_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass

    # ------------------------------------------------------------------ what the app calls (event loop side)
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               queue: asyncio.Queue | None = None, affinity: str | None = None) -> asyncio.Queue:
        """Route a request to a replica; its outputs arrive on `queue` as with `EngineBridge.submit`. A refusal by
        the replica's engine arrives as a finished output with a `RequestRefused` error. RuntimeError when the
        server is shutting down or no replica is up."""
        if not self._accepting:
            raise RuntimeError("the server is shutting down" if self._closing else "the replicas are not started")
        q = asyncio.Queue() if queue is None else queue
        loop = asyncio.get_running_loop()
        with self._lock:
            loads = [len(r.pending) if r.state == "ready" else None for r in self._replicas]
            try:
                index = self.policy.choose(prompt_ids, loads, affinity)
            except LookupError:
                raise RuntimeError(f"no replica is serving ({', '.join(r.state for r in self._replicas)}); "
                                   f"retry later") from None
            r = self._replicas[index]
            r.pending.add(request_id)
            r.routed += 1
            self._pending[request_id] = _Pending(loop, q, index, list(prompt_ids))
            r.inbox.put(("add", request_id, list(prompt_ids), params))
        return q

    def abort(self, request_id: str) -> None:
        """Stop a request: the front forgets it now, its replica frees its blocks when the message arrives."""
        with self._lock:
            p = self._pending.pop(request_id, None)
            if p is None:
                return
            r = self._replicas[p.replica]
            r.pending.discard(request_id)
            if r.state == "ready":  # a replica that died took the request with it
                r.inbox.put(("abort", request_id))

    def replica_of(self, request_id: str) -> int | None:
        p = self._pending.get(request_id)
        return None if p is None else p.replica

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def alive(self) -> bool:
        return any(r.state == "ready" for r in self._replicas)

    @property
    def model_name(self) -> str:
        return self.info.get("model_name", "hf-paged")

    @property
    def max_model_len(self) -> int | None:
        return self.info.get("max_model_len")

    def lora_names(self) -> list[str]:
        """The LoRA adapters every replica holds (`ReplicaSpec.loras`, added when it starts)."""
        return [name for name, _ in self.spec.loras]

    def context_limit(self) -> int:
        """Tokens a request (prompt and output) may hold: the model's context or the smallest replica's pool."""
        pool, longest = self.info["pool_tokens"], self.info.get("max_model_len")
        return pool if longest is None else min(pool, longest)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile `params`' grammar in the front (ValueError: invalid; ImportError: no xgrammar), so that a bad one
        is a 400 before the request is routed; each replica compiles its own copy when the request arrives."""
        kind, text = params.constraint
        grammar_cache(self.tokenizer, self.info["logits_width"], self.info["stop_ids"]).get(kind, text)

    def warm_up_grammars(self) -> bool:
        try:
            grammar_cache(self.tokenizer, self.info["logits_width"], self.info["stop_ids"])
        except (ImportError, ValueError):
            return False
        return True

    # ------------------------------------------------------------------ health and metrics
    def health(self) -> tuple[int, dict]:
        """(HTTP status, body) of /health: 200 while any replica serves ("ok", or "degraded" when some do not)."""
        replicas = [{"replica": r.index, "device": r.device, "state": r.state, "restarts": r.restarts,
                     "pid": r.process.pid if r.process is not None else None, "pending": len(r.pending)}
                    for r in self._replicas]
        up = sum(r.state == "ready" for r in self._replicas)
        status = "ok" if up == self.num_replicas else ("degraded" if up else "unavailable")
        return (200 if up else 503), {"status": status, "replicas": replicas}

    def queue_stats(self, timeout: float = 2.0) -> dict:
        """Every ready replica's `Engine.queue_stats()` summed (the prefix-cache hit rate: their mean), with the
        per-replica figures under "replicas" and the router's counts under "router". Blocking: call it in a thread."""
        waiters = {}
        with self._lock:
            for r in self._replicas:
                if r.state == "ready":
                    token = next(self._tokens)
                    waiter = r.stats_waiters[token] = [threading.Event(), None]
                    waiters[r.index] = waiter
                    r.inbox.put(("stats", token))
        deadline = time.monotonic() + timeout
        answers = {}
        for index, (event, _) in waiters.items():
            if event.wait(max(0.0, deadline - time.monotonic())):
                answers[index] = waiters[index][1]
        return _summed(self._replicas, answers, self.policy)


def _summed(replicas: list[_Replica], answers: dict[int, dict], policy: AffinityPolicy | None) -> dict:
    """The replicas' `queue_stats()` answers summed (the prefix-cache hit rate: their mean), with each replica's
    figures under "replicas" and the routing counts under "router"."""
    total = dict.fromkeys(_STAT_KEYS, 0)
    rates, rows = [], []
    for r in replicas:
        stats = answers.get(r.index, {})
        if r.index in answers:
            for key in _STAT_KEYS:
                total[key] += stats.get(key, 0)
            rates.append(stats.get("prefix_cache_hit_rate", 0.0))
        rows.append({"replica": r.index, "up": int(r.state == "ready"), "restarts": r.restarts, "routed": r.routed,
                     "pending": len(r.pending), **stats})
    total["prefix_cache_hit_rate"] = sum(rates) / len(rates) if rates else 0.0
    total["replicas"] = rows
    total["router"] = {} if policy is None else {"prefix_hits": policy.prefix_hits, "key_hits": policy.key_hits,
                                                 "balanced": policy.balanced}
    return total
