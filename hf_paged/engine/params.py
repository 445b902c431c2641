"""`SamplingParams`: what one request asks for (lengths, sampling, stops, beams), validated when built.

Pure data plus validation; read by the engine, the sampler, beam search and the integrations that translate
transformers' `GenerationConfig` into it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field, fields

import torch

from .criteria import as_criteria

__all__ = ["SamplingParams", "CONSTRAINT_FIELDS", "validate_beam_params", "validate_prompt_logprobs"]

# the structured-output fields of `SamplingParams` (at most one per request; hf_paged.engine.grammar)
CONSTRAINT_FIELDS = ("json_schema", "regex", "choice", "json_object", "grammar", "structural_tag")


def _as_token_list(value, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a list of ints, got {value!r}")
    if isinstance(value, int):
        return (value,)
    if isinstance(value, SequenceABC) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise TypeError(f"{name} must be an int or a list of ints, got {value!r}")


def validate_beam_params(p) -> None:
    """Check the beam fields of a `SamplingParams` (called from `SamplingParams.validate`)."""
    k = p.num_beams
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"num_beams must be a positive int, got {k!r}")
    lp = p.length_penalty
    if not isinstance(lp, (int, float)) or isinstance(lp, bool) or not math.isfinite(lp):
        raise ValueError(f"length_penalty must be a finite number, got {lp!r}")
    es = p.early_stopping
    if not (isinstance(es, bool) or es == "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {es!r}")
    if k == 1:
        return
    if p.do_sample:
        raise ValueError("num_beams > 1 with do_sample=True (beam sampling) is not supported; use do_sample=False")
    if p.num_return_sequences > k:
        raise ValueError(
            f"num_return_sequences ({p.num_return_sequences}) must be <= num_beams ({k}) with beam search"
        )
    if p.stop_strings:
        raise ValueError("stop_strings is not supported with num_beams > 1")
    if p.stopping_criteria:
        raise ValueError("stopping_criteria is not supported with num_beams > 1")


def validate_prompt_logprobs(p) -> None:
    """Check `prompt_logprobs_start` (its upper bound, the prompt length, is checked by `Engine.add_request`)."""
    top = p.prompt_top_logprobs
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20:
        raise ValueError(f"prompt_top_logprobs must be an int in [0, 20], got {top!r}")
    start = p.prompt_logprobs_start
    if top and start is None:
        raise ValueError("prompt_top_logprobs needs prompt_logprobs_start (the first prompt token to score)")
    if start is None:
        return
    if not isinstance(start, int) or isinstance(start, bool) or start < 1:
        raise ValueError(f"prompt_logprobs_start must be None or an int >= 1 (token 0 has no context to score it "
                         f"from), got {start!r}")
    if p.num_beams > 1:
        raise ValueError("prompt_logprobs_start is not supported with num_beams > 1")
    if p.max_new_tokens == 0 and p.num_return_sequences > 1:
        raise ValueError("max_new_tokens=0 (scoring only) generates nothing: num_return_sequences must be 1")


@dataclass
class SamplingParams:
    """What one request asks for. Validation errors name the offending argument."""

    max_new_tokens: int = 20
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    eos_token_id: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    num_return_sequences: int = 1
    logits_processor: object = None
    output_scores: bool = False
    num_beams: int = 1  # > 1: beam search (hf_paged.engine.beam), transformers' arithmetic
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # callables (input_ids [1, len], scores) -> bool asked per sequence after each token (hf_paged.engine.criteria)
    stopping_criteria: tuple = ()
    logprobs: int | None = None  # report the chosen token's log-probability and this many top alternatives
    # score the prompt from this token on: `RequestOutput.prompt_logprobs` gets (log-probability, is argmax) of each
    # prompt token from this index on (index >= 1: token 0 has no context). With max_new_tokens=0 the request only
    # scores: the last prompt token is not computed, nothing is generated (hf_paged.engine.prompt_logprobs)
    prompt_logprobs_start: int | None = None
    # with prompt_logprobs_start: also record, per scored prompt token, its rank and this many top alternatives
    # (`RequestOutput.prompt_top_logprobs`; what a server's echo with logprobs reports)
    prompt_top_logprobs: int = 0
    # structured outputs (hf_paged.engine.grammar, needs xgrammar: `pip install "hf-paged[structured]"`); at most one:
    # a JSON schema (dict, JSON text or pydantic model class), a regular expression, a list of allowed strings, any
    # JSON object, an EBNF grammar (xgrammar's dialect) or an xgrammar structural tag (dict or JSON text). The request
    # finishes with reason "stop" once the grammar is complete and the model ends it (its EOS)
    json_schema: object = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    json_object: bool = False
    grammar: str | None = None
    structural_tag: object = None
    # the LoRA adapter to run the request through, by the name given to `Engine.add_lora` (None: the base model)
    lora: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.eos_token_id = _as_token_list(self.eos_token_id, "eos_token_id")
        if isinstance(self.stop_strings, str):
            self.stop_strings = (self.stop_strings,)
        self.stop_strings = tuple(self.stop_strings or ())
        self.stopping_criteria = as_criteria(self.stopping_criteria)
        _normalize_constraint(self)
        self.validate()

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in fields(cls)} - {"extra"}

    def validate(self) -> None:
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.max_new_tokens):
            raise TypeError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 0 or (self.max_new_tokens == 0 and self.prompt_logprobs_start is None):
            raise ValueError(f"max_new_tokens must be positive (0 only to score a prompt with "
                             f"prompt_logprobs_start), got {self.max_new_tokens}")
        if not is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be a non-negative int, got {self.min_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise TypeError(f"temperature must be a number, got {self.temperature!r}")
        if self.do_sample and not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative int (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and not is_int(self.seed):
            raise TypeError(f"seed must be an int, got {self.seed!r}")
        if not is_int(self.num_return_sequences) or self.num_return_sequences < 1:
            raise ValueError(f"num_return_sequences must be a positive int, got {self.num_return_sequences!r}")
        validate_beam_params(self)
        if self.num_return_sequences > 1 and not self.do_sample and self.num_beams == 1:
            raise ValueError(
                "num_return_sequences > 1 needs do_sample=True (greedy would return identical copies) or num_beams"
            )
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be None or an int in [0, 20], got {self.logprobs!r}")
        if self.logprobs is not None and self.num_beams > 1:
            raise ValueError("logprobs is not supported with num_beams > 1")
        validate_prompt_logprobs(self)
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise TypeError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")
        validate_constraint(self)
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise TypeError(f"lora must be None or an adapter's name (a non-empty string), got {self.lora!r}")

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the structured-output constraint, or None: the key its compiled grammar is cached by."""
        if self.json_schema is not None:
            return ("json_schema", self.json_schema)
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", json.dumps(list(self.choice), ensure_ascii=False))
        if self.json_object:
            return ("json_object", "")
        if self.grammar is not None:
            return ("grammar", self.grammar)
        if self.structural_tag is not None:
            return ("structural_tag", self.structural_tag)
        return None

    @property
    def needs_processing(self) -> bool:
        return self.repetition_penalty != 1.0 or self.logits_processor is not None or self.min_new_tokens > 0


