"""One replica of a data-parallel server: a spawned process that owns one engine on one device.

`replica_main` is the process's entry point (`multiprocessing`, spawn: CUDA cannot be forked). It loads the model
with the spec's picklable `load(device)`, builds the `Engine`, reports ready (with the tokenizer and the limits the
HTTP front needs to validate requests), then steps the engine in its main thread while a second thread reads commands
from the front (a `multiprocessing` queue). Messages to the front go down a one-way pipe whose only write end is the
replica's, so that the front reads end-of-file (not a hang on half a message) the moment the replica dies. The
messages, all plain picklable tuples:

* front -> replica: `("add", request_id, prompt_ids, SamplingParams)`, `("abort", request_id)`, `("stats", token)`,
  `("stop", grace_seconds)`.
* replica -> front: `("ready", info)`, `("failed", traceback text)` (the load or the engine failed; the process then
  exits), `("out", [encoded outputs of one step])`, `("stats", token, Engine.queue_stats())`.

Outputs travel as deltas (`encode`): a `RequestOutput` holds every token so far, so sending it whole each step would
pickle O(length^2) tokens per request; the front rebuilds the cumulative output (`router.OutputAssembler`). A request
the engine refuses (`add_request` raised ValueError / TypeError) comes back as a finished output with error kind
"refused" (HTTP 400); one whose step failed, "failed" (500).

A replica ignores SIGINT and SIGTERM (Ctrl-C reaches the whole process group; the front shuts down and stops its
replicas); one whose front went away (killed without a shutdown) exits by itself within a second.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..engine import Engine, RequestOutput, default_max_num_batched_tokens
from .engine_loop import run_engine_loop
from .structured import warm_up_grammars

__all__ = ["ReplicaSpec", "bind_device", "encode", "replica_main"]

log = logging.getLogger("hf_paged.serve.replica")


@dataclass
class ReplicaSpec:
    """What every replica builds. `load(device)` returns (model on `device`, tokenizer): a module-level function or
    a `functools.partial` of one, so that it pickles into the spawned process."""

    load: Callable[[str], tuple[object, object]]
    engine_kwargs: dict = field(default_factory=dict)
    warm_up: bool = True  # compile kernels / capture graphs up front (CUDA replicas only)
    prefill_graphs: bool = True
    threads: int | None = None  # torch intra-op threads of a CPU replica (None: torch's default)
    log_level: str = "WARNING"
    loras: tuple[tuple[str, str], ...] = ()  # (name, PEFT adapter directory) each replica's engine adds (`--lora`)


def encode(out: RequestOutput, sent: dict[int, tuple[int, int]], prompt_sent: int) -> tuple:
    """A step's `RequestOutput` as the tokens and logprobs new since `sent` (per completion index: (tokens, logprob
    entries) already sent; updated here), with the prompt scores when more of them exist than `prompt_sent`."""
    completions = []
    for c in out.outputs:
        tokens, lps = sent.get(c.index, (0, 0))
        if len(c.token_ids) < tokens:  # never expected (outputs only grow); resend from the start
            tokens = lps = 0
        new_lps = None if c.logprobs is None else c.logprobs[lps:]
        completions.append((c.index, tokens, list(c.token_ids[tokens:]), c.finish_reason, c.text, c.score,
                            lps, new_lps))
        sent[c.index] = (len(c.token_ids), lps + (0 if new_lps is None else len(new_lps)))
    prompt = None
    if out.prompt_logprobs is not None and len(out.prompt_logprobs) > prompt_sent:
        prompt = (out.prompt_logprobs, out.prompt_top_logprobs)
    error = None if out.error is None else ("failed", type(out.error).__name__, str(out.error))
    metrics = out.metrics if out.finished else {}  # the engine's timestamps, once (the front keeps its own)
    return (out.request_id, out.finished, error, out.num_preemptions, metrics, prompt, completions)


class _Sender:
    """The replica's end of the pipe to the front, shared by its two threads (a `Connection` is not thread-safe).
    A send blocks while the pipe is full: the front then reads slower than the engine steps, and waits for it."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def put(self, msg: tuple) -> None:
        with self._lock:
            self.conn.send(msg)


