"""Turning a choice's growing token list into text deltas, with OpenAI's stop-sequence semantics.

The engine stops a sequence when a stop string appears in its recent detokenized text; the text returned must end
right before the stop string (OpenAI truncates it away), and a stream must never send characters that later turn out
to be the start of a stop string, nor half of a multi-byte character. `TextTracker` does both.
"""

from __future__ import annotations

__all__ = ["TextTracker", "find_stop", "held_back"]


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop string starts in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` must wait: the longest suffix that is a proper prefix of a stop
    string (it may still become one), or a trailing replacement character (an incomplete UTF-8 sequence)."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:k]):
                keep = k
                break
    if text.endswith("\ufffd"):
        keep = max(keep, len(text) - len(text.rstrip("\ufffd")))
    return keep


class TextTracker:
    """The text of one choice so far; `update(token_ids, finished)` returns the new text to send.

    `stopped` becomes True once a stop string appeared: the text then ends before it, and the choice is over
    (its finish reason is "stop") even if the engine has not noticed yet.
    """

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.sent = ""
        self.num_tokens = 0
        self.stopped = False

    def update(self, token_ids: list[int], finished: bool) -> str:
        if self.stopped:
            return ""
        self.num_tokens = len(token_ids)
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        cut = find_stop(text, self.stops) if self.stops else None
        if cut is not None:
            text, self.stopped, finished = text[:cut], True, True
        end = len(text) if finished else len(text) - held_back(text, self.stops)
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):end], text[:end]
        return delta