def _normalize_constraint(p) -> None:
    """Bring the structured-output fields to their canonical form: JSON text for schemas and structural tags (a dict,
    or a pydantic model class for `json_schema`), a tuple for `choice`. Malformed values raise naming the field."""
    schema = p.json_schema
    if schema is not None:
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # a pydantic model class
            schema = schema.model_json_schema()
        p.json_schema = _json_text(schema, "json_schema", allow=(dict, bool))
    if p.structural_tag is not None:
        p.structural_tag = _json_text(p.structural_tag, "structural_tag", allow=(dict,))
    if p.choice is not None:
        if isinstance(p.choice, str) or not isinstance(p.choice, SequenceABC):
            raise TypeError(f"choice must be a list of strings, got {p.choice!r}")
        p.choice = tuple(p.choice)


def _json_text(value, name: str, allow: tuple) -> str:
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} is not valid JSON: {error}") from None
        if not isinstance(parsed, allow):
            raise ValueError(f"{name} must be a JSON object, got {value[:80]!r}")
        return value
    if isinstance(value, allow) and not isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    raise TypeError(f"{name} must be a dict or its JSON text, got {type(value).__name__}")


def validate_constraint(p) -> None:
    """Check the structured-output fields (their grammar itself is checked when the engine compiles it)."""
    given = [name for name in CONSTRAINT_FIELDS if getattr(p, name) not in (None, False)]
    if len(given) > 1:
        raise ValueError(f"give at most one structured-output constraint, got {', '.join(given)}")
    if not isinstance(p.json_object, bool):
        raise TypeError(f"json_object must be a bool, got {p.json_object!r}")
    for name in ("regex", "grammar"):
        value = getattr(p, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise TypeError(f"{name} must be a non-empty string, got {value!r}")
    if p.choice is not None and (not p.choice or not all(isinstance(c, str) and c for c in p.choice)):
        raise ValueError(f"choice must be a non-empty list of non-empty strings, got {list(p.choice)!r}")
    if not given:
        return
    if p.num_beams > 1:
        raise ValueError(f"{given[0]} (structured output) is not supported with num_beams > 1")
    if p.max_new_tokens == 0:
        raise ValueError(f"{given[0]} (structured output) needs max_new_tokens > 0: a scoring-only request "
                         f"generates nothing")
    if p.min_new_tokens > 0:  # its EOS mask could leave a complete grammar no token at all
        raise ValueError(f"min_new_tokens is not supported with {given[0]} (structured output): the grammar says "
                         f"when the output may end")


def copy_params(p: SamplingParams) -> SamplingParams:
    """A shallow copy of `p` with its own `extra` dict (one per request: the engine writes per-request state there)."""
    clone = SamplingParams.__new__(SamplingParams)
    clone.__dict__.update(p.__dict__)
    clone.extra = dict(p.extra)
    return clone
