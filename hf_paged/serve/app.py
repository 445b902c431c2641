"""The FastAPI app: OpenAI's completions and chat completions (whole or streamed), models, health and metrics.

`build_app(engine, tokenizer)` is all an embedding program needs (serve it with uvicorn or any ASGI server); the
engine steps in the app's background thread (`EngineBridge`) from the moment the app is built, and the app's
lifespan end (server shutdown) closes it: in-flight requests are aborted and the KV pool goes back.

`build_app(router)` serves a started `ReplicaRouter` instead (data parallelism: one engine process per device); the
API layer is the same, the router routes each engine request (`X-HF-Paged-Affinity` header: a routing key) and
every response names its replicas in `X-HF-Paged-Replica`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time

from fastapi import FastAPI, Request
from fastapi import Response as HeaderResponse
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..engine import Engine
from .bridge import EngineBridge, ReplicaUnavailable, RequestFailed
from .generation import ChoiceDelta, Generation, PromptEcho
from .limits import AdmissionLimits, RequestTimedOut
from .metrics import ServerMetrics
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest, error_body
from .router import ReplicaRouter
from .stream import (
    DONE,
    chat_chunk,
    chat_logprobs,
    completion_chunk,
    completion_logprobs,
    echo_entries,
    prompt_logprobs_list,
    sse,
)
from .structured import constraint_of
from .tools import ToolStream, check_template, forced_calls, guess_parser, marker_ids, tool_parser

__all__ = ["AFFINITY_HEADER", "REPLICA_HEADER", "build_app"]

AFFINITY_HEADER = "X-HF-Paged-Affinity"  # a routing key: requests with the same one go to the same replica
REPLICA_HEADER = "X-HF-Paged-Replica"  # the replica(s) that served a response (data-parallel serving)


def build_app(engine: Engine | ReplicaRouter, tokenizer=None, *, model_name: str | None = None,
              api_key: str | None = None, shutdown_grace: float = 5.0, max_queue_len: int | None = None,
              request_timeout: float | None = None, tool_call_parser: str | None = None) -> FastAPI:
    """An OpenAI-compatible app serving `engine` (its tokenizer unless `tokenizer` is given), or the replicas of a
    started `ReplicaRouter` (the first replica's tokenizer unless given; shut down with the app).

    `model_name`: the id clients pass as `model` (default: the model's `name_or_path`). `api_key`: when set, every
    `/v1` route needs `Authorization: Bearer <api_key>` (401 otherwise). `shutdown_grace`: seconds in-flight requests
    may still run when the app shuts down before they are aborted. `max_queue_len`, `request_timeout`: admission
    limits (`hf_paged.serve.limits`: 429 past the queue bound, 504 past the deadline). `tool_call_parser`: the
    model's tool-call format (`hf_paged.serve.tools`; default: guessed from the chat template).
    """
    tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
    if tokenizer is None:
        raise ValueError("build_app needs a tokenizer: pass tokenizer= or build the engine with one")
    if isinstance(engine, ReplicaRouter):
        if not engine.started:
            raise ValueError("build_app needs a started ReplicaRouter: call router.start() first")
        bridge = engine
    else:
        if engine.tokenizer is None:
            engine.tokenizer = tokenizer  # stop strings are matched on detokenized text by the engine too
        bridge = EngineBridge(engine)
    name = model_name or bridge.model_name
    metrics = ServerMetrics()
    limits = AdmissionLimits(max_queue_len, request_timeout)
    parser = tool_parser(tool_call_parser or guess_parser(tokenizer))

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        # the grammar compiler's view of the tokenizer (a second or two for a 150k vocabulary) is built now, in a
        # thread, not when the first structured request arrives
        warming = asyncio.ensure_future(asyncio.to_thread(bridge.warm_up_grammars))
        yield
        warming.cancel()
        await asyncio.to_thread(bridge.shutdown, shutdown_grace)

    app = FastAPI(title="hf-paged", lifespan=lifespan)
    app.state.bridge, app.state.metrics, app.state.model_name = bridge, metrics, name
    app.state.limits, app.state.tool_parser = limits, parser

    @app.exception_handler(ApiError)
    async def _api_error(_request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"malformed JSON body: {first.get('msg', '')}", "invalid_request_error",
                                           None, "invalid_json"), status_code=400)
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg", "invalid body"))
        return JSONResponse(error_body(message, "invalid_request_error", param, "invalid_value"), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(_request, error: HTTPException):
        return JSONResponse(error_body(str(error.detail), "invalid_request_error", None, str(error.status_code)),
                            status_code=error.status_code)

    if api_key is not None:
        app.add_middleware(_ApiKeyCheck, api_key=api_key)

    def check_model(requested: str | None) -> str | None:
        """The LoRA adapter `requested` names (None: the base model); 404 for a model this server does not serve."""
        if requested is None or requested == name:
            return None
        if requested in bridge.lora_names():
            return requested
        served = ", ".join(repr(m) for m in [name, *bridge.lora_names()])
        raise ApiError(f"the model {requested!r} does not exist; this server serves {served}", status=404,
                       param="model", code="model_not_found")

    async def new_generation(body, request: Request, prompts: list[list[int]], logprobs: int | None, *,
                             constraint=(None, {}), **kwargs) -> Generation:
        """Admit the request (429 when the queue is full), compile its grammar (off the event loop) and start it."""
        param, fields = constraint
        ticket = limits.admit()
        try:
            gen = Generation(bridge, tokenizer, metrics, prompts, n=body.n, temperature=body.temperature,
                             top_p=body.top_p, max_tokens=body.max_tokens, stop=body.stop or [], seed=body.seed,
                             logprobs=logprobs, ignore_eos=body.ignore_eos, constraint=fields, constraint_param=param,
                             ticket=ticket, affinity=request.headers.get(AFFINITY_HEADER), **kwargs)
            await gen.compile_grammar()
            gen.start()
        except BaseException:
            ticket.release()
            raise
        return gen

    @app.get("/health")
    async def health():
        status, body = bridge.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def prometheus():
        stats = await asyncio.to_thread(bridge.queue_stats)
        stats.update(queued=limits.queued, refused=limits.refused, timed_out=limits.timed_out)
        return Response(metrics.render(stats), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        base = {"id": name, "object": "model", "created": created, "owned_by": "hf-paged",
                "max_model_len": bridge.max_model_len}
        adapters = [{**base, "id": lora, "parent": name} for lora in bridge.lora_names()]  # (vLLM's `parent`)
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, response: HeaderResponse):
        lora = check_model(body.model)
        body.check_scoring()
        given = body.prompts()
        prompts = [tokenizer(p, add_special_tokens=True)["input_ids"] if isinstance(p, str) else list(p) for p in given]
        texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in given] if body.echo else None
        gen = await new_generation(body, request, prompts, body.logprobs, constraint=constraint_of(body),
                                   echo=body.echo, prompt_texts=texts, prompt_top=body.scores_prompt,
                                   prompt_logprobs=body.prompt_logprobs, lora=lora)
        if body.stream:
            return _sse_response(gen, lora or name, body.include_usage, chat=False)
        response.headers.update(_replica_header(gen))
        choices = []
        for index, (text, logprobs, reason, prompt) in enumerate(await _run_whole(gen, request)):
            extra = {}
            if prompt is not None and body.echo:
                text = prompt.text + text
                logprobs = (echo_entries(prompt) if body.logprobs is not None else []) + logprobs
            if prompt is not None and body.prompt_logprobs is not None:
                extra["prompt_logprobs"] = prompt_logprobs_list(tokenizer, prompt)
            lp = completion_logprobs(tokenizer, logprobs, 0) if body.logprobs is not None else None
            choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": reason, **extra})
        return {"id": f"cmpl-{gen.id}", "object": "text_completion", "created": gen.created, "model": lora or name,
                "choices": choices, "usage": gen.usage}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request, response: HeaderResponse):
        lora = check_model(body.model)
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError("the model's tokenizer has no chat template; use /v1/completions", param="messages")
        use_tools = bool(body.tools) and body.tool_choice != "none"
        if use_tools:
            check_template(tokenizer, body.tools)
        try:
            messages = [m.for_template() for m in body.messages]
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if use_tools else None
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception as error:  # noqa: BLE001 - a template that refuses these messages
            raise ApiError(f"the chat template refused the messages: {error}", param="messages") from None
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        constraint = constraint_of(body)
        forced = forced_calls(parser, body, tokenizer) if use_tools else None
        if forced is not None:
            if constraint[0] is not None:
                raise ApiError(f"tool_choice {body.tool_choice if isinstance(body.tool_choice, str) else 'function'}"
                               f" cannot be combined with {constraint[0]}", param="tool_choice")
            constraint = ("tool_choice", {"structural_tag": forced})
        keep = marker_ids(parser, tokenizer) if use_tools else frozenset()
        gen = await new_generation(body, request, [prompt], body.num_logprobs, constraint=constraint,
                                   keep_special=keep, lora=lora)
        if body.stream:
            return _sse_response(gen, lora or name, body.include_usage, chat=True,
                                 tool_parser=parser if use_tools else None)
        response.headers.update(_replica_header(gen))
        choices = []
        for index, (text_out, logprobs, reason, _) in enumerate(await _run_whole(gen, request)):
            lp = chat_logprobs(tokenizer, logprobs) if body.logprobs else None
            content, calls = parser.parse(text_out) if use_tools else (text_out, [])
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [call.as_dict() for call in calls]
                reason = "tool_calls" if reason == "stop" else reason
            choices.append({"index": index, "message": message, "logprobs": lp, "finish_reason": reason})
        return {"id": f"chatcmpl-{gen.id}", "object": "chat.completion", "created": gen.created,
                "model": lora or name,
                "choices": choices, "usage": gen.usage}

    return app


async def _run_whole(gen: Generation, request: Request) -> list[tuple[str, list, str | None, PromptEcho | None]]:
    """Run a request to the end; (text, logprob entries, finish reason, prompt echo) per choice. A client that
    disconnects aborts it (checked while waiting); one past the request timeout is aborted and answered 504."""
    texts = [""] * len(gen.choices)
    logprobs: list[list] = [[] for _ in gen.choices]
    reasons: list[str | None] = [None] * len(gen.choices)
    prompts: list[PromptEcho | None] = [None] * len(gen.choices)

    async def consume():
        async for deltas in gen.events():
            for d in deltas:
                texts[d.index] += d.text
                logprobs[d.index].extend(d.logprobs)
                reasons[d.index] = d.finish_reason or reasons[d.index]
                prompts[d.index] = d.prompt or prompts[d.index]

    task = asyncio.ensure_future(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                break
            if await request.is_disconnected():
                task.cancel()
                gen.abort()
                raise ApiError("client disconnected", status=499, code="client_closed")
        task.result()
    except RequestTimedOut as error:
        raise ApiError(str(error), status=504) from None
    except ReplicaUnavailable as error:
        raise ApiError(str(error), status=503, code="replica_unavailable") from None
    except RequestFailed as error:
        raise ApiError(str(error), status=500) from None
    finally:
        if not task.done():
            task.cancel()
        gen.abort()
    return list(zip(texts, logprobs, reasons, prompts))


class _ApiKeyCheck:
    """401 for a `/v1` request without `Authorization: Bearer <api_key>`, as a plain ASGI middleware: starlette's
    `BaseHTTPMiddleware` (`@app.middleware("http")`) relays every response body through a memory stream and task
    group, which cost the front's event loop about as much as everything else in a streamed token did."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = next((value for key, value in scope["headers"] if key == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                error = ApiError("invalid or missing API key (Authorization: Bearer <key>)", status=401)
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _sse_response(gen: Generation, model: str, include_usage: bool, *, chat: bool,
                  tool_parser=None) -> StreamingResponse:
    async def body():
        state: dict | set = set() if chat else {}
        streams: dict[int, ToolStream] | None = {} if tool_parser is not None else None
        try:
            async for deltas in gen.events():
                if chat:
                    chunk = chat_chunk(gen, model, deltas, state, _tool_deltas(deltas, streams, tool_parser))
                else:
                    chunk = completion_chunk(gen, model, deltas, state)
                if chunk["choices"]:
                    yield sse(chunk)
            if include_usage:
                kind = "chat.completion.chunk" if chat else "text_completion"
                prefix = "chatcmpl" if chat else "cmpl"
                yield sse({"id": f"{prefix}-{gen.id}", "object": kind, "created": gen.created, "model": model,
                           "choices": [], "usage": gen.usage})
        except RequestTimedOut as error:
            yield sse(ApiError(str(error), status=504).body())
        except ReplicaUnavailable as error:
            yield sse(ApiError(str(error), status=503, code="replica_unavailable").body())
        except ApiError as error:  # refused by a data-parallel replica after the stream had begun
            yield sse(error.body())
        except RequestFailed as error:
            yield sse(ApiError(str(error), status=500).body())
        finally:
            gen.abort()  # the client went away (the task is cancelled) or we are done: free the blocks now
        yield DONE

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **_replica_header(gen)})


def _replica_header(gen: Generation) -> dict[str, str]:
    """`X-HF-Paged-Replica: 0,1` when data-parallel replicas serve the request (nothing with one engine)."""
    return {REPLICA_HEADER: ",".join(map(str, gen.replicas))} if gen.replicas else {}


def _tool_deltas(deltas: list[ChoiceDelta], streams: dict | None, parser) -> dict | None:
    """Per choice index: (content, [(call index, ToolCall)], whether it made calls), for a chat stream with tools."""
    if streams is None:
        return None
    out = {}
    for d in deltas:
        stream = streams.setdefault(d.index, ToolStream(parser))
        content, calls = stream.update(d.text, d.finish_reason is not None)
        out[d.index] = (content, calls, bool(stream.calls))
    return out
