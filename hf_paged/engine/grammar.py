"""Structured outputs: decoding constrained by a grammar (JSON schema, any JSON object, regex, choice, EBNF, xgrammar
structural tag), through xgrammar, imported only when a request asks for a constraint.

How a step runs with constrained requests (`StructuredOutputs`, owned by the `Engine`):

* `compiled(params)`: the request's grammar, compiled once per (tokenizer, logits width, stop ids, constraint) and kept
  in an LRU (`GrammarCache`); an invalid schema / regex / grammar is a `ValueError` naming the problem. A server
  compiles in a worker thread before adding the request, so the engine thread never waits for a compilation.
* `start(group, compiled)`: a `GrammarMatcher` for the request, kept in `group.data[GRAMMAR]`. Parallel samples
  (`num_return_sequences=n`) fork it into one matcher per sample when the samples are drawn (`RequestGrammar`).
* `fill(sched)`: right after the step's forward is launched (on CUDA the GPU is still computing), the host fills one
  row of a token bitmask per constrained logits row and starts its copy to the device (normal steps).
* `apply(logits, masks)`: before any token is picked, the masked tokens' logits become -inf on the device
  (xgrammar's `apply_token_bitmask_inplace`), for greedy, sampled and parallel-sampled rows alike.
* `accept(group, seq, token)`: the matcher advances with the token picked; a matcher that terminates (the grammar is
  complete and the model emitted its end) finishes the sequence with stop reason "grammar" (OpenAI's "stop").

Pipelined decode (`hf_paged.engine.pipelined`): a constrained request with one sequence whose picks stay on the device
is `masked` (`SequenceGroup.masked`, never `plain`). Its decode steps are pipelined too: the next step's forward is
launched before the tokens of the step before are on the host; a grammar job advances the matchers with those
tokens and fills the next masks (`advance`, `hf_paged.engine.grammar_jobs`: in the engine thread by default, in
worker threads when `threads` > 1); the engine thread collects it, uploads the masks and applies them (`job_masks`)
before the pick is launched. So the fill
overlaps the forward, as in a normal step, and the GPU does not wait for the host's stop checks, token appends and
scheduling in between. Their rows ride in the scheduler's `DecodeBatch` like plain ones (batched scheduling, upload
and token apply); a step whose tokens ended grammars is applied row by row. A `DecodeBatch` step whose row list
is the one of the step before reuses that step's constrained rows, matchers and their handles (`_StepRows`), and the
engine thread's fill may be shared with workers (`fill_threads`, `grammar_jobs.fill_rows`). Parallel samples and
requests with logprobs take normal steps. `host_seconds` sums the engine thread's time in grammar work (`critical`:
the fill, waiting for the jobs, the upload and the masking) and the chunks' accepts and fills (`workers`, wherever
they ran), for `benchmarks/bench_structured.py`.

The bitmask is as wide as the logits (the model's `lm_head` may have more rows than the tokenizer has tokens; the ids
past the tokenizer's are never allowed).
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from operator import is_

import torch

from ..core import SchedulerOutput, Sequence, SequenceGroup
from .grammar_jobs import (
    INSTALL_HINT,
    MIN_CHUNK_ROWS,
    Deferred,
    GrammarJob,
    advance_chunk,
    check_fill_threads,
    default_fill_threads,
    default_threads,
    fill_rows,
    import_xgrammar,
    worker_pool,
)
from .params import SamplingParams

__all__ = ["GRAMMAR", "GrammarCache", "GrammarJob", "INSTALL_HINT", "RequestGrammar", "StepMasks", "StructuredOutputs",
           "grammar_cache", "import_xgrammar"]

GRAMMAR = "grammar"  # key of a group's `RequestGrammar` in `SequenceGroup.data`
CACHE_SIZE = 256  # compiled grammars kept per tokenizer (a JSON schema's is ~10-100 KB)


class GrammarCache:
    """Compiled grammars of one tokenizer (at one logits width, with one set of stop ids), least recently used out.

    `compilations` counts the grammars compiled (not served from the cache). Thread-safe: a server compiles in
    worker threads while the engine thread fills masks.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids: tuple[int, ...], capacity: int = CACHE_SIZE) -> None:
        xgr = import_xgrammar()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=4, cache_enabled=False)
        self.vocab_size = vocab_size
        self.capacity = capacity
        self.compilations = 0
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, kind: str, text: str):
        """The compiled grammar of a constraint (`SamplingParams.constraint`); ValueError if it is invalid."""
        key = (kind, text)
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
        compiled = self._compile(kind, text)  # outside the lock: other requests' grammars are served meanwhile
        with self._lock:
            self.compilations += 1
            self._compiled[key] = compiled
            self._compiled.move_to_end(key)
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._compiled)

    def _compile(self, kind: str, text: str):
        compiler = self.compiler
        try:
            if kind == "json_schema":
                # one line, single spaces after separators: free whitespace lets a small model pad a reply with
                # blanks up to max_tokens (never valid JSON then)
                return compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                options = [{"type": "const_string", "value": c} for c in json.loads(text)]
                return compiler.compile_structural_tag(
                    {"type": "structural_tag", "format": {"type": "or", "elements": options}})
            if kind == "grammar":
                return compiler.compile_grammar(text)
            if kind == "structural_tag":
                tag = json.loads(text)
                if tag.get("type") != "structural_tag":
                    tag = {"type": "structural_tag", "format": tag}
                return compiler.compile_structural_tag(tag)
        except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's parse / conversion errors
            raise ValueError(f"invalid {kind}: {_short(error)}") from None
        raise ValueError(f"unknown structured-output kind {kind!r}")


