"""One API request as engine requests: sampling parameters, choices, text deltas, logprobs, usage and latencies.

A prompt with `n` choices is one engine request with `num_return_sequences=n` when sampling (the samples share the
prompt's KV blocks), or `n` engine requests when greedy (the engine refuses identical greedy copies; the prefix cache
shares their prompt). `Generation.events()` yields, after each engine step that advanced any choice, the list of
`ChoiceDelta`s, so the same code serves streamed and whole responses.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..engine import SamplingParams
from ..engine.grammar import INSTALL_HINT
from .bridge import EngineBridge, ReplicaUnavailable, RequestFailed, RequestRefused
from .limits import RequestTimedOut, Ticket
from .metrics import ServerMetrics
from .protocol import ApiError
from .stops import TextTracker

__all__ = ["ChoiceDelta", "Generation", "PromptEcho", "finish_reason"]

_FINISH = {"eos": "stop", "stop_string": "stop", "grammar": "stop", "length": "length", "abort": "abort",
           "error": "error"}


def finish_reason(engine_reason: str | None) -> str | None:
    return None if engine_reason is None else _FINISH.get(engine_reason, engine_reason)


@dataclass
class PromptEcho:
    """What a choice's first delta carries about its prompt: its text (echo) and its tokens' scores."""

    text: str
    token_ids: list[int]
    # per prompt token from the second on: (log-probability, rank, [(token id, log-probability)] top alternatives)
    scores: list[tuple[float, int, list[tuple[int, float]]]] | None


@dataclass
class ChoiceDelta:
    index: int
    text: str
    # (token, logprob, top alternatives) per new token
    logprobs: list[tuple[int, float | None, list[tuple[int, float]] | None]]
    finish_reason: str | None
    prompt: PromptEcho | None = None  # the first delta of a choice that echoes or scores its prompt


@dataclass
class _Choice:
    tracker: TextTracker
    finish_reason: str | None = None
    logprobs_sent: int = 0
    last_time: float | None = None
    tokens: list[int] = field(default_factory=list)
    started: bool = False


class Generation:
    """The engine requests of one API request and the state of its choices."""

    def __init__(self, bridge: EngineBridge, tokenizer, metrics: ServerMetrics, prompts: list[list[int]], *, n: int,
                 temperature: float, top_p: float, max_tokens: int | None, stop: list[str], seed: int | None,
                 logprobs: int | None, ignore_eos: bool = False, constraint: dict | None = None,
                 constraint_param: str | None = None, echo: bool = False, prompt_texts: list[str] | None = None,
                 prompt_top: int | None = None, prompt_logprobs: int | None = None, ticket: Ticket | None = None,
                 keep_special: frozenset[int] = frozenset(), affinity: str | None = None,
                 lora: str | None = None) -> None:
        """`constraint`: structured-output `SamplingParams` fields (from `constraint_param` of the request);
        `echo`: each choice's text starts with its prompt (`prompt_texts`, else decoded); `prompt_top`: score the
        prompt tokens with this many alternatives each; `ticket`: the request's place in the admission queue and
        its deadline (`hf_paged.serve.limits`); `affinity`: the routing key of data-parallel serving (the
        `X-HF-Paged-Affinity` header); `lora`: the LoRA adapter the request's `model` named (None: the base)."""
        self.bridge, self.tokenizer, self.metrics = bridge, tokenizer, metrics
        self.constraint, self.constraint_param = constraint or {}, constraint_param
        self.echo, self.prompt_top, self.prompt_logprobs, self.ticket = echo, prompt_top, prompt_logprobs, ticket
        self.prompt_texts, self.affinity = prompt_texts, affinity
        self.replicas: list[int] = []  # the data-parallel replicas serving it (none with one engine)
        self.id = uuid.uuid4().hex
        self.created = int(time.time())
        self.arrival = time.perf_counter()
        self.prompts = prompts
        self.n = n
        self.stop = stop
        self.logprobs = logprobs
        self.choices = [_Choice(TextTracker(tokenizer, stop, keep_special)) for _ in range(n * len(prompts))]
        self.queue: asyncio.Queue = asyncio.Queue()
        self._base: dict[str, int] = {}  # engine request id -> index of its first choice
        self._open: set[str] = set()
        self._first_token_seen = False
        sample = temperature > 0
        limit = bridge.context_limit()
        self._specs = []
        for i, ids in enumerate(prompts):
            room = limit - len(ids)
            if room < 1:
                raise ApiError(f"the prompt has {len(ids)} tokens; this server takes at most {limit - 1} "
                               f"(the model's context / the KV pool)", param="prompt", code="context_length_exceeded")
            kwargs = dict(max_new_tokens=room if max_tokens is None else max_tokens,
                          do_sample=sample, temperature=temperature if sample else 1.0, top_p=top_p if sample else 1.0,
                          seed=seed, stop_strings=tuple(stop), logprobs=logprobs,
                          ignore_eos=ignore_eos, lora=lora, **self.constraint)
            if prompt_top is not None and len(ids) > 1:  # token 0 has no score (None in the response)
                kwargs.update(prompt_logprobs_start=1, prompt_top_logprobs=prompt_top)
            elif max_tokens == 0:
                raise ApiError("max_tokens=0 scores the prompt, which needs at least 2 tokens", param="prompt")
            if sample and n > 1:
                self._specs.append((f"{self.id}-{i}", ids, SamplingParams(num_return_sequences=n, **kwargs), i * n))
            else:
                for j in range(n):
                    self._specs.append((f"{self.id}-{i}-{j}", ids, SamplingParams(**kwargs), i * n + j))

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.choices)

    async def compile_grammar(self) -> None:
        """Compile the request's grammar in a worker thread (the engine then finds it in its cache: its thread never
        waits for a compilation). An invalid grammar is a 400 naming the request parameter."""
        if not self._specs or self._specs[0][2].constraint is None:
            return
        try:
            await asyncio.to_thread(self.bridge.compile_grammar, self._specs[0][2])
        except ValueError as error:
            raise ApiError(str(error), param=self.constraint_param) from None
        except ImportError:
            raise ApiError(f"this server cannot enforce {self.constraint_param}: {INSTALL_HINT}",
                           param=self.constraint_param) from None

    def start(self) -> None:
        """Submit every engine request (all or none: a refused one aborts those already in)."""
        try:
            for request_id, ids, params, base in self._specs:
                self.bridge.submit(request_id, ids, params, self.queue, affinity=self.affinity)
                self._base[request_id] = base
                self._open.add(request_id)
                replica = self.bridge.replica_of(request_id)
                if replica is not None and replica not in self.replicas:
                    self.replicas.append(replica)
        except (ValueError, TypeError) as error:
            self.abort()
            param = "prompt" if "prompt" in str(error) else self.constraint_param
            raise ApiError(str(error), param=param) from None
        except RuntimeError as error:  # shutting down
            self.abort()
            raise ApiError(str(error), status=503, code="unavailable") from None
        self.metrics.prompt_tokens.inc(self.prompt_tokens)

    def abort(self) -> None:
        """Abort every engine request still running (client gone, timed out, done): their blocks are freed now; the
        request leaves the admission queue."""
        for request_id in list(self._open):
            self.bridge.abort(request_id)
        self._open.clear()
        if self.ticket is not None:
            self.ticket.release()

    async def events(self) -> AsyncIterator[list[ChoiceDelta]]:
        """The choices' deltas after each engine step, until every choice is finished. Raises `RequestFailed`."""
        try:
            while self._open:
                for out in await self._latest():
                    if isinstance(out.error, RequestRefused):  # by a data-parallel replica's engine
                        raise ApiError(str(out.error), param="prompt" if "prompt" in str(out.error) else None)
                    if isinstance(out.error, ReplicaUnavailable):
                        raise out.error
                    if out.error is not None:
                        raise RequestFailed(
                            f"the engine failed this request: {type(out.error).__name__}: {out.error}")
                    deltas = self._advance(out)
                    if out.finished:
                        self._open.discard(out.request_id)
                    if deltas:
                        yield deltas
        finally:
            self.abort()
        end = time.perf_counter()
        self.metrics.e2e.observe(end - self.arrival)
        for c in self.choices:
            self.metrics.requests.labels(c.finish_reason or "abort").inc()
        self.metrics.generation_tokens.inc(self.completion_tokens)

    async def _latest(self) -> list:
        """Wait for outputs; return the newest of each engine request queued so far. Outputs are cumulative, so
        when the client reads slower than the engine steps, the steps in between merge into one chunk instead of
        piling up (the stream then carries several tokens per event, as vLLM's does)."""
        latest = {}
        timeout = None if self.ticket is None else self.ticket.remaining()
        try:  # `wait_for` wraps the get in a task: skipped when there is no deadline (one per streamed event)
            out = await (self.queue.get() if timeout is None else asyncio.wait_for(self.queue.get(), timeout))
        except asyncio.TimeoutError:
            self.ticket.limits.timed_out += 1
            raise RequestTimedOut(f"the request ran past the server's request timeout ({self.ticket.timeout:g} s) "
                                  f"and was aborted") from None
        if self.ticket is not None:
            self.ticket.started()  # it is running: it no longer counts against the queue
        latest[out.request_id] = out
        while not self.queue.empty():
            out = self.queue.get_nowait()
            if out.error is not None:
                return [out]
            latest[out.request_id] = out
        return list(latest.values())

    def _advance(self, out) -> list[ChoiceDelta]:
        now = time.perf_counter()
        base = self._base.get(out.request_id)
        if base is None:
            return []
        deltas = []
        for completion in out.outputs:
            choice = self.choices[base + completion.index]
            if choice.finish_reason is not None:
                continue
            new = len(completion.token_ids) - len(choice.tokens)
            if new > 0:
                if not self._first_token_seen:
                    self._first_token_seen = True
                    self.metrics.ttft.observe(now - self.arrival)
                if choice.last_time is not None:
                    for _ in range(new):
                        self.metrics.itl.observe((now - choice.last_time) / new)
                choice.last_time = now
            choice.tokens = list(completion.token_ids)
            reason = finish_reason(completion.finish_reason)
            text = choice.tracker.update(choice.tokens, reason is not None)
            if choice.tracker.stopped:
                reason = "stop"
            logprobs = []
            if completion.logprobs is not None:
                fresh = completion.logprobs[choice.logprobs_sent:]
                logprobs = [(tok, lp, top) for tok, (lp, top) in
                            zip(choice.tokens[choice.logprobs_sent:], fresh)]
                choice.logprobs_sent += len(fresh)
            choice.finish_reason = reason
            prompt = None
            if not choice.started:
                choice.started = True
                prompt = self._prompt_echo(out, base)
            if text or logprobs or reason is not None or prompt is not None:
                deltas.append(ChoiceDelta(base + completion.index, text, logprobs, reason, prompt))
        if out.request_id in self._open and not out.finished:  # a stop string the engine has not seen yet
            ids = range(base, base + len(out.outputs))
            if all(self.choices[i].finish_reason is not None for i in ids) and len(out.outputs) == self._width(
                    out.request_id):
                self.bridge.abort(out.request_id)
                self._open.discard(out.request_id)
        return deltas

    def _prompt_echo(self, out, base: int) -> PromptEcho | None:
        """The prompt part of a choice's first delta (None when the request neither echoes nor scores it)."""
        if not self.echo and self.prompt_top is None:
            return None
        index = base // self.n
        ids = self.prompts[index]
        text = ""
        if self.echo:
            text = self.prompt_texts[index] if self.prompt_texts is not None else self.tokenizer.decode(ids)
        scores = None
        if self.prompt_top is not None:
            values, tops = out.prompt_logprobs or [], out.prompt_top_logprobs or []
            scores = [(lp, rank, alternatives) for (lp, _), (rank, alternatives) in zip(values, tops)]
        return PromptEcho(text, ids, scores)

    def _width(self, request_id: str) -> int:
        for rid, _, params, _ in self._specs:
            if rid == request_id:
                return params.num_return_sequences
        return 1

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}
