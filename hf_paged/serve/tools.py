"""Tool calls: the model's reply parsed into OpenAI `tool_calls`, whole or streamed, in three model formats, and the
grammar that forces a call when `tool_choice` is "required" or names a function.

Formats (`--tool-call-parser`, default: guessed from the chat template, else hermes):

* `hermes` (Hermes, Qwen 2.5 / 3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block a call.
* `llama3_json` (Llama 3.1+ JSON tool calling): the reply is ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``), several separated by ``;``.
* `mistral`: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.

A forced call is generated under an xgrammar structural tag in the parser's own format (the marker, then a JSON object
whose `name` is one of the allowed functions and whose arguments follow that function's `parameters` schema), so the
same parser reads it back. Text before the first call is the message's `content`.

Streaming: content is sent as it comes, except text that may be the start of a call marker (held back, as a stop
string's prefix is); once a marker appears the rest is tool calls, each sent as one `tool_calls` delta (name and
whole arguments) as soon as it is complete, the last ones when the reply ends.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass

from .protocol import ApiError
from .stops import held_back

__all__ = ["PARSERS", "ToolCall", "ToolParser", "ToolStream", "check_template", "forced_calls", "guess_parser",
           "marker_ids", "tool_parser"]


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_dict(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call(obj, *arg_keys: str) -> ToolCall | None:
    """A `ToolCall` from a parsed JSON object with a string `name` and its arguments under one of `arg_keys`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arg_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list:
    """Consecutive JSON values in `text`, separated by whitespace, `;` or `,`; stops at the first that is not one."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n;,":
            at += 1
        if at >= len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return values
        values.append(value)


class ToolParser(ABC):
    """One model format: `split` finds where calls start, `calls` parses them, `forced` builds the grammar."""

    name = ""
    markers: tuple[str, ...] = ()  # strings that open the tool-call part of a reply

    def start(self, text: str) -> int | None:
        """Index where the tool-call part of `text` starts, or None."""
        hits = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(hits) if hits else None

    def may_start(self, text: str) -> int:
        """How many trailing characters of `text` could still become a marker (held back while streaming)."""
        return held_back(text, list(self.markers))

    @abstractmethod
    def calls(self, part: str, final: bool) -> tuple[list[ToolCall], int]:
        """The complete calls at the start of the tool part `part` and how many characters they take (`final`: the
        reply ended, so unclosed calls count too)."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole reply; a reply whose tool part does not parse is all content."""
        at = self.start(text)
        if at is None:
            return text, []
        calls, _ = self.calls(text[at:], final=True)
        if not calls:
            return text, []
        content = text[:at].strip()
        return content or None, calls

    def call_schema(self, tool) -> dict:
        """The JSON schema of one call of `tool` (a `protocol.Tool`) in this format."""
        return {"type": "object", "properties": {"name": {"const": tool.function.name},
                                                 self.arguments_key: _parameters(tool)},
                "required": ["name", self.arguments_key]}

    arguments_key = "arguments"

    @abstractmethod
    def forced(self, tools: list, parallel: bool, tokenizer) -> dict:
        """An xgrammar structural tag (its `format`) that admits one or more calls of `tools` in this format."""


def _parameters(tool) -> dict:
    params = tool.function.parameters
    if not params or tool.function.strict is False:
        return {"type": "object"}
    return params


def _one_of(parser: ToolParser, tools: list) -> dict:
    schemas = [parser.call_schema(t) for t in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"type": "json_schema", "json_schema": schema}


