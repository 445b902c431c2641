"""Logits processing shared by the sampler and beam search, with transformers' arithmetic (repetition penalty)."""

from __future__ import annotations

import torch

__all__ = ["_apply_repetition_penalty"]


def _apply_repetition_penalty(scores: torch.Tensor, rows: list[int], penalties: list[float], token_ids, extras) -> None:
    """transformers' rule over the set of ids seen (plus `extra['penalty_ids']`, e.g. pads of a padded batch)."""
    for row, penalty, extra in zip(rows, penalties, extras):
        ids = torch.tensor(sorted(set(token_ids[row]) | set(extra)), dtype=torch.long, device=scores.device)
        picked = scores[row].index_select(0, ids)
        picked = torch.where(picked < 0, picked * penalty, picked / penalty)
        scores[row].index_copy_(0, ids, picked)
