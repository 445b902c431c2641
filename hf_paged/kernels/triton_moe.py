"""Fused mixture-of-experts in Triton: routing slots sorted by expert, two grouped GEMMs, a top-k combine.

Four launches, no host sync (safe under CUDA-graph capture), every buffer sized from shapes alone:

1. ``_align_kernel`` (one program per expert) sorts the routing slots ("pairs" ``p = t * K + k``) by expert, each
   expert's run padded to a multiple of ``BLOCK_M`` (vLLM's ``moe_align_block_size`` idea, written as one launch):
   every program builds the whole histogram of expert ids (``tl.histogram``), takes its own run's start from the
   padded counts of the experts before it, and writes its pairs there in slot order (a ``cumsum`` of matches per
   chunk), its padding as the sentinel ``S``, the expert of each of its blocks, and (program 0) the padded total.
   Runs are ordered by expert and pairs by slot, so the layout is deterministic. An id outside ``[0, E)`` (the
   expert-parallel sentinel) lands in no run. The buffer holds ``S + min(E, S) * (BLOCK_M - 1)`` entries: at most
   ``min(E, S)`` experts have pairs, each wasting less than a block.
2. ``_up_kernel``: one program per (block of ``BLOCK_M`` sorted pairs, tile of ``BLOCK_N`` intermediate columns).
   All pairs of a block share one expert, so the block is a plain GEMM tile of that expert's weights: the rows of
   ``hidden`` are gathered (``pair // K``), the gate and up tiles accumulate side by side in float32 (two dots on
   the same input tile, or one on interleaved rows), and the epilogue adds the biases and applies the activation, clamps included, before one
   store of ``act(gate) * up`` per pair row. The intermediate never goes to memory unactivated (vLLM's fused_moe
   writes the ``2I`` projections and runs a separate ``silu_and_mul``). Blocks past the padded total return at once.
3. ``_down_kernel``: the same grouped GEMM over the intermediate rows (by pair) with the down weights; the epilogue
   adds the bias and multiplies by the pair's routing weight, and stores the weighted row of the pair.
4. ``_combine_kernel``: each token sums its ``K`` weighted rows in float32, in slot order (no atomics: the sum, and
   so the output, are the same bits for the same inputs whatever the block layout or the graph).

Weights are read through their strides, so transformers' transposed layouts (gpt-oss) need no copy; interleaved
gate/up rows (gpt-oss: gate ``2n``, up ``2n + 1``) are read as one contiguous tile of ``2 * BLOCK_N`` columns whose
accumulator is split in registers (``tl.reshape`` + ``tl.split``), not as two tiles of every other column. ``fp32`` uses IEEE dots (no TF32: the float32 path must match
transformers); the interpreter computes dots in float32. Block sizes come from :func:`choose_config`, a small table
keyed by the mean pairs per active expert (decode: 1 to 512 rows times top-k); `benchmarks/bench_moe.py --tune`
measures the candidates on a GPU. Imported lazily by :mod:`hf_paged.kernels.moe` (needs triton).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .reference_moe import Activation

__all__ = ["MoeConfig", "CONFIGS", "choose_config", "candidate_configs", "fused_experts", "experts_up",
           "experts_down", "align"]

_ACT = {"identity": 0, "silu": 1, "gelu": 2, "gelu_tanh": 3}


class MoeConfig(NamedTuple):
    """Block sizes of one call: ``block_m`` (pairs per GEMM block, the alignment of each expert's run), then per GEMM
    ``(BLOCK_N, BLOCK_K, num_warps, num_stages)``."""

    block_m: int
    up: tuple[int, int, int, int]
    down: tuple[int, int, int, int]


#: (largest mean pairs per active expert, config). Decode rows read few pairs of each expert: a 16-row block and wide
#: K tiles (long contiguous weight reads, several stages in flight) while the GEMMs are bound by the weights' bytes;
#: taller blocks once an expert's run fills them. Seeded from the shapes of vLLM's tuned H100/H200 tables for
#: 64-128 experts (their first GEMM reads one tile where the fused gate/up reads two: half its BLOCK_N here);
#: `bench_moe.py --tune` re-measures them.
CONFIGS: tuple[tuple[float, MoeConfig], ...] = (
    (12, MoeConfig(16, (64, 128, 4, 3), (64, 128, 4, 3))),
    (24, MoeConfig(16, (64, 128, 4, 3), (128, 128, 4, 3))),
    (48, MoeConfig(32, (64, 128, 4, 3), (128, 64, 4, 3))),
    (96, MoeConfig(64, (64, 64, 4, 3), (128, 64, 4, 3))),
    (math.inf, MoeConfig(64, (128, 64, 8, 3), (128, 64, 8, 3))),
)
#: shared memory a config may take (its stages of input and weight tiles): what an A100 gives a block (164 KiB),
#: less what Triton keeps for itself. A wider config loses stages first, then K width (`_fit`).
SHARED_MEMORY = 160 * 1024


def _pow2_at_least_16(n: int) -> int:
    return max(16, triton.next_power_of_2(max(1, n)))


def _fit(tile: tuple[int, int, int, int], n: int, k: int, elem: int, block_m: int, weight_tiles: int
         ) -> tuple[int, int, int, int]:
    """A GEMM tile no wider than its (power-of-two rounded) dims, within `SHARED_MEMORY`: every stage holds a
    ``[block_m, BLOCK_K]`` input tile and `weight_tiles` ``[BLOCK_K, BLOCK_N]`` weight tiles."""
    block_n, block_k, warps, stages = tile
    block_n, block_k = min(block_n, _pow2_at_least_16(n)), min(block_k, _pow2_at_least_16(k))

    def size() -> int:
        return stages * (block_m * block_k + weight_tiles * block_k * block_n) * elem

    while size() > SHARED_MEMORY and stages > 2:
        stages -= 1
    while size() > SHARED_MEMORY and block_k > 16:
        block_k //= 2
    return block_n, block_k, warps, stages


def choose_config(num_pairs: int, num_experts: int, hidden: int, up_out: int, down_in: int, elem: int) -> MoeConfig:
    """The table's config for ``num_pairs`` routing slots over ``num_experts`` experts, tiles fitted to the dims (up:
    ``up_out`` columns over ``hidden``; down: ``hidden`` columns over ``down_in``; ``elem``: the weights' bytes)."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    config = next(c for limit, c in CONFIGS if per_expert <= limit)
    return fitted(config, hidden, up_out, down_in, elem)


def fitted(config: MoeConfig, hidden: int, up_out: int, down_in: int, elem: int) -> MoeConfig:
    """``config`` with its tiles fitted to the GEMM dims and the shared memory (see `choose_config`; the up GEMM
    reads two weight tiles, gate and up)."""
    return MoeConfig(config.block_m, _fit(config.up, up_out, hidden, elem, config.block_m, 2),
                     _fit(config.down, hidden, down_in, elem, config.block_m, 1))


def candidate_configs() -> list[MoeConfig]:
    """The configs `bench_moe.py --tune` times for each shape and row count (the table's included)."""
    tiles = [(n, k, w, s) for n in (32, 64, 128) for k in (64, 128, 256) for w in (4, 8) for s in (3, 4)
             if not (n == 32 and w == 8)]
    return [MoeConfig(m, t, t) for m in (16, 32, 64) for t in tiles]


# --------------------------------------------------------------------------------------------------------- kernels
@triton.jit(do_not_specialize=["num_pairs"])
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts,
                  BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr):
    expert = tl.program_id(0)
    bins = tl.arange(0, BINS)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        ids = tl.where((ids >= 0) & (ids < num_experts), ids, num_experts)  # dropped: the spare bin
        counts += tl.histogram(ids, BINS)
    counts = tl.where(bins < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_start = tl.sum(tl.where(bins < expert, padded, 0), axis=0)
    count = tl.sum(tl.where(bins == expert, counts, 0), axis=0)
    run_padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    if expert == 0:
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    if count > 0:
        first_block = run_start // BLOCK_M
        num_blocks = run_padded // BLOCK_M
        for b in range(0, num_blocks, CHUNK):
            offs_b = b + tl.arange(0, CHUNK)
            tl.store(block_expert_ptr + first_block + offs_b, tl.zeros([CHUNK], dtype=tl.int32) + expert,
                     mask=offs_b < num_blocks)
        seen = 0
        for start in range(0, num_pairs, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
            hit = (ids == expert).to(tl.int32)
            rank = seen + tl.cumsum(hit, axis=0) - 1
            tl.store(sorted_ptr + run_start + rank, offs, mask=hit > 0)
            seen += tl.sum(hit, axis=0)
        pad = count + tl.arange(0, BLOCK_M)
        tl.store(sorted_ptr + run_start + pad, tl.zeros([BLOCK_M], dtype=tl.int32) + num_pairs, mask=pad < run_padded)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    if DOT_F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        out = tl.dot(a.to(b.dtype), b, acc, input_precision="ieee")
    else:
        out = tl.dot(a.to(b.dtype), b, acc)
    return out


@triton.jit
def _activation(x, alpha, ACT: tl.constexpr):
    if ACT == 1:
        y = x * tl.sigmoid(x * alpha)
    elif ACT == 2:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 3:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        y = 0.5 * x * (2.0 * tl.sigmoid(2.0 * inner))  # 1 + tanh(z) = 2 * sigmoid(2z)
    else:
        y = x
    return y


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])  # they change with every step's rows
def _up_kernel(x_ptr, w_ptr, b_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
               num_pairs, top_k, n_out, k_dim, num_m_blocks,
               stride_xm, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_om,
               up_offset, alpha, gate_limit, act_limit, up_limit, up_shift,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
               INTERLEAVED: tl.constexpr,
               ACT: tl.constexpr, CLAMP: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
               DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    pid_m = pid % num_m_blocks
    pid_n = pid // num_m_blocks
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    token = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]
    w_base = w_ptr + expert * stride_we
    if INTERLEAVED:  # gate 2n, up 2n + 1: one contiguous [BLOCK_K, 2 BLOCK_N] tile, split in registers
        offs_2n = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        n2_ok = offs_2n < 2 * n_out
        w_ptrs = w_base + offs_2n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for kk in range(0, tl.cdiv(k_dim, BLOCK_K)):
            k_ok = offs_k < k_dim - kk * BLOCK_K
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot(x, tl.load(w_ptrs, mask=k_ok[:, None] & n2_ok[None, :], other=0.0), acc, IEEE, DOT_F32)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            bias = tl.load(b_ptr + expert * stride_be + offs_2n * stride_bn, mask=n2_ok, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        acc_g, acc_u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    else:  # gate rows, then up rows `up_offset` further (or no up rows)
        col = offs_n.to(tl.int64)
        g_ptrs = w_base + col[None, :] * stride_wn + offs_k[:, None] * stride_wk
        u_ptrs = g_ptrs + up_offset * stride_wn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, tl.cdiv(k_dim, BLOCK_K)):
            k_ok = offs_k < k_dim - kk * BLOCK_K
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            acc_g = _dot(x, tl.load(g_ptrs, mask=w_mask, other=0.0), acc_g, IEEE, DOT_F32)
            if GATED:
                acc_u = _dot(x, tl.load(u_ptrs, mask=w_mask, other=0.0), acc_u, IEEE, DOT_F32)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            b_ptrs = b_ptr + expert * stride_be + col * stride_bn
            acc_g += tl.load(b_ptrs, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(b_ptrs + up_offset * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        gate = acc_g
        if CLAMP:
            gate = tl.minimum(gate, gate_limit)
        act = _activation(gate, alpha, ACT)
        up = acc_u
        if CLAMP:
            act = tl.minimum(act, act_limit)
            up = tl.minimum(tl.maximum(up, -up_limit), up_limit) + up_shift
        out = act * up
    else:
        out = _activation(acc_g, alpha, ACT)
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _down_kernel(a_ptr, w_ptr, b_ptr, rw_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                 num_pairs, n_out, k_dim, num_m_blocks,
                 stride_am, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    pid_m = pid % num_m_blocks
    pid_n = pid // num_m_blocks
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    rows = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(k_dim, BLOCK_K)):
        k_ok = offs_k < k_dim - kk * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot(a, tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0), acc, IEEE, DOT_F32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + offs_n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(rw_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(partial_ptr, ids_ptr, out_ptr, top_k, hidden, num_experts, stride_pm, stride_om,
                    BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in range(0, top_k):
        pair = token * top_k + k
        expert = tl.load(ids_ptr + pair)
        valid = (expert >= 0) & (expert < num_experts)
        row = tl.load(partial_ptr + pair * stride_pm + offs, mask=ok, other=0.0).to(tl.float32)
        acc += tl.where(valid, row, 0.0)  # a dropped slot's row was never written
    tl.store(out_ptr + token * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ------------------------------------------------------------------------------------------------------ launchers
class Routing(NamedTuple):
    """The sorted layout of one call (see the module docstring); ``num_m_blocks`` is the grid's block count."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    num_m_blocks: int


def align(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """Sort the routing slots of ``top_k_index [T, K]`` (contiguous) by expert into runs padded to ``block_m``."""
    num_pairs = top_k_index.numel()
    size = (num_pairs + min(num_experts, num_pairs) * (block_m - 1) + block_m - 1) // block_m * block_m
    device = top_k_index.device
    sorted_pairs = torch.empty(size, dtype=torch.int32, device=device)
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    chunk = max(block_m, min(1024, triton.next_power_of_2(num_pairs)))
    _align_kernel[(num_experts,)](top_k_index, sorted_pairs, block_expert, num_padded, num_pairs, num_experts,
                                  BLOCK_M=block_m, BINS=triton.next_power_of_2(num_experts + 1), CHUNK=chunk)
    return Routing(sorted_pairs, block_expert, num_padded, block_m, size // block_m)


def _dot_flags(weight: torch.Tensor) -> dict:
    return {"IEEE": weight.dtype == torch.float32, "DOT_F32": not weight.is_cuda}


def experts_up(hidden: torch.Tensor, top_k_index: torch.Tensor, w_up: torch.Tensor, up_bias: torch.Tensor | None,
               activation: Activation, out_features: int, config: MoeConfig, routing: Routing | None = None
               ) -> torch.Tensor:
    """``[T*K, out_features]`` (weights' dtype), rows by slot: ``act(up_e(hidden[t]))``; dropped slots unwritten."""
    num_experts, up_rows, k_dim = w_up.shape
    top_k = top_k_index.shape[1]
    num_pairs = top_k_index.numel()
    routing = routing or align(top_k_index, num_experts, config.block_m)
    out = torch.empty(num_pairs, out_features, dtype=w_up.dtype, device=hidden.device)
    gated = activation.gated
    interleaved = gated and activation.interleaved
    block_n, block_k, warps, stages = config.up
    grid = (routing.num_m_blocks * triton.cdiv(out_features, block_n),)
    bias = up_bias if up_bias is not None else w_up
    _up_kernel[grid](
        hidden, w_up, bias, out, routing.sorted_pairs, routing.block_expert, routing.num_padded,
        num_pairs, top_k, out_features, k_dim, routing.num_m_blocks,
        hidden.stride(0), w_up.stride(0), w_up.stride(1), w_up.stride(2),
        bias.stride(0), bias.stride(-1), out.stride(0),
        up_rows // 2 if gated else 0, float(activation.alpha), float(activation.gate_limit), float(activation.act_limit),
        float(activation.up_limit), float(activation.up_shift),
        BLOCK_M=routing.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated, INTERLEAVED=interleaved,
        ACT=_ACT[activation.kind],
        CLAMP=gated and activation.clamped, HAS_BIAS=up_bias is not None, **_dot_flags(w_up),
        num_warps=warps, num_stages=stages)
    return out


def experts_down(inter: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w_down: torch.Tensor,
                 down_bias: torch.Tensor | None, out_dtype: torch.dtype, config: MoeConfig,
                 routing: Routing | None = None) -> torch.Tensor:
    """``[T, H]``: each token's weighted sum of its experts' down projections of ``inter [T*K, I]`` (rows by slot)."""
    num_experts, hidden, k_dim = w_down.shape
    tokens, top_k = top_k_index.shape
    num_pairs = top_k_index.numel()
    routing = routing or align(top_k_index, num_experts, config.block_m)
    partial = torch.empty(num_pairs, hidden, dtype=out_dtype, device=inter.device)
    block_n, block_k, warps, stages = config.down
    grid = (routing.num_m_blocks * triton.cdiv(hidden, block_n),)
    bias = down_bias if down_bias is not None else w_down
    _down_kernel[grid](
        inter, w_down, bias, top_k_weights, partial, routing.sorted_pairs, routing.block_expert, routing.num_padded,
        num_pairs, hidden, k_dim, routing.num_m_blocks,
        inter.stride(0), w_down.stride(0), w_down.stride(1), w_down.stride(2), bias.stride(0), bias.stride(-1),
        partial.stride(0),
        BLOCK_M=routing.block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=down_bias is not None,
        **_dot_flags(w_down), num_warps=warps, num_stages=stages)
    out = torch.empty(tokens, hidden, dtype=out_dtype, device=inter.device)
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(tokens, triton.cdiv(hidden, block_h))](partial, top_k_index, out, top_k, hidden, num_experts,
                                                           partial.stride(0), out.stride(0), BLOCK_H=block_h)
    return out


def fused_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w_up: torch.Tensor,
                  w_down: torch.Tensor, up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                  activation: Activation, config: MoeConfig | None = None) -> torch.Tensor:
    """The whole layer (see :func:`hf_paged.kernels.moe.fused_experts`): one alignment shared by both GEMMs."""
    num_experts, _, hidden_size = w_up.shape
    inter_size = w_down.shape[2]
    if config is None:
        config = choose_config(top_k_index.numel(), num_experts, hidden_size, inter_size, inter_size,
                               w_up.element_size())
    routing = align(top_k_index, num_experts, config.block_m)
    inter = experts_up(hidden, top_k_index, w_up, up_bias, activation, inter_size, config, routing)
    return experts_down(inter, top_k_index, top_k_weights, w_down, down_bias, hidden.dtype, config, routing)
