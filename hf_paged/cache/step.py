"""`StepMetadata`: what the attention function needs for one forward (slots to write, block tables to read).

Built by `PagedCache` (drop-in) or by the model runner (engine steps); read by `hf_paged.attention`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core import NULL_BLOCK
from .host_ints import int_table, int_tensor

__all__ = ["StepMetadata", "device_table", "make_step"]


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
    # hybrid models (`hf_paged.attention.recurrent`): the recurrent-state slot of each sequence ([S] int64; a CUDA
    # graph's padding rows point at the scratch slot), and for an eager ragged step each sequence's
    # (first row, tokens, whether it continues a state) on the host; None for a decode-only step, whose rows all
    # decode from their slot's state (a fresh slot holds zeros). `state_prev`: the padded layout's rows continue
    # their states (the drop-in cache after its first forward)
    state_slots: torch.Tensor | None = None
    state_rows: list[tuple[int, int, bool]] | None = None
    state_prev: bool = False
    # the host's word that the step writes at least one token (a slot >= 0): `make_step` knows it from its host lists;
    # steps built on device buffers (CUDA-graph captures, the warm-up) leave False. An FP8 pool calibrates its scales
    # only in such a step (`hf_paged.cache.kv_quant`)
    host_writes: bool = False
    extra: dict = field(default_factory=dict)
    # a grouped cache's step (`hf_paged.cache.grouped_cache`): each layer group's own step (slots and tables of the
    # group's block tables), index 0 being this step itself; None for every other cache
    group_steps: list[StepMetadata] | None = None

    def for_group(self, group: int) -> StepMetadata:
        """The step layer group `group` writes and reads through (this one for group 0 or an ungrouped cache).

        A grouped cache's layers alias slot tensors across groups, so a step that writes tokens without its groups'
        steps would write one group's slots into another group's blocks: refused loudly."""
        if self.group_steps is not None:
            return self.group_steps[group]
        if group and self.host_writes:
            raise RuntimeError("this step writes a grouped PagedCache without per-group steps (group_steps)")
        return self


def make_step(layout: str, slots: list[int], tables: list[list[int]], lens: list[int], q_lens: list[int],
              device: torch.device) -> StepMetadata:
    """The metadata of one forward from its host lists (slots of the new tokens, each sequence's table, length after
    the step and new tokens), uploaded without blocking the host."""
    width = max(1, max((len(t) for t in tables), default=1))
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    pin = device.type == "cuda"

    def to_dev(data):
        return int_tensor(data, pin=pin).to(device, non_blocking=True)

    return StepMetadata(
        layout=layout,
        slot_mapping=to_dev(slots),
        block_tables=int_table([device_table(t) for t in tables], width, pin=pin).to(device, non_blocking=True),
        seq_lens=to_dev(lens),
        cu_seqlens_q=to_dev(cu),
        max_seqlen_q=max(q_lens, default=0),
        decode_only=all(n == 1 for n in q_lens),
        host_writes=max(slots, default=-1) >= 0,
    )


def device_table(table: list[int]) -> list[int]:
    """A block table as the kernels get it: released entries (:data:`NULL_BLOCK`, a prefix) read as block 0.

    The kernels never read a block wholly before a query's window, but they index the table with it: any valid block
    id will do, and block 0 always exists.
    """
    if table and table[0] == NULL_BLOCK:
        return [0 if block == NULL_BLOCK else block for block in table]
    return table