def _short(error: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix ("[time] path.cc:123: ")."""
    text = str(error).strip()
    head, sep, rest = text.partition(": ")
    if sep and head.startswith("[") and ".cc:" in head:
        text = rest
    return text.splitlines()[0] if text else type(error).__name__


_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()


def grammar_cache(tokenizer, vocab_size: int, stop_ids: tuple[int, ...]) -> GrammarCache:
    """The `GrammarCache` of a tokenizer (shared by every engine serving it, dropped with the tokenizer)."""
    with _CACHES_LOCK:
        per_tokenizer = _CACHES.setdefault(tokenizer, {})
        cache = per_tokenizer.get((vocab_size, stop_ids))
        if cache is None:
            cache = per_tokenizer[(vocab_size, stop_ids)] = GrammarCache(tokenizer, vocab_size, stop_ids)
        return cache


@dataclass
class RequestGrammar:
    """The matchers of one request: one per sample (index `Sequence.sample_index`). `stop_ids`: the tokens that
    terminate its matchers (a matcher terminates only by accepting one: the worker chunks ask `is_terminated` only
    then)."""

    matchers: list
    rejected: bool = False
    stop_ids: frozenset = frozenset()

    def for_seq(self, seq: Sequence):
        return self.matchers[seq.sample_index]

    def fork_samples(self, n: int) -> None:
        """The request's `n` samples are about to be drawn from one row: give each its own matcher, at that state."""
        while len(self.matchers) < n:
            self.matchers.append(self.matchers[0].fork())


@dataclass
class StepMasks:
    """The bitmask of one step: `rows` are the constrained logits rows (sampling rows, in order), `device` holds
    their masks, one row each, in that order."""

    rows: list[int]
    device: torch.Tensor
    groups: list[SequenceGroup] = field(default_factory=list)


@dataclass
class _StepRows:
    """The constrained rows of a `DecodeBatch` step (`advance`), kept for the steps after it while the batch's row
    list is the same object (`StepRows.seqs`: a removal replaces it, never changes it), so a step of the same rows
    looks at none of them again. `key` is that list, held, so its `id` cannot be reused meanwhile; `every_row`: every
    row of the step is constrained (the step's tokens are the rows' as they are)."""

    key: list
    rows: list[int]
    seqs: list[Sequence]
    groups: list[SequenceGroup]
    matchers: list
    stops: list[frozenset]
    handles: list  # the matchers' xgrammar handles, as the C++ batch calls take them
    stop_union: frozenset
    every_row: bool


def _sampling_rows(sched: SchedulerOutput):
    """(logits row, item) of each item of `sched` that samples a token."""
    return enumerate(item for item in sched.scheduled if item.sample)


def _seqs(items):
    return (item.seq for item in items)


class StructuredOutputs:
    """The engine's side of structured outputs (see the module docstring)."""

    def __init__(self, device: torch.device, engine) -> None:
        """`engine` is held weakly (its tokenizer, logits width and stop ids are read when needed): a strong
        reference would make a cycle that keeps a dropped engine, and its model, alive until the cycle collector
        runs."""
        self.device = device
        self._engine = weakref.ref(engine)
        self._host: list[torch.Tensor] = []  # two host bitmasks (pinned on CUDA), alternated
        self._dev: torch.Tensor | None = None
        self._fill_batches: list = []  # single-threaded BatchGrammarMatchers, one per fill thread (`fill_rows`)
        self._chunk_batches: list = []  # one single-threaded BatchGrammarMatcher per worker chunk
        self._pending: GrammarJob | None = None  # the last job started: waited for before its buffer is reused
        self._step_rows: _StepRows | None = None  # the constrained rows of the last batch step advanced
        self._ranges: dict[int, list[int]] = {}  # list(range(n)) per n: the rows of a step constrained throughout
        self.threads = default_threads()  # worker chunks a pipelined step's grammar work is split into, at most
        self._fill_threads = default_fill_threads()
        self.masked_rows = 0  # rows masked so far (tests, stats)
        self.host_seconds = {"critical": 0.0, "workers": 0.0}  # grammar work: the engine thread's, the workers'
        self._live: weakref.WeakSet = weakref.WeakSet()  # constrained groups not reported finished yet

    @property
    def fill_threads(self) -> int:
        """Threads sharing the engine thread's batch fill, the engine thread included (`grammar_jobs.fill_rows`,
        `default_fill_threads`); a ValueError naming ``fill_threads`` unless an int from 1 to `MAX_FILL_THREADS`."""
        return self._fill_threads

    @fill_threads.setter
    def fill_threads(self, value: int) -> None:
        self._fill_threads = check_fill_threads(value)

    def _batches(self) -> list:
        """One single-threaded xgrammar `BatchGrammarMatcher` per fill thread (built once, kept for every step)."""
        batches = self._fill_batches
        if len(batches) < self._fill_threads:
            xgr = import_xgrammar()
            batches += [xgr.BatchGrammarMatcher(max_threads=1) for _ in range(self._fill_threads - len(batches))]
        return batches[:self._fill_threads] if len(batches) > self._fill_threads else batches

    @property
    def active(self) -> bool:
        """Whether a constrained request may be running (else a step does not look for one)."""
        return bool(self._live)

    # ------------------------------------------------------------------ requests
    def cache(self) -> GrammarCache:
        tokenizer = self._engine().tokenizer
        if tokenizer is None:
            raise ValueError("structured outputs need a tokenizer: create the engine with tokenizer=...")
        return grammar_cache(tokenizer, self._engine().logits_width(), self._engine().stop_token_ids())

    def warm_up(self, dtypes: tuple[torch.dtype, ...]) -> None:
        """Build the grammar cache (xgrammar's view of the tokenizer: 1-2 s for a 150k vocabulary) and run the
        device masking once for logits of each of `dtypes` (on CUDA its Triton kernel compiles then), so the first
        constrained request pays neither. Raises ImportError / ValueError as `cache` does."""
        self.cache()
        width = self._engine().logits_width()
        mask = torch.full((1, (width + 31) // 32), -1, dtype=torch.int32, device=self.device)
        for dtype in dict.fromkeys(dtypes):
            self.apply(torch.zeros((1, width), dtype=dtype, device=self.device), StepMasks([0], mask))

    def compiled(self, params: SamplingParams):
        """The compiled grammar of `params` (ValueError: invalid; ImportError: xgrammar missing)."""
        kind, text = params.constraint
        return self.cache().get(kind, text)

    def start(self, group: SequenceGroup, compiled) -> None:
        xgr = import_xgrammar()
        matcher = xgr.GrammarMatcher(compiled)
        group.data[GRAMMAR] = RequestGrammar([matcher], stop_ids=frozenset(matcher.stop_token_ids))
        self._live.add(group)

    def finished(self, group: SequenceGroup) -> None:
        self._live.discard(group)
        if not self._live:
            self._step_rows = None  # (it holds the rows' groups and matchers)

    # ------------------------------------------------------------------ steps
    def fill(self, sched: SchedulerOutput, ended: dict | None = None) -> StepMasks | None:
        """Fill a bitmask row for each of the step's constrained sampling rows and start their upload (None if
        there are none). Only those rows travel: with a 150k vocabulary a row is 19 KB. `ended`: the sequences
        (by `id`) whose grammar ended with the token before, in a pipelined step that still holds their rows (their
        picks are dropped; a terminated matcher has no mask)."""
        rows, matchers, groups = [], [], []
        row = 0
        for item in sched.scheduled:
            if not item.sample:
                continue
            state = item.group.data.get(GRAMMAR)
            if state is not None and not (ended and id(item.seq) in ended):
                rows.append(row)
                matchers.append(state.for_seq(item.seq))
                groups.append(item.group)
            row += 1
        if not rows:
            return None
        start = time.perf_counter()
        if self._pending is not None:  # a job of a step that failed before it was collected: let it finish first
            self._pending.wait()
        n = len(rows)
        host = self._host_buffer(n)
        if n == 1:
            matchers[0].fill_next_token_bitmask(host, 0)
        else:
            fill_rows(self._batches(), [m._handle for m in matchers], host)
        masks = self._upload(rows, host[:n], groups)
        self.host_seconds["critical"] += time.perf_counter() - start
        return masks

    def _range(self, n: int) -> list[int]:
        """list(range(n)), one list per n (never changed by its users)."""
        rows = self._ranges.get(n)
        if rows is None:
            rows = self._ranges[n] = list(range(n))
        return rows

    def _upload(self, rows: list[int], host: torch.Tensor, groups: list[SequenceGroup]) -> StepMasks:
        """Start the copy of `host` (one mask row per entry of `rows`) to the device."""
        n = len(rows)
        device = self._dev[:n]
        device.copy_(host, non_blocking=True)
        self.masked_rows += n
        return StepMasks(rows, device, groups)

    # ------------------------------------------------------------------ pipelined steps (worker chunks)
    def advance(self, sched: SchedulerOutput, tokens: torch.Tensor, event) -> GrammarJob | None:
        """Start advancing the matchers of `sched`'s constrained sampling rows through the step's picks (`tokens`,
        on the host once `event` is done) and filling their next masks, in worker chunks (None if the step has no
        such row). The caller collects the job (`collect`, `job_masks`) before it touches these matchers again. A
        row whose grammar ended with the token before (its pick is dropped) ends again: its terminated matcher
        refuses the token."""
        plan = self._rows_of(sched)
        if plan is None:
            return None
        rows, seqs, groups, matchers, stops = plan.rows, plan.seqs, plan.groups, plan.matchers, plan.stops
        if self._pending is not None:  # (done already unless a step failed before it was collected)
            self._pending.wait()
        xgr = import_xgrammar()
        n = len(rows)
        host = self._host_buffer(n)
        chunks = max(1, min(self.threads, n // MIN_CHUNK_ROWS))
        if self.threads <= 1:  # no worker: the engine thread does it when it collects the job
            futures = [Deferred(advance_chunk, event, tokens, None if plan.every_row else rows, 0, matchers, stops,
                                host, self._batches(), plan.handles, plan.stop_union)]
        else:
            while len(self._chunk_batches) < chunks:
                self._chunk_batches.append(xgr.BatchGrammarMatcher(max_threads=1))
            size = -(-n // chunks)
            pool = worker_pool()
            futures = [pool.submit(advance_chunk, event, tokens, rows[a:a + size], a, matchers[a:a + size],
                                   stops[a:a + size], host, self._chunk_batches[k], plan.handles[a:a + size],
                                   plan.stop_union)
                       for k, a in enumerate(range(0, n, size))]
        self._pending = GrammarJob(seqs, groups, host, futures, key=plan.key if plan.every_row else None)
        return self._pending

    def _rows_of(self, sched: SchedulerOutput) -> _StepRows | None:
        """The constrained sampling rows of `sched` (None if it has none): those of the last batch step advanced when
        `sched` is a step of the same batch rows, else looked up row by row (and kept, for a batch step)."""
        batch = sched.batch
        step = batch.rows_of(sched.batch_step) if batch is not None else None
        key = step.seqs if step is not None else None
        kept = self._step_rows
        if key is not None and kept is not None and kept.key is key:
            return kept
        rows, seqs, groups, matchers, stops = [], [], [], [], []
        # a decode step's items are its sampling rows, in order (no `sample` to ask, a property of each row)
        items = enumerate(sched.scheduled) if sched.decode_step else _sampling_rows(sched)
        for row, item in items:
            group = item.group
            if group.masked:
                state = group.data[GRAMMAR]
                rows.append(row)
                seqs.append(item.seq)
                groups.append(group)
                matchers.append(state.matchers[0])
                stops.append(state.stop_ids)
        if not rows:
            return None
        plan = _StepRows(key, rows, seqs, groups, matchers, stops, [m._handle for m in matchers],
                         frozenset().union(*stops), key is not None and len(rows) == len(key))
        if key is not None:
            self._step_rows = plan
        return plan

    def collect(self, job: GrammarJob) -> dict[int, str]:
        """Wait for `job`'s chunks; the ends its tokens brought ({id(seq): end}; a rejected token marks its request
        `rejected`). A chunk's exception is raised here."""
        if job.ends is None:
            start = time.perf_counter()
            ends: dict[int, str] = {}
            for future in job.futures:
                chunk_ends, seconds = future.result()
                self.host_seconds["workers"] += seconds
                for j, end in chunk_ends.items():
                    ends[id(job.seqs[j])] = end
                    if end == "grammar_rejected":
                        job.groups[j].data[GRAMMAR].rejected = True
            job.ends = ends
            self.host_seconds["critical"] += time.perf_counter() - start
        return job.ends

    def job_masks(self, job: GrammarJob, sched: SchedulerOutput) -> StepMasks | None:
        """The masks of `sched` (the step after `job`'s) from the rows `job` filled, uploaded (None if it has no
        constrained row). Usually the same sequences in the same order: `job.host` goes as it is; else its rows are
        gathered. A constrained row `job` did not fill (not expected) makes it fill the step in line (`fill`)."""
        ends = self.collect(job)
        start = time.perf_counter()
        scheduled = sched.scheduled
        n = len(job.seqs)
        if not ends and sched.decode_step and len(scheduled) == n and self._same_rows(job, sched):
            masks = self._upload(self._range(n), job.host[:n], job.groups)  # the common step: the same rows
            self.host_seconds["critical"] += time.perf_counter() - start
            return masks
        if job.mask_rows is None:
            job.mask_rows = {id(seq): j for j, seq in enumerate(job.seqs) if id(seq) not in ends}
        mask_rows = job.mask_rows
        rows, source, groups = [], [], []
        row = 0
        for item in sched.scheduled:
            if not item.sample:
                continue
            seq = item.seq
            if item.group.masked and id(seq) not in ends:
                at = mask_rows.get(id(seq))
                if at is None:
                    return self.fill(sched, ends)
                rows.append(row)
                source.append(at)
                groups.append(item.group)
            row += 1
        if not rows:
            return None
        n = len(rows)
        if source[-1] == n - 1 and source == self._range(n):
            host = job.host[:n]
        else:
            host = job.host.index_select(0, torch.tensor(source, dtype=torch.long))
        masks = self._upload(rows, host, groups)
        self.host_seconds["critical"] += time.perf_counter() - start
        return masks

    @staticmethod
    def _same_rows(job: GrammarJob, sched: SchedulerOutput) -> bool:
        """Whether `sched`'s rows are `job`'s sequences, in order (of the same length): known without a look when
        both are steps of one `DecodeBatch` row list with every row constrained."""
        if job.key is not None and sched.batch is not None:
            step = sched.batch.rows_of(sched.batch_step)
            if step is not None and step.seqs is job.key:
                return True
        return all(map(is_, job.seqs, _seqs(sched.scheduled)))

    def apply(self, logits: torch.Tensor, masks: StepMasks) -> None:
        """Set the logits of every token the grammar forbids to -inf, in place, on the logits' device."""
        width = masks.device.shape[1] * 32
        if logits.shape[1] > width:
            raise RuntimeError(f"logits have {logits.shape[1]} columns but the grammar's bitmask covers {width}")
        start = time.perf_counter()
        xgr = import_xgrammar()
        n, vocab = len(masks.rows), logits.shape[1]
        if masks.rows[-1] == n - 1:  # the first n rows (every row constrained, say): masked where they are
            xgr.apply_token_bitmask_inplace(logits[:n], masks.device, vocab_size=vocab)
        else:
            index = torch.tensor(masks.rows, dtype=torch.long).to(logits.device, non_blocking=True)
            picked = logits.index_select(0, index)
            xgr.apply_token_bitmask_inplace(picked, masks.device, vocab_size=vocab)
            logits.index_copy_(0, index, picked)
        self.host_seconds["critical"] += time.perf_counter() - start

    def _host_buffer(self, rows: int) -> torch.Tensor:
        """A host bitmask of at least `rows` rows; never the one the previous step's upload may still read."""
        width = (self._engine().logits_width() + 31) // 32
        if not self._host or self._host[0].shape[0] < rows or self._host[0].shape[1] != width:
            size = max(rows, 2 * self._host[0].shape[0] if self._host else 64)
            pin = self.device.type == "cuda"
            self._host = [torch.empty((size, width), dtype=torch.int32, pin_memory=pin) for _ in range(2)]
            self._dev = torch.empty((size, width), dtype=torch.int32, device=self.device)
        self._host.reverse()
        return self._host[0]

    # ------------------------------------------------------------------ tokens
    @staticmethod
    def fork_samples(group: SequenceGroup, n: int) -> None:
        state = group.data.get(GRAMMAR)
        if state is not None:
            state.fork_samples(n)

    @staticmethod
    def accept(group: SequenceGroup, seq: Sequence, token: int) -> str | None:
        """Advance the sequence's matcher with `token`: None if it goes on, "grammar" when the grammar terminated
        (complete and ended), "grammar_rejected" if the matcher refused the token (nothing allowed it: a bug)."""
        state = group.data.get(GRAMMAR)
        if state is None:
            return None
        matcher = state.for_seq(seq)
        if not matcher.accept_token(token):  # (one call on the hot path; a terminated matcher refuses every token)
            if matcher.is_terminated():
                return "grammar"
            state.rejected = True
            return "grammar_rejected"
        return "grammar" if matcher.is_terminated() else None
