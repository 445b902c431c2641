"""Tool-call parsers on text (hermes, llama3_json, mistral; whole replies and streamed deltas), the parser guessed
from a chat template, and the forcing grammars: each admits its own format's calls (checked with an xgrammar matcher)
and the parser reads back what it admits."""

from __future__ import annotations

import json

import pytest

from hf_paged.serve.protocol import ChatCompletionRequest
from hf_paged.serve.tools import ToolStream, forced_calls, guess_parser, tool_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}

REPLIES = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
               "Let me check."),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}', None),
    "mistral": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]', None),
}
EXPECTED = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_whole_replies_parse_into_calls(name):
    parser = tool_parser(name)
    text, content = REPLIES[name]
    got_content, calls = parser.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED
    assert all(c.as_dict()["id"].startswith("call_") and c.as_dict()["type"] == "function" for c in calls)
    plain = "The weather is {probably} nice."
    assert parser.parse(plain) == (plain, [])


@pytest.mark.parametrize("name", sorted(REPLIES))
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_give_the_same_content_and_calls(name, step):
    text, content = REPLIES[name]
    stream = ToolStream(tool_parser(name))
    sent, calls = "", []
    for at in range(0, len(text), step):
        piece = text[at:at + step]
        delta, new = stream.update(piece, at + step >= len(text))
        sent += delta
        calls += new
    assert sent.strip() == (content or "")
    assert [i for i, _ in calls] == [0, 1]
    assert [(c.name, json.loads(c.arguments)) for _, c in calls] == EXPECTED


def test_stream_without_calls_is_all_content_and_holds_back_marker_prefixes():
    stream = ToolStream(tool_parser("hermes"))
    assert stream.update("Hello <tool", False) == ("Hello ", [])  # "<tool" may open a call: held back
    assert stream.update("box> done", True) == ("<toolbox> done", [])


def test_parser_guessed_from_the_chat_template():
    class Tok:
        chat_template = ""

    tok = Tok()
    for template, name in (("{{ '<tool_call>' }}", "hermes"), ("[TOOL_CALLS]", "mistral"),
                           ("<|python_tag|>{{ tools }}", "llama3_json"), ("{{ messages }}", "hermes")):
        tok.chat_template = template
        assert guess_parser(tok) == name
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        tool_parser("nope")


def _matcher(tag: dict):
    xgr = pytest.importorskip("xgrammar")
    from hf_paged.testing import byte_tokenizer

    tok = byte_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[2])
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_structural_tag(tag))


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_forcing_grammars_admit_their_format(name):
    from hf_paged.testing import byte_tokenizer

    parser = tool_parser(name)
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER, TIME],
                                 tool_choice="required")
    tag = forced_calls(parser, body, byte_tokenizer())
    text = {"hermes": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
            "llama3_json": '{"name": "get_time", "parameters": {"zone": "UTC"}}',
            "mistral": '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}]'}[name]
    matcher = _matcher(tag)
    assert matcher.accept_string(text) and matcher.is_completed()
    assert [c.name for c in parser.parse(text)[1]] == ["get_time"]
    assert not _matcher(tag).accept_string(text.replace("get_time", "get_moon"))  # only the tools given
    named = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER, TIME],
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert not _matcher(forced_calls(parser, named, byte_tokenizer())).accept_string(text)  # get_time not allowed
    auto = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice="auto")
    assert forced_calls(parser, auto, byte_tokenizer()) is None


def test_tool_choice_validation():
    with pytest.raises(ValueError, match="not in tools"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                              tool_choice={"type": "function", "function": {"name": "other"}})
    with pytest.raises(ValueError, match="needs tools"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice="required")
