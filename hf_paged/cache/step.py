"""`StepMetadata`: what the attention function needs for one forward (slots to write, block tables to read).

Built by `PagedCache` (drop-in) or by the model runner (engine steps); read by `hf_paged.attention`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["StepMetadata"]


@dataclass
class StepMetadata:
    """What the attention function needs for one forward: where the new tokens go and which blocks to read.

    `layout` is "padded" (query `[B, H, q, D]`, one sequence per row, q tokens each) or "ragged" (query `[1, H, T, D]`,
    sequence s owns rows `cu_seqlens_q[s]:cu_seqlens_q[s+1]`).
    """

    layout: str
    slot_mapping: torch.Tensor  # [T] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32, tokens in the cache after this step
    cu_seqlens_q: torch.Tensor  # [S+1] int32
    max_seqlen_q: int
    decode_only: bool
    kv_start: torch.Tensor | None = None  # [S] int32, first key to attend (left padding), None = 0
    kv_start_ready: bool = False
    # int32 zeros, >= S * KV heads, owned by one engine's runner (its launches run one after another): lets the fused
    # decode kernel combine its KV splits itself (`kernels.write_and_paged_decode`, `kernels.paged_decode`). None:
    # a second kernel combines them
    split_counters: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)
