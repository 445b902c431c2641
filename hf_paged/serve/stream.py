"""OpenAI response bodies: whole responses and server-sent-event chunks for both endpoints, logprobs included."""

from __future__ import annotations

import json

from .generation import ChoiceDelta, Generation, PromptEcho

__all__ = ["sse", "DONE", "completion_chunk", "chat_chunk", "completion_logprobs", "chat_logprobs",
           "echo_entries", "prompt_logprobs_list"]

DONE = "data: [DONE]\n\n"


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def completion_logprobs(tokenizer, entries, offset: int) -> dict:
    """The completions API's logprobs object for `entries` ((token, logprob, top) each); `offset`: text so far."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token, logprob, top in entries:
        text = _token_text(tokenizer, token)
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append(None if top is None else {_token_text(tokenizer, t): lp for t, lp in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs(tokenizer, entries) -> dict:
    """The chat API's logprobs object (`content`: one entry per token, with its top alternatives)."""
    def item(token, logprob):
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(token, logprob), "top_logprobs": [item(t, lp) for t, lp in top]}
                        for token, logprob, top in entries]}


def echo_entries(prompt: PromptEcho) -> list:
    """The prompt's logprob entries of an echo: the first token has none; each other one its score and top
    alternatives, the token itself among them (as vLLM reports them)."""
    entries = [(prompt.token_ids[0], None, None)]
    for token, (logprob, _, top) in zip(prompt.token_ids[1:], prompt.scores or []):
        entries.append((token, logprob, [*top, (token, logprob)] if all(t != token for t, _ in top) else top))
    return entries


def prompt_logprobs_list(tokenizer, prompt: PromptEcho) -> list:
    """vLLM's `prompt_logprobs` of a choice: None for the first token, then {token id: {logprob, rank,
    decoded_token}} holding the prompt token and its top alternatives."""
    out: list = [None]
    for token, (logprob, rank, top) in zip(prompt.token_ids[1:], prompt.scores or []):
        entry = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": _token_text(tokenizer, token)}}
        for place, (alt, alt_logprob) in enumerate(top, start=1):
            entry.setdefault(str(alt), {"logprob": alt_logprob, "rank": place,
                                        "decoded_token": _token_text(tokenizer, alt)})
        out.append(entry)
    return out


def completion_chunk(gen: Generation, model: str, deltas: list[ChoiceDelta], offsets: dict[int, int]) -> dict:
    choices = []
    for d in deltas:
        text, entries = d.text, d.logprobs
        extra = {}
        if d.prompt is not None:
            if gen.echo:
                text = d.prompt.text + text
                entries = (echo_entries(d.prompt) if gen.logprobs is not None else []) + entries
            if gen.prompt_logprobs is not None:
                extra["prompt_logprobs"] = prompt_logprobs_list(gen.tokenizer, d.prompt)
        logprobs = None
        if gen.logprobs is not None:
            logprobs = completion_logprobs(gen.tokenizer, entries, offsets.get(d.index, 0))
        offsets[d.index] = offsets.get(d.index, 0) + len(text)
        choices.append({"index": d.index, "text": text, "logprobs": logprobs, "finish_reason": d.finish_reason,
                        **extra})
    return {"id": f"cmpl-{gen.id}", "object": "text_completion", "created": gen.created, "model": model,
            "choices": choices}


def chat_chunk(gen: Generation, model: str, deltas: list[ChoiceDelta], started: set[int],
               tools: dict | None = None) -> dict:
    """`tools`: per choice index, (content, [(call index, ToolCall)], whether the choice made calls) from its
    `ToolStream` (`hf_paged.serve.tools`), when the request has tools."""
    choices = []
    for d in deltas:
        text, calls, reason = d.text, [], d.finish_reason
        if tools is not None:
            text, calls, made_calls = tools[d.index]
            if made_calls and reason == "stop":
                reason = "tool_calls"
        delta = {"content": text} if text or (reason is None and not calls) else {}
        if d.index not in started:
            started.add(d.index)
            delta = {"role": "assistant", "content": text}
        if calls:
            delta["tool_calls"] = [call.as_dict(index) for index, call in calls]
        logprobs = chat_logprobs(gen.tokenizer, d.logprobs) if gen.logprobs is not None else None
        if not delta and reason is None and not d.logprobs:
            continue  # a held-back tool-call marker: nothing to send yet
        choices.append({"index": d.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason})
    return {"id": f"chatcmpl-{gen.id}", "object": "chat.completion.chunk", "created": gen.created, "model": model,
            "choices": choices}
