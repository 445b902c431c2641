"""The OpenAI request bodies the server accepts, validated by pydantic, and the OpenAI-style error they map to.

Unknown fields are refused (a silently ignored parameter would change what a client gets without telling it);
fields OpenAI defines but hf-paged does not implement are accepted only at their neutral value.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

__all__ = ["ApiError", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "JsonSchemaFormat",
           "ResponseFormat", "StreamOptions", "StructuredOutputsField", "Tool", "error_body", "MAX_N"]

MAX_N = 16  # choices per request (each is a sequence of the engine); more is refused with 400


class ApiError(Exception):
    """An error answered as OpenAI's error JSON with `status` (400 invalid request, 401 key, 500 engine failure)."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.headers = message, status, param, headers
        self.code = code or {400: "invalid_value", 401: "invalid_api_key", 404: "not_found",
                             429: "queue_full", 504: "request_timeout"}.get(status, "internal_error")

    @property
    def type(self) -> str:
        return {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                429: "rate_limit_error", 504: "timeout_error"}.get(self.status, "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _refuse_set(value, info: ValidationInfo):
    """A field OpenAI defines that hf-paged does not implement: accepted only when unset / empty / false."""
    if value:
        raise ValueError(f"{info.field_name} is not supported")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or a JSON schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("type json_schema needs json_schema: {name, schema}")
        return self


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` extra parameter (one of its fields)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens tokens whatever comes (benchmarks)
    # structured outputs (hf_paged.serve.structured): OpenAI's response_format, and vLLM's extra parameters
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsField | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, value):
        if value != 0.0:
            raise ValueError("only 0 is supported (presence/frequency penalties are not implemented)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _unsupported(cls, value, info: ValidationInfo):
        return _refuse_set(value, info)

    @model_validator(mode="after")
    def _checks(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0: score the prompt only (with echo or prompt_logprobs)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's extension: each prompt token's top-k
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and isinstance(value[0], list) and any(not p for p in value):
            raise ValueError("token-id prompts must not be empty")
        return value

    @field_validator("suffix")
    @classmethod
    def _unsupported_here(cls, value, info: ValidationInfo):
        return _refuse_set(value, info)

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must be equal to n (or left out)")
        return self

    def check_scoring(self) -> None:
        """max_tokens=0 only scores the prompt: it needs something to return (ApiError naming max_tokens)."""
        if self.max_tokens == 0 and not (self.echo or self.prompt_logprobs is not None):
            raise ApiError("max_tokens=0 generates nothing: it needs echo=true or prompt_logprobs (scoring)",
                           param="max_tokens")
        if self.max_tokens == 0 and self.n > 1:
            raise ApiError("max_tokens=0 (scoring only) needs n=1", param="max_tokens")

    @property
    def scores_prompt(self) -> int | None:
        """Top alternatives wanted per prompt token (None: the prompt is not scored): echo with logprobs, or
        prompt_logprobs."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts (a single prompt is a batch of one)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... go to the chat template untouched
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def for_template(self) -> dict:
        content = self.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]: text parts only
            if any(part.get("type") != "text" for part in content):
                raise ValueError("only text content parts are supported")
            content = "".join(str(part.get("text", "")) for part in content)
        message = {**(self.model_extra or {}), "role": self.role, "content": content or ""}
        calls = message.get("tool_calls")
        if calls:  # templates read the arguments as a mapping (transformers' convention); OpenAI sends JSON text
            message["tool_calls"] = [_call_for_template(call) for call in calls]
        return message


def _call_for_template(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise ValueError(f"tool call arguments are not JSON: {arguments[:80]!r}") from None
    return {**call, "function": function}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    class _Name(BaseModel):
        name: str

    type: Literal["function"] = "function"
    function: _Name


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools "
                                 f"({', '.join(names)})")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
