"""OpenAI response bodies: whole responses and server-sent-event chunks for both endpoints, logprobs included."""

from __future__ import annotations

import json

from .generation import ChoiceDelta, Generation

__all__ = ["sse", "DONE", "completion_chunk", "chat_chunk", "completion_logprobs", "chat_logprobs"]

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
        top_logprobs.append({_token_text(tokenizer, t): lp for t, lp in top})
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


def completion_chunk(gen: Generation, model: str, deltas: list[ChoiceDelta], offsets: dict[int, int]) -> dict:
    choices = []
    for d in deltas:
        logprobs = None
        if gen.logprobs is not None:
            logprobs = completion_logprobs(gen.tokenizer, d.logprobs, offsets.get(d.index, 0))
        offsets[d.index] = offsets.get(d.index, 0) + len(d.text)
        choices.append({"index": d.index, "text": d.text, "logprobs": logprobs, "finish_reason": d.finish_reason})
    return {"id": f"cmpl-{gen.id}", "object": "text_completion", "created": gen.created, "model": model,
            "choices": choices}


def chat_chunk(gen: Generation, model: str, deltas: list[ChoiceDelta], started: set[int]) -> dict:
    choices = []
    for d in deltas:
        delta = {"content": d.text} if d.text or d.finish_reason is None else {}
        if d.index not in started:
            started.add(d.index)
            delta = {"role": "assistant", "content": d.text}
        logprobs = chat_logprobs(gen.tokenizer, d.logprobs) if gen.logprobs is not None else None
        choices.append({"index": d.index, "delta": delta, "logprobs": logprobs, "finish_reason": d.finish_reason})
    return {"id": f"chatcmpl-{gen.id}", "object": "chat.completion.chunk", "created": gen.created, "model": model,
            "choices": choices}
