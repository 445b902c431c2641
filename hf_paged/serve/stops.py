"""Turning a choice's growing token list into text deltas, with OpenAI's stop-sequence semantics.

The engine stops a sequence when a stop string appears in its recent detokenized text; the text returned must end
right before the stop string (OpenAI truncates it away), and a stream must never send characters that later turn out
to be the start of a stop string, nor half of a multi-byte character. `TextTracker` does both.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers.tokenization_utils_tokenizers import TokenizersBackend

__all__ = ["TextTracker", "fast_decode", "find_stop", "held_back"]


def fast_decode(tokenizer) -> Callable[[list[int]], str] | None:
    """The Rust tokenizer's own `decode(ids, skip_special_tokens=True)` where transformers' `decode` adds nothing to
    it (a fast tokenizer whose `decode` / `_decode` are not overridden, without the clean-up of tokenization spaces),
    else None. Three times cheaper a call (about 5 against 16 us on one core): a stream decodes twice a token, and on
    a busy server the front's event loop, not the GPU, sets the pace (`--data-parallel-size`)."""
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (not isinstance(tokenizer, TokenizersBackend) or backend is None
            or cls.decode is not TokenizersBackend.decode or cls._decode is not TokenizersBackend._decode
            or getattr(tokenizer, "clean_up_tokenization_spaces", False)):
        return None
    decode = backend.decode
    return lambda ids: decode(ids, skip_special_tokens=True)


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

    Detokenization is incremental, so a step costs the same at token 10 and at token 10,000 (decoding the whole list
    every step made a stream quadratic, and on a busy server the event loop, not the GPU, set the pace): the new
    text is the decode of a short window `[prefix, end)` minus the decode of `[prefix, read)`, taken once it no longer
    ends in an incomplete character. The window restarts at the last token read, so a tokenizer's leading-space or
    byte-merging rules see the same context as in a full decode. Stop strings are searched only in the text that can
    contain a new one (from just before what was already read).
    """

    def __init__(self, tokenizer, stops: list[str], keep_special: frozenset[int] = frozenset()) -> None:
        """`keep_special`: special token ids whose text is kept (a tool parser's markers, e.g. Mistral's
        `[TOOL_CALLS]`); every other special token is dropped from the text, as usual."""
        self.tokenizer = tokenizer
        self.keep_special = keep_special
        self._special = _special_ids(tokenizer) - keep_special if keep_special else frozenset()
        self._fast = None if keep_special else fast_decode(tokenizer)
        self.stops = stops
        self._longest_stop = max((len(s) for s in stops), default=0)
        self.text = ""  # the decoded text of the tokens read so far
        self.sent = ""
        self.num_tokens = 0
        self.stopped = False
        self._prefix = 0  # token index where the decode window starts
        self._read = 0  # tokens whose text is in `self.text`

    def _decode(self, token_ids: list[int]) -> str:
        if self.keep_special:
            drop = self._special
            return self.tokenizer.decode([t for t in token_ids if t not in drop], skip_special_tokens=False)
        if self._fast is not None:
            return self._fast(token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _advance(self, token_ids: list[int], finished: bool) -> None:
        """Append the text of `token_ids[self._read:]` to `self.text` (all of it when finished; else up to the last
        complete character)."""
        if len(token_ids) <= self._read:
            return
        before = self._decode(token_ids[self._prefix:self._read])
        after = self._decode(token_ids[self._prefix:])
        if len(after) > len(before) and after.startswith(before) and (finished or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(token_ids)
        elif finished and not after.startswith(before):  # a tokenizer that rewrites earlier text: decode it all
            self.text = self._decode(token_ids)
            self._prefix = self._read = len(token_ids)

    def update(self, token_ids: list[int], finished: bool) -> str:
        if self.stopped:
            return ""
        self.num_tokens = len(token_ids)
        start = max(0, len(self.text) - self._longest_stop + 1)
        self._advance(token_ids, finished)
        text = self.text
        cut = None
        if self.stops:
            hit = find_stop(text[start:], self.stops)
            cut = None if hit is None else start + hit
        if cut is not None:
            text, self.stopped, finished = text[:cut], True, True
        end = len(text) if finished else len(text) - held_back(text, self.stops)
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):end], text[:end]
        return delta


def _special_ids(tokenizer) -> frozenset[int]:
    """Every special token id of a tokenizer: its named and additional special tokens and its special added tokens."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return frozenset(ids)
