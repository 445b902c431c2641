"""`generate(stopping_criteria=...)` on the paged path: one row-sized criterion set per batch row.

transformers asks its `StoppingCriteriaList` once per step with the whole `[batch, len]` `input_ids` (each row is the
row as passed in, pads included, followed by its generated tokens) and stops a row when the criteria say so for it.
The engine asks per sequence (`hf_paged.engine.criteria`), so each row gets:

- its own shallow copy of every criterion, in which any list attribute sized to the batch (per-row state such as
  lm-eval's `MultiTokenEOSCriteria.done_tracker`) is replaced by a one-element list holding that row's entry; the
  criterion then sees a batch of one and keeps state for that row only;
- a view of the ids exactly as transformers would show them: the row's original `input_ids` (left pads included, so
  offsets such as lm-eval's `initial_decoder_input_length` still point at the first generated token) plus the tokens
  generated so far, on the inputs' device.

A criterion whose answer for a row depends on other rows (for example one that returns True only when *every* row of
the batch is done, as lm-eval's does) therefore answers for that row alone: the row stops as soon as it is done.
Per-row outputs can thus be shorter than transformers' for criteria of that kind (transformers keeps generating for
rows already done until the whole batch is); lm-eval cuts every continuation at its stop strings, so its results
are the same.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["RowCriteria", "per_row_criteria"]


def _row_copy(criterion, row: int, batch: int):
    """A copy of `criterion` whose batch-sized list attributes hold only `row`'s entry."""
    try:
        state = vars(criterion)
    except TypeError:  # no __dict__ (a plain function or a slotted object): nothing per-row to split
        return criterion
    if not any(isinstance(v, list) and len(v) == batch for v in state.values()):
        return criterion
    clone = copy.copy(criterion)
    for name, value in state.items():
        if isinstance(value, list) and len(value) == batch:
            setattr(clone, name, [copy.copy(value[row])])
    return clone


class RowCriteria:
    """The stopping criteria of one batch row, as the engine calls them: `(ids [1, len], scores) -> bool`."""

    def __init__(self, criteria, row_ids: torch.Tensor, kept_len: int, row: int, batch: int) -> None:
        self.criteria = [_row_copy(c, row, batch) for c in criteria]
        self.row_ids = row_ids.reshape(1, -1)  # the row as passed to generate(), pads included
        self.kept_len = kept_len  # prompt tokens the engine holds (the row without its masked pads)

    def __call__(self, input_ids: torch.Tensor, scores=None) -> bool:
        generated = input_ids[:, self.kept_len:].to(self.row_ids.device)
        seen = torch.cat([self.row_ids, generated], dim=1)
        for criterion in self.criteria:
            result = criterion(seen, scores)
            if bool(result.reshape(-1).any()) if isinstance(result, torch.Tensor) else bool(result):
                return True
        return False


def per_row_criteria(stopping_criteria, input_ids: torch.Tensor, kept_lens: list[int]) -> list[RowCriteria]:
    """One `RowCriteria` per row of `input_ids` (`kept_lens[i]`: prompt tokens row i keeps after its mask)."""
    criteria = list(stopping_criteria)
    for criterion in criteria:
        if not callable(criterion):
            raise TypeError(f"stopping_criteria must hold callables, got {type(criterion).__name__}")
    batch = input_ids.shape[0]
    return [RowCriteria(criteria, input_ids[i], kept_lens[i], i, batch) for i in range(batch)]
