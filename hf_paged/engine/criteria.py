"""Per-sequence stopping criteria: transformers' `StoppingCriteria` objects (or plain callables) asked after every
token a sequence gets, each about that sequence alone.

transformers evaluates a `StoppingCriteriaList` once per step on the whole `[batch, len]` `input_ids`; the engine has
no fixed batch (requests join and leave every step), so it asks each criterion per sequence with a `[1, len]` view of
that sequence's ids (prompt + generated so far) and `scores=None` (the picked token may never have left the device as
a distribution; the criteria transformers ships and lm-eval's ignore `scores`). A criterion may return a bool, a
0-d or `[1]`-shaped bool tensor (what transformers' criteria return); any truthy value stops the sequence with
`stop_reason="stopping_criteria"`.

Criteria that keep state per batch row (lm-eval's `MultiTokenEOSCriteria` keeps a `done_tracker` list sized to the
batch) must be given to the engine one instance per request: `hf_paged.integrations.criteria` builds those
row-sized copies from what `generate()` receives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = ["as_criteria", "criteria_hit"]


def as_criteria(value) -> tuple[Callable, ...]:
    """Normalise `SamplingParams.stopping_criteria`: None, one callable, or an iterable of callables (a transformers
    `StoppingCriteriaList` is a list of them) -> a tuple of callables."""
    if value is None:
        return ()
    if callable(value) and not isinstance(value, (list, tuple)):
        return (value,)
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        items = tuple(value)
        for item in items:
            if not callable(item):
                raise TypeError(f"stopping_criteria must hold callables, got {type(item).__name__}")
        return items
    raise TypeError(f"stopping_criteria must be a callable or a list of callables, got {type(value).__name__}")


def _truthy(result) -> bool:
    if isinstance(result, torch.Tensor):
        return bool(result.reshape(-1).any())
    return bool(result)


def criteria_hit(token_ids: list[int], criteria: tuple[Callable, ...]) -> bool:
    """True when any criterion says the sequence whose ids are `token_ids` should stop."""
    ids = torch.tensor([token_ids], dtype=torch.long)
    return any(_truthy(criterion(ids, None)) for criterion in criteria)
