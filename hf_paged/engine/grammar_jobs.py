"""The grammar work of a pipelined decode step, in worker threads (`StructuredOutputs.advance` starts a
`GrammarJob`; `StructuredOutputs.collect` / `job_masks` wait for it).

When a step's picks are launched, its constrained rows are split into chunks of at least `MIN_CHUNK_ROWS`, one per
thread (`StructuredOutputs.threads`; `default_threads`: 1, as measured on an H200 host); each chunk
(`advance_chunk`) waits for the picks' event, advances its matchers with one batch accept and fills the next step's
mask rows with one batch fill. xgrammar's calls release the GIL (tvm-ffi), so the chunks run in parallel, and
alongside the engine thread's Python work until it needs the masks. Accepts cost about as much as fills (1.5-6 us a
row each for `bench_serving.BENCH_SCHEMA` on one core) and xgrammar runs batch accepts on one thread, so both go to
the chunks. With one thread (under 4 cores) there is no worker: the engine thread runs the job when it collects it
(`Deferred`; a thread's wake-up cost more than it saved on the 2-core CPU machine).

The engine thread's batch fill (one thread: the deferred job, and normal steps) is split over
`StructuredOutputs.fill_threads` threads (`default_fill_threads`: 1, or ``HF_PAGED_GRAMMAR_FILL_THREADS``): the
engine thread fills the first slice of the rows, workers of `worker_pool` the others (`fill_rows`; slices of at least
`MIN_CHUNK_ROWS`), each through a single-threaded xgrammar `BatchGrammarMatcher`. Not xgrammar's own threads:
xgrammar 0.2.9 starts `max_threads` OS threads on every batch fill call and joins them before it returns (strace: two
`clone3` a call at two threads), and its default ("auto", what the engine used) is half the host's cores: 8 thread
starts a step on a 16-core H200 host, for 64 rows of 1.5-6 us each. The pool's threads are started once.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from ..core import Sequence, SequenceGroup

__all__ = ["Deferred", "FILL_THREADS_ENV", "GrammarJob", "INSTALL_HINT", "MAX_FILL_THREADS", "MIN_CHUNK_ROWS",
           "advance_chunk", "check_fill_threads", "default_fill_threads", "default_threads", "fill_rows",
           "import_xgrammar", "worker_pool"]

INSTALL_HINT = 'structured outputs need the xgrammar package: pip install "hf-paged[structured]"'
MIN_CHUNK_ROWS = 8  # rows a worker chunk takes at least: below, a thread's hand-off costs more than it saves
FILL_THREADS_ENV = "HF_PAGED_GRAMMAR_FILL_THREADS"  # the default of `StructuredOutputs.fill_threads`
MAX_FILL_THREADS = 16  # (the worker pool's size)


def import_xgrammar():
    """xgrammar, or an ImportError saying what to install."""
    try:
        import xgrammar
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return xgrammar


def default_threads() -> int:
    """Worker threads for the grammar work of a step: 1, the engine thread itself (no worker).

    Measured on an H200 host (16 cores; llama-1b shape, 64 schema-constrained requests of 512 tokens,
    `bench_structured.py --grammar-threads 1,8`): one thread ran at 0.86 of unconstrained throughput, eight worker
    threads at 0.60. The workers' waits and hand-offs cost the engine thread more than the batch fill they take off
    it (`benchmarks/results/h200_2026-11-29e`). More threads stay available (`StructuredOutputs.threads`) for
    grammars whose fill dominates."""
    return 1


def check_fill_threads(value, name: str = "fill_threads") -> int:
    """`value` as the count of threads sharing the engine thread's batch fill (an int from 1 to `MAX_FILL_THREADS`,
    the worker pool's size); else a ValueError naming `name` (the attribute, or the environment variable it came
    from), so a typo in the variable fails the engine's start rather than silently filling on one thread."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{name} must be an integer from 1 to {MAX_FILL_THREADS}, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_FILL_THREADS:
        raise ValueError(f"{name} must be an integer from 1 to {MAX_FILL_THREADS}, got {value!r}")
    return value


def default_fill_threads() -> int:
    """Threads of the engine thread's batch fill: ``HF_PAGED_GRAMMAR_FILL_THREADS`` if set, else 1.

    Why 1: on an H200 host (16 cores; llama-1b shape, 64 requests of 512 tokens under `bench_serving.BENCH_SCHEMA`,
    `bench_structured.py --fill-threads 1,2,4,8`) one thread ran at 0.99 of unconstrained throughput, 2 / 4 / 8 at
    0.97 / 0.97 / 0.92 (`benchmarks/results/h200_2026-11-29f`): a step's accepts and fills took 0.28 ms on one thread
    against 0.45-0.75 ms when slices went to workers (the hand-offs and waits cost more than they saved)."""
    text = os.environ.get(FILL_THREADS_ENV, "").strip()
    return check_fill_threads(text, FILL_THREADS_ENV) if text else 1


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def worker_pool() -> ThreadPoolExecutor:
    """The process's grammar worker threads (shared by its engines: started once, idle between steps)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=MAX_FILL_THREADS, thread_name_prefix="hf-paged-grammar")
        return _POOL


class Deferred:
    """A chunk run by the engine thread itself when it is collected (one thread: `StructuredOutputs.threads` 1),
    with a `Future`'s `result()`."""

    def __init__(self, fn, *args) -> None:
        self._call = (fn, args)
        self._result = None
        self._error: BaseException | None = None

    def result(self):
        """The chunk's result (run on the first call); its exception on every call, as a `Future` raises it."""
        if self._call is not None:
            fn, args = self._call
            self._call = None
            try:
                self._result = fn(*args)
            except BaseException as error:
                self._error = error
        if self._error is not None:
            raise self._error
        return self._result