def _calls_format(one: dict, parallel: bool, separator: str) -> dict:
    """xgrammar's structural format of one call (`one`), or with `parallel` of one or more calls `separator` apart."""
    if not parallel:
        return one
    more = {"type": "sequence", "elements": [{"type": "const_string", "value": separator}, one]}
    return {"type": "sequence", "elements": [one, {"type": "star", "content": more}]}


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def calls(self, part: str, final: bool) -> tuple[list[ToolCall], int]:
        calls, end = [], 0
        for match in self._block.finditer(part):
            if part[end:match.start()].strip():
                break
            values = _json_values(match.group(1))
            call = _call(values[0], "arguments", "parameters") if values else None
            if call is None:
                break
            calls.append(call)
            end = match.end()
        if final:  # an unclosed last block (the reply hit max_tokens or the model forgot the end tag)
            rest = part[end:].strip()
            if rest.startswith("<tool_call>"):
                values = _json_values(rest[len("<tool_call>"):])
                call = _call(values[0], "arguments", "parameters") if values else None
                if call is not None:
                    calls.append(call)
                    end = len(part)
        return calls, end

    def forced(self, tools: list, parallel: bool, tokenizer) -> dict:
        one = {"type": "sequence", "elements": [{"type": "const_string", "value": "<tool_call>\n"},
                                                 _one_of(self, tools),
                                                 {"type": "const_string", "value": "\n</tool_call>"}]}
        return _calls_format(one, parallel, "\n")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    arguments_key = "parameters"

    def start(self, text: str) -> int | None:
        """Only a reply that *starts* with a call (or the python tag) is one: a `{` in prose is not."""
        stripped = text.lstrip()
        if stripped.startswith("<|python_tag|>") or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def may_start(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if "<|python_tag|>".startswith(stripped) else 0

    def calls(self, part: str, final: bool) -> tuple[list[ToolCall], int]:
        body = part.lstrip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):]
        if not final:  # the calls are one JSON text: wait for the end of the reply
            return [], 0
        calls = [_call(v, "parameters", "arguments") for v in _json_values(body)]
        if not calls or any(c is None for c in calls):
            return [], 0
        return calls, len(part)

    def forced(self, tools: list, parallel: bool, tokenizer) -> dict:
        return _calls_format(_one_of(self, tools), parallel, "; ")


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def calls(self, part: str, final: bool) -> tuple[list[ToolCall], int]:
        body = part[len("[TOOL_CALLS]"):]
        values = _json_values(body)
        if not values:
            return [], 0
        items = values[0] if isinstance(values[0], list) else values
        calls = [_call(v, "arguments", "parameters") for v in items]
        if not calls or any(c is None for c in calls):
            return [], 0
        return (calls, len(part)) if final else ([], 0)

    def forced(self, tools: list, parallel: bool, tokenizer) -> dict:
        schemas = [self.call_schema(t) for t in tools]
        items = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        array = {"type": "array", "items": items, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        marker = "[TOOL_CALLS]"
        single = _single_token(tokenizer, marker)
        head = {"type": "token", "token": marker} if single else {"type": "const_string", "value": marker}
        return {"type": "sequence", "elements": [head, {"type": "const_string", "value": " "},
                                                 {"type": "json_schema", "json_schema": array}]}


def _single_token(tokenizer, text: str) -> bool:
    """Whether `text` is one token of the tokenizer's vocabulary (a special marker)."""
    try:
        token_id = tokenizer.convert_tokens_to_ids(text)
    except Exception:  # noqa: BLE001 - tokenizers without that lookup
        return False
    return isinstance(token_id, int) and token_id != getattr(tokenizer, "unk_token_id", None)


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def tool_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSERS)}")
    return PARSERS[name]()


def guess_parser(tokenizer) -> str:
    """The parser matching the chat template's tool-call syntax; hermes when it shows none."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def marker_ids(parser: ToolParser, tokenizer) -> frozenset[int]:
    """Ids of the parser's markers that are single special tokens: their text must stay in the decoded reply."""
    ids = set()
    for marker in parser.markers:
        if len(marker) > 1 and _single_token(tokenizer, marker):
            ids.add(int(tokenizer.convert_tokens_to_ids(marker)))
    return frozenset(ids)


def forced_calls(parser: ToolParser, body, tokenizer) -> dict | None:
    """The structural tag that enforces `tool_choice` "required" or a named function (None for "auto" / "none")."""
    choice = body.tool_choice
    if choice in (None, "auto", "none") or not body.tools:
        return None
    tools = body.tools if choice == "required" else [t for t in body.tools if t.function.name == choice.function.name]
    parallel = body.parallel_tool_calls and choice == "required"
    return {"type": "structural_tag", "format": parser.forced(tools, parallel, tokenizer)}


class ToolStream:
    """The tool-call part of one streamed choice: turns its text deltas into content deltas and whole calls."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""  # everything received
        self.sent = 0  # characters of content sent
        self.tool_at: int | None = None  # where the tool part starts, once seen
        self.consumed = 0  # characters of the tool part already turned into calls
        self.calls: list[ToolCall] = []

    def update(self, delta: str, final: bool) -> tuple[str, list[tuple[int, ToolCall]]]:
        """(content to send, [(index, call)] completed) after `delta`."""
        self.text += delta
        if self.tool_at is None:
            self.tool_at = self.parser.start(self.text)
        content_end = self.tool_at if self.tool_at is not None else (
            len(self.text) if final else len(self.text) - self.parser.may_start(self.text))
        content = self.text[self.sent:content_end] if content_end > self.sent else ""
        self.sent = max(self.sent, content_end)
        new: list[tuple[int, ToolCall]] = []
        if self.tool_at is not None:
            part = self.text[self.tool_at + self.consumed:]
            calls, used = self.parser.calls(part, final)
            self.consumed += used
            for call in calls:
                new.append((len(self.calls), call))
                self.calls.append(call)
            if final and not self.calls:  # the tool part did not parse: it was content after all
                content += self.text[self.sent:]
                self.sent = len(self.text)
        return content, new


def check_template(tokenizer, tools) -> None:
    """Refuse tools the chat template would silently drop (the model would never hear of them)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    if tools and "tools" not in template:
        raise ApiError("the model's chat template does not take tools (it never mentions them); serve a model "
                       "whose template does, or set one with --chat-template", param="tools")