class _Replica:
    """The engine loop and the command thread of a replica process."""

    def __init__(self, engine: Engine, outputs: _Sender) -> None:
        self.engine, self.outputs = engine, outputs
        self._lock = threading.Lock()
        self._live: dict[object, dict[int, tuple[int, int]]] = {}  # request id -> what was sent of it
        self._prompt_sent: dict[object, int] = {}
        self._compiling: set = set()  # constrained requests whose grammar compiles in `_grammars`
        self._cancelled: set = set()  # aborted while compiling
        self._grammars = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="hf-paged-grammar")
        self._wake = threading.Event()
        self._stopping = False

    # ------------------------------------------------------------------ commands (their own thread)
    def commands(self, inbox) -> None:
        parent = multiprocessing.parent_process()
        while True:
            try:
                msg = inbox.get(timeout=1.0)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    log.warning("the front went away: replica exits")
                    os._exit(0)
                continue
            op = msg[0]
            if op == "add":
                if msg[3].constraint is not None:  # a grammar may compile for a second: not on this thread
                    with self._lock:
                        self._compiling.add(msg[1])
                    self._grammars.submit(self._add, *msg[1:])
                else:
                    self._add(*msg[1:])
            elif op == "abort":
                self._abort(msg[1])
            elif op == "stats":
                self.outputs.put(("stats", msg[1], self.engine.queue_stats()))
            elif op == "stop":
                self._stop(msg[1])
                return

    def _add(self, request_id, prompt_ids, params) -> None:
        with self._lock:  # before the engine has it: its first step's output must find it
            self._live[request_id] = {}
        added = False
        try:
            self.engine.add_request(prompt_ids, request_id=request_id, params=params)
            added = True
        except (ValueError, TypeError) as error:
            self._report_error(request_id, "refused", error)
        except Exception as error:  # noqa: BLE001 - the engine is closed or broken: the front is told
            self._report_error(request_id, "failed", error)
        with self._lock:
            self._compiling.discard(request_id)
            cancelled = request_id in self._cancelled
            self._cancelled.discard(request_id)
            if not added:
                self._live.pop(request_id, None)
        if not added:
            return
        if cancelled:
            self._abort(request_id)
        self._wake.set()

    def _abort(self, request_id) -> None:
        with self._lock:
            if request_id in self._compiling:
                self._cancelled.add(request_id)
                return
        self.engine.abort(request_id)
        self._wake.set()

    def _report_error(self, request_id, kind: str, error: BaseException) -> None:
        self.outputs.put(("out", [(request_id, True, (kind, type(error).__name__, str(error)), 0, {}, None, [])]))

    def _stop(self, grace: float) -> None:
        """Finish what runs for up to `grace` seconds, abort the rest, close the engine, end the loop."""
        deadline = time.monotonic() + grace
        while self.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.engine.close()
        self._stopping = True
        self._wake.set()

    # ------------------------------------------------------------------ the engine loop (main thread)
    def run(self) -> None:
        run_engine_loop(self.engine, self._wake, lambda: self._stopping, self._send, self._fail_all)

    def _send(self, outs: list[RequestOutput]) -> None:
        batch = []
        with self._lock:
            for out in outs:
                sent = self._live.get(out.request_id)
                if sent is None:
                    continue  # aborted before it was added, or already reported finished
                batch.append(encode(out, sent, self._prompt_sent.get(out.request_id, 0)))
                if out.prompt_logprobs is not None:
                    self._prompt_sent[out.request_id] = len(out.prompt_logprobs)
                if out.finished:
                    self._live.pop(out.request_id, None)
                    self._prompt_sent.pop(out.request_id, None)
        if batch:
            self.outputs.put(("out", batch))  # one message per step: one pickle, one wake-up of the front

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            live, self._live = list(self._live), {}
        for request_id in live:
            self.engine.abort(request_id)
            self._report_error(request_id, "failed", error)


def _ready_info(engine: Engine, tokenizer, device: str) -> dict:
    """What the front needs from a replica: the tokenizer (for the first replica's), and the limits it checks."""
    return {"tokenizer": tokenizer, "pid": os.getpid(), "device": device,
            "model_name": str(getattr(engine.model, "name_or_path", "") or "hf-paged"),
            "max_model_len": engine.max_model_len,
            "pool_tokens": engine.block_manager.token_capacity(engine.scheduler.max_num_batched_tokens),
            "block_size": engine.cache.block_size, "logits_width": engine.logits_width(),
            "stop_ids": tuple(engine.stop_token_ids())}


def bind_device(device: str, threads: int | None) -> None:
    """Make `device` this process's current one (kernels launch on the current device): a plain ``"cuda"`` (one
    engine in its own process, `--engine-process`) is the process's current GPU, whose index `set_device` needs; on
    the CPU, use `threads` intra-op threads (when given)."""
    target = torch.device(device)
    if target.type == "cuda":
        torch.cuda.set_device(target.index if target.index is not None else torch.cuda.current_device())
    elif threads is not None:
        torch.set_num_threads(threads)


def replica_main(spec: ReplicaSpec, index: int, device: str, inbox, conn) -> None:
    """The replica process: load, build the engine, report ready, serve commands until told to stop. `inbox`: the
    front's command queue; `conn`: the write end of the pipe to the front."""
    outputs = _Sender(conn)
    # Ctrl-C in a terminal signals the whole process group: the front alone shuts down, and stops the replicas
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level.upper(), format=f"%(asctime)s %(levelname)s replica {index}: %(message)s")
    try:
        bind_device(device, spec.threads)
        model, tokenizer = spec.load(device)
        kwargs = dict(spec.engine_kwargs)
        if kwargs.get("max_num_batched_tokens") is None:
            kwargs["max_num_batched_tokens"] = default_max_num_batched_tokens(torch.device(device), serving=True)
        engine = Engine(model, tokenizer, **kwargs)
        for name, path in spec.loras:  # before the warm-up: the CUDA graphs record the wrapped linears
            engine.add_lora(name, path)
        if spec.warm_up and engine.device.type == "cuda":
            engine.warm_up(prefill_graphs=spec.prefill_graphs)
    except BaseException:  # noqa: BLE001 - the front reports it and refuses to start
        outputs.put(("failed", traceback.format_exc()))
        conn.close()
        return
    replica = _Replica(engine, outputs)
    threading.Thread(target=warm_up_grammars, args=(engine,), name="hf-paged-grammar-warm-up", daemon=True).start()
    threading.Thread(target=replica.commands, args=(inbox,), name="hf-paged-replica-commands", daemon=True).start()
    outputs.put(("ready", _ready_info(engine, tokenizer, device)))
    replica.run()
    conn.close()
