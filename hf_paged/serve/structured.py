"""Structured outputs on the server: a request's `response_format` (OpenAI) or vLLM's extra parameters
(`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, `structured_outputs`) as `SamplingParams` fields.

The engine compiles and enforces the grammar (`hf_paged.engine.grammar`); this module only translates, and refuses a
request that asks for two constraints at once (400 naming both parameters).
"""

from __future__ import annotations

import torch

from .protocol import ApiError

__all__ = ["constraint_of", "warm_up_grammars"]


def warm_up_grammars(engine) -> bool:
    """Build the engine's grammar cache (xgrammar's tokenizer info) and warm the device masking up ahead of the first
    constrained request; False when xgrammar is not installed or the engine has no tokenizer (those requests then get
    a 400 saying so)."""
    try:
        engine.structured.warm_up((engine.dtype, torch.float32))
    except (ImportError, ValueError):
        return False
    return True


def constraint_of(body) -> tuple[str | None, dict]:
    """(the request parameter that carries the constraint, `SamplingParams` keyword arguments) of a request body;
    (None, {}) when it asks for none."""
    found: list[tuple[str, dict]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        found.append(("response_format", {"json_schema": rf.json_schema.json_schema}))
    for param, name in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        value = getattr(body, param)
        if value is not None:
            found.append((param, {name: value}))
    so = body.structured_outputs
    if so is not None:
        fields = {"json_schema": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                  "json_object": so.json_object or None}
        given = {k: v for k, v in fields.items() if v is not None}
        if len(given) != 1:
            raise ApiError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
                           param="structured_outputs")
        found.append(("structured_outputs", given))
    if len(found) > 1:
        raise ApiError(f"give one structured-output constraint, got {' and '.join(p for p, _ in found)}",
                       param=found[1][0])
    if not found:
        return None, {}
    return found[0]