@dataclass
class GrammarJob:
    """The advance of a launched step's constrained rows through its tokens, in worker chunks (`advance`): row `j`
    is `seqs[j]` of `groups[j]`; `host` row `j` receives its mask for the next step unless its grammar ended there.
    `ends` ({id(seq): "grammar" | "grammar_rejected"}) once the chunks are done (`StructuredOutputs.collect`)."""

    seqs: list[Sequence]
    groups: list[SequenceGroup]
    host: torch.Tensor
    futures: list[Future | Deferred]
    ends: dict[int, str] | None = None
    mask_rows: dict[int, int] | None = None  # id(seq) -> `host` row, for the rows whose grammar goes on (built once
    # a step needs it: `StructuredOutputs.job_masks`)
    key: list | None = None  # the `DecodeBatch` row list of the step (`StepRows.seqs`) when every row is constrained

    def wait(self) -> None:
        """Until every worker chunk has returned (or raised): its matchers and `host` are the caller's again (a
        deferred chunk never runs once its step is dropped)."""
        threaded = [f for f in self.futures if isinstance(f, Future)]
        if threaded:
            wait(threaded)


def _fill_slice(batch, handles: list, host: torch.Tensor, indices: list[int] | None) -> None:
    """One slice of `fill_rows`, through xgrammar's C++ call directly: its Python wrapper would build the handle
    list again from the matchers."""
    batch._handle.batch_fill_next_token_bitmask(handles, host, indices, False)


def fill_rows(batches: list, handles: list, host: torch.Tensor, indices: list[int] | None = None) -> None:
    """Fill the next mask of each matcher (`handles`: their xgrammar handles) into its row of `host` (`indices`,
    None: rows 0..), split over `batches` (single-threaded `BatchGrammarMatcher`s, one per thread) in slices of at
    least `MIN_CHUNK_ROWS`: the calling thread fills the first slice, `worker_pool` workers the others (xgrammar's
    calls release the GIL). Returns once every slice is filled, raising the first slice's error."""
    n = len(handles)
    parts = max(1, min(len(batches), n // MIN_CHUNK_ROWS))
    if parts == 1:
        _fill_slice(batches[0], handles, host, indices)
        return
    if indices is None:
        indices = list(range(n))
    size = -(-n // parts)
    pool = worker_pool()
    futures = [pool.submit(_fill_slice, batches[k], handles[a:a + size], host, indices[a:a + size])
               for k, a in enumerate(range(size, n, size), 1)]
    try:
        _fill_slice(batches[0], handles[:size], host, indices[:size])
    finally:
        wait(futures)  # the workers write `host` and read the matchers: never leave them running
    for future in futures:
        future.result()


def advance_chunk(event, tokens: torch.Tensor, rows: list[int] | None, first: int, matchers: list, stop_ids: list,
                  host: torch.Tensor, batch, handles: list | None = None,
                  stop_union: frozenset | None = None) -> tuple[dict[int, str], float]:
    """One chunk: wait for the picks, accept each row's token (one batch call), fill the next mask of each matcher
    that goes on into `host[first + j]` (one batch call). Returns the ends ({first + j: end}) and the seconds of work
    (the wait for the picks left out). `rows` None: every row of `tokens`, in order.

    The accepts go through xgrammar's C++ batch call directly (`_core`): its Python wrapper reads the result back
    with two FFI calls a row (each dropping and taking the GIL); here one membership test says whether any row was
    refused (0.75 against 1.1 us a row for the per-row `accept_token` loop, 256 rows, one core), and only then are
    the rows read. `handles` (the matchers' `_handle`s) and `stop_union` (every row's stop ids) may come from the
    caller, kept from a step before (`StructuredOutputs.advance`): then a step with no stop id among its tokens asks
    no row, and the fill, from row 0, goes to xgrammar's C++ call without an index list. `batch`: one
    `BatchGrammarMatcher`, or a list of single-threaded ones that share the fill (`fill_rows`)."""
    if event is not None:
        event.synchronize()
    start = time.perf_counter()
    xgr = import_xgrammar()
    picked = tokens.tolist()
    chunk = picked if rows is None else [picked[r] for r in rows]
    if handles is None:
        handles = [m._handle for m in matchers]
    result = xgr.base._core.BatchGrammarMatcher.batch_accept_token(handles, chunk, False)
    ends: dict[int, str] = {}
    if 0 in result:  # a terminated matcher refuses every token; else nothing allowed it (a bug)
        for j, ok in enumerate(list(result)):
            if not ok:
                ends[first + j] = "grammar" if matchers[j].is_terminated() else "grammar_rejected"
    if stop_union is None or not stop_union.isdisjoint(chunk):
        for j, (token, stops) in enumerate(zip(chunk, stop_ids)):
            if token in stops and first + j not in ends and matchers[j].is_terminated():
                ends[first + j] = "grammar"
    batches = batch if isinstance(batch, list) else [batch]
    if not ends:
        fill_rows(batches, handles, host, None if first == 0 else list(range(first, first + len(matchers))))
    elif len(ends) < len(matchers):
        live = [j for j in range(len(matchers)) if first + j not in ends]
        fill_rows(batches, [handles[j] for j in live], host, [first + j for j in live])
    return ends, time.perf_counter() - start
