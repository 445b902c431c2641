"""Paged decode attention (one query token per sequence) in Triton.

* Reads K/V through the block table in place (no gather).
* GQA-grouped: one program handles the ``G = Hq // Hkv`` query heads sharing a KV head
  (padded to >= 16 rows for ``tl.dot``), so each KV tile is loaded once per group.
* Iterates ``BLOCK_N`` tokens per loop step (independent of the cache block size:
  each token's physical block is looked up in the block table).
* Split-K (flash-decoding): grid ``(num_splits, B, Hkv)``; with several splits each
  program writes its partial ``(acc, max, sum)`` to a float32 scratch and a small
  second kernel combines them, in split order (or, given split counters, the last run of a
  sequence to finish does); with one split the output is written directly, as it is, given split
  counters, for a sequence short enough for one run.
  Each sequence's *own* key range is cut into ``min(num_splits, ceil(keys / MIN_TOKENS_PER_SPLIT))``
  equal runs of whole tiles: only sequences longer than a run are split, whatever the batch. Why: in
  a ragged batch the kernel lasts as long as its longest program, and a long sequence read by one
  program per head (started wherever the grid order puts it) held the whole launch up after the
  short ones were done. The split index is the grid's fastest axis, so the runs of one sequence
  start together. Why the cut depends on the sequence alone and ``num_splits`` on the batch only
  through its power-of-two range: a graph step (batch padded to its bucket, tables at full width)
  and an eager step of the same sequences then cut every sequence identically and give
  bitwise-equal outputs.
* In launches of few programs at head dims up to 64, each tile's block ids are loaded during the tile before
  (`prefetches_table`), so a tile waits for one load (K) instead of two in a row (its table entries, then K).
* An FP8 cache (`triton_fp8`): each tile is converted to a 16-bit operand after its load (`triton_fp8.READ_MODE`
  says how); the program's KV head's key scale joins the logit scale and its value scale multiplies the accumulator
  once, after the loop.
* Keys outside ``[kv_start, seq_len)`` are masked in the loads (``other=0``), so padding
  slots holding garbage / NaN never reach the arithmetic. Empty ranges give zeros.

Imported lazily by :mod:`hf_paged.kernels` (needs triton).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .triton_attention_end import _combine_splits, _paged_decode_reduce_kernel, _write_output
from .triton_cache import scale_stride
from .triton_dims import _dim_mask, padded_dim
from .triton_fp8 import _abs_max, _fp8_end, _fp8_probs, _fp8_query, _fp8_tile, _query_scale, _to_cache, read_mode

_LOG2E = 1.4426950408889634

# Module-level overrides (tests / benchmarks). ``None`` means "use the heuristic".
FORCE_NUM_SPLITS: int | None = None
#: load each tile's block ids one tile ahead (see `_decode_program`) in launches of few programs with head dims up to
#: PREFETCH_MAX_DIM: there a tile's wait for its table entries, then for K, is most of a program's time. Graph-timed on
#: the H100 (benchmarks/results/h100_2026-11-27g; bitwise-equal outputs), loading ahead always (call 4) was 1-9 % faster
#: at d 64 with few programs, but 0.4-1.4 % slower at 128-256 rows of 8 KV heads, -1.2 to +4 % at d 128 and -3.5 to
#: +8 % at d 256; this rule (call 5) gains -1 to +8 % at 1-64 rows of llama-1b's heads, +1 to +10 % at 1-256 rows of
#: qwen2.5-0.5b's (2 KV heads). False: never (each tile loads its own, as before).
PREFETCH_TABLE = True
PREFETCH_MAX_PROGRAMS = 512  # batch (by its power of two) x KV heads
PREFETCH_MAX_DIM = 64

# Tuning table: head_dim -> (BLOCK_N, num_warps, num_stages). The d=64 / d=128 entries were
# checked by the H100 sweep in benchmarks/bench_decode_kernel.py (results in
# benchmarks/results/decode_kernel_h100.md): (64, 4, 2) was within ~1-3 % of the best swept
# configuration on all four benchmark shapes, so it stayed. Entries for 16 / 32 / 256 are untuned.
_CONFIGS = {
    16: (64, 4, 2),
    32: (64, 4, 2),
    64: (64, 4, 2),
    128: (64, 4, 2),
    256: (32, 4, 2),
    # multi-head latent attention's 576-wide latent (`checks.TRITON_MAX_WIDE_HEAD_DIM`): the default tile needs 297 KB
    # of shared memory; on the H200 (bf16, 16 query heads, 64 x 4096 keys) (32, 8, 2) took 0.376 ms, (64, 8, 1)
    # 0.382, (16, 4, 2) 0.398, (32, 4, 1) 3.49 (spills), all equal to the torch reference
    1024: (32, 8, 2),
}
# An FP8 cache's tiles: one warp a program, 32 keys a tile. Why: with the bf16 tile (4 warps, 64 keys) an FP8 step took
# about as long as a bf16 one. Nsight Compute (H200, B256-L2048, d 128): 148 registers a thread against 87, so 3
# programs an SM against 5, and 2.4 TB/s of its bytes against 4.3: latency-bound, few bytes in flight; one warp also
# keeps each tile's softmax rows in one warp (no reductions through shared memory). Graph-replayed on the H200
# (benchmarks/results/h200_2026-11-29g), (32, 1, 2) was the fastest FP8 tile of 15 swept (1-4 warps, 16-128 keys, 2-4
# stages) at every llama shape: 1.5-1.6x as fast as the bf16 cache at d 128 (B64-L2048 to B320-L3072), 1.3x at d 64;
# (32, 1, 3) at the Gemma-3 shape (d 256, one KV head, 1.4x). A bf16 cache keeps `_CONFIGS`: at 3.6-4.2 TB/s already,
# one warp gained 1-3 % there at d 64-128 and took 1.8x as long at d 256.
# Only for GQA groups of up to FP8_MAX_GROUP query heads (a 16-row tile): one warp would hold a wider group's
# accumulator alone (64 rows of d 128: 256 registers a thread), so those keep the bf16 tile.
_FP8_CONFIGS = {16: (32, 1, 2), 32: (32, 1, 2), 64: (32, 1, 2), 128: (32, 1, 2), 256: (32, 1, 3)}
FP8_MAX_GROUP = 16


def launch_config(head_dim: int, quantized: bool = False, group: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of a default launch at `head_dim` with `group` query heads per KV head, over a
    bf16/fp16/fp32 cache or (`quantized`) an FP8 one."""
    table = _FP8_CONFIGS if quantized and group <= FP8_MAX_GROUP else _CONFIGS
    return table.get(padded_dim(head_dim), _CONFIGS.get(padded_dim(head_dim), (64, 4, 2)))

# Split-K heuristic parameters. A sequence is cut into runs of at least MIN_TOKENS_PER_SPLIT keys, at most
# `num_splits` of them; `num_splits` is SPLIT_PROGRAMS_PER_SM * SMs over the batch's B * Hkv programs (B by its
# power of two), as a power of two in [MIN_SPLITS, MAX_SPLITS]; no split at all when B * Hkv reaches
# NO_SPLIT_PROGRAMS_PER_SM per SM. Graph-timed on the H100 (16 layers' caches, new K/V written, split counters) at
# the lengths of a ShareGPT-like llama-1b run as it drains (256 to 24 rows), a uniform Qwen3-shape run (d 128,
# 256 to 8 rows), MHA d 128, d 256 and 4 long rows (benchmarks/results/h100_2026-11-26c/, call 03): within 0-3 % of
# the best split setting swept for this tile (runs of 128 / 256 / 512 keys, 1-16 splits) on 12 of the 14 shapes
# (6 % and 4.5 % off on two), 1-17 % faster than the earlier rule (no split from 4 programs per SM, 128-key runs) on
# 13 of them, 2 % slower on a 256-row batch of long d-128 contexts.
NO_SPLIT_PROGRAMS_PER_SM = 32
SPLIT_PROGRAMS_PER_SM = 32
MIN_TOKENS_PER_SPLIT = 256
MIN_SPLITS = 4
MAX_SPLITS = 64


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # interpreter: no point in splitting
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return num_sms(idx)


def _grid_programs(batch: int, num_kv_heads: int) -> int:
    """(sequence, KV head) programs per split that the launch rules count: the batch by its power of two, so that a
    graph step (batch padded to its bucket) and an eager step of the same sequences choose alike."""
    return triton.next_power_of_2(max(batch, 1)) * num_kv_heads


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, block_n: int, device) -> int:
    """Heuristic number of KV splits (the grid's; a sequence uses those its own keys fill), from Python ints only
    (no device sync).

    The batch counts by its power of two: every power of two is a CUDA-graph bucket (`hf_paged.runner`), so a
    graph step and an eager step of the same sequences choose the same count (see the module docstring). The cap
    by `max_context` cannot change a sequence's cut: its own key count is at most `max_context`. The interpreter
    (no SMs to fill) never splits unless told to.
    """
    device = torch.device(device)
    programs = _grid_programs(batch, num_kv_heads)
    sms = _device_sms(device)
    if device.type != "cuda" or programs >= NO_SPLIT_PROGRAMS_PER_SM * sms or max_context <= MIN_TOKENS_PER_SPLIT:
        return 1
    splits = triton.next_power_of_2(triton.cdiv(SPLIT_PROGRAMS_PER_SM * sms, programs))
    splits = max(MIN_SPLITS, min(splits, MAX_SPLITS))
    splits = min(splits, triton.cdiv(max_context, MIN_TOKENS_PER_SPLIT), triton.cdiv(max_context, block_n))
    return max(1, splits)


def default_num_splits(batch: int, num_kv_heads: int, head_dim: int, max_context: int, device) -> int:
    """The split count `paged_decode` picks when not told (the forced `FORCE_NUM_SPLITS` included)."""
    # the heuristic's runs (>= MIN_TOKENS_PER_SPLIT keys) are longer than any tile, so the FP8 tile chooses alike
    block_n = launch_config(head_dim)[0]
    return _launch_splits(FORCE_NUM_SPLITS, batch, num_kv_heads, max_context, block_n, device)


def _launch_splits(num_splits: int | None, batch: int, num_kv_heads: int, max_context: int, block_n: int,
                   device) -> int:
    """The split count a launch uses: `num_splits` when given (or forced), else the heuristic's; clamped."""
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, block_n, device)
    return _clamp_splits(num_splits, max_context, block_n)


def prefetches_table(batch: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether a launch over `batch` sequences loads block ids one tile ahead (`PREFETCH_TABLE`). The batch counts
    by its power of two, as for the split count; either way gives the same bits."""
    return (PREFETCH_TABLE and padded_dim(head_dim) <= PREFETCH_MAX_DIM
            and _grid_programs(batch, num_kv_heads) <= PREFETCH_MAX_PROGRAMS)


def launch_variant(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int,
                   max_context: int, device) -> tuple:
    """A key equal for two default launches that run the same compiled kernels: whether the keys are split, whether
    block ids are loaded a tile ahead (`prefetches_table`), and how Triton specialises the integer arguments that
    depend on the split count (an int equal to 1 or divisible by 16 gets a variant of its own). It mirrors Triton's
    rule: were the rule to change, a warm-up that ran one batch per key would leave a variant to compile at its first
    launch, which costs time, never a wrong result."""
    splits = default_num_splits(batch, num_kv_heads, head_dim, max_context, device)
    ahead = prefetches_table(batch, num_kv_heads, head_dim)
    if splits == 1:
        return (False, ahead)
    ints = (num_q_heads * splits * head_dim_v, splits * head_dim_v, num_q_heads * splits, splits)
    return (True, ahead) + tuple((v == 1, v % 16 == 0) for v in ints)


def _clamp_splits(splits: int, max_context: int, block_n: int) -> int:
    """At least one split, and no more than the tables have tiles."""
    return max(1, min(int(splits), max(1, triton.cdiv(max_context, block_n))))


# The table stride varies with the batch's longest context (eager decode steps): not specialised, so a new width
# never compiles a new variant mid-serving (see triton_prefill).
@triton.jit(do_not_specialize=["stride_btb"])
def _paged_decode_kernel(
        Q, KC, VC, BT, SEQ, KVS, OUT, PACC, PM, PL, SINK, ALIBI, KNEW, VNEW, SLOT, CNT, KS, VS, qk_scale, sm_scale,
        softcap, window, chunk, stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_btb, stride_ob, stride_oh, stride_pab, stride_pah, stride_pas, stride_pmb, stride_pmh, stride_knb,
        stride_knh, stride_vnb, stride_vnh, stride_s, G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_V: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr, HAS_KV_START: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_ALIBI: tl.constexpr, SPLIT: tl.constexpr,
        MIN_SPLIT: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr, WRITE: tl.constexpr,
        FUSE_REDUCE: tl.constexpr, PREFETCH_TABLE: tl.constexpr, QUANT: tl.constexpr, SOFT_FP8: tl.constexpr,
        READ: tl.constexpr, V_TRANS: tl.constexpr):
    sp = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)

    seq_len = tl.load(SEQ + b).to(tl.int32)
    if HAS_KV_START:
        kv_lo = tl.load(KVS + b).to(tl.int32)
    else:
        kv_lo = 0
    # the query sits at seq_len - 1: a window / chunk only raises the first key, so blocks before it are never read
    if HAS_WINDOW:
        kv_lo = tl.maximum(kv_lo, seq_len - window)
    if HAS_CHUNK:
        kv_lo = kv_lo + (tl.maximum(seq_len - 1 - kv_lo, 0) // chunk) * chunk
    lo = kv_lo
    hi = seq_len
    parts = 1
    if SPLIT:
        # this sequence's own keys, in whole tiles, over as many splits as it has MIN_SPLIT-token runs (at most the
        # grid's): a function of the sequence and the split count only (path-invariant, see the module docstring)
        base = (kv_lo // BLOCK_N) * BLOCK_N
        span = tl.maximum(seq_len - base, 0)
        parts = tl.maximum(tl.minimum(tl.num_programs(0), tl.cdiv(span, MIN_SPLIT)), 1)
        per = tl.cdiv(tl.cdiv(span, parts), BLOCK_N) * BLOCK_N
        lo = tl.maximum(kv_lo, base + sp * per)
        hi = tl.minimum(seq_len, base + (sp + 1) * per)
    # a fused combine reads only the splits the sequence uses: the grid's others have nothing to do (most of the
    # grid in a batch of short sequences); the combine kernel reads every split, so they write empty partials for it
    active = sp < parts
    if not FUSE_REDUCE:
        active = sp >= 0
    if QUANT:  # an FP8 cache: this KV head's scales (one per head, or one for all: stride 0)
        ks = tl.load(KS + kvh * stride_s)
        vs = tl.load(VS + kvh * stride_s)
    else:
        ks = 1.0
        vs = 1.0
    if active:
        _decode_program(Q, KC, VC, BT, OUT, PACC, PM, PL, SINK, ALIBI, KNEW, VNEW, SLOT, CNT, ks, vs, qk_scale,
                        sm_scale, softcap, stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh,
                        stride_vt, stride_btb, stride_ob, stride_oh, stride_pab, stride_pah, stride_pas, stride_pmb,
                        stride_pmh, stride_knb, stride_knh, stride_vnb, stride_vnh, sp, b, kvh, seq_len, kv_lo, lo, hi,
                        parts, G, G_PAD, HEAD_DIM, HEAD_DIM_V, D_PAD, DV_PAD, BLOCK_SIZE, BLOCK_N, HAS_SOFTCAP,
                        HAS_SINKS, HAS_ALIBI, SPLIT, IEEE, DOT_F32, WRITE, FUSE_REDUCE, PREFETCH_TABLE, QUANT, SOFT_FP8,
                        READ, V_TRANS)


@triton.jit
def _decode_program(Q, KC, VC, BT, OUT, PACC, PM, PL, SINK, ALIBI, KNEW, VNEW, SLOT, CNT, ks, vs, qk_scale, sm_scale,
                    softcap, stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                    stride_btb, stride_ob, stride_oh, stride_pab, stride_pah, stride_pas, stride_pmb, stride_pmh,
                    stride_knb, stride_knh, stride_vnb, stride_vnh, sp, b, kvh, seq_len, kv_lo, lo, hi, parts,
                    G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                    D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_ALIBI: tl.constexpr, SPLIT: tl.constexpr,
                    IEEE: tl.constexpr, DOT_F32: tl.constexpr, WRITE: tl.constexpr, FUSE_REDUCE: tl.constexpr,
                    PREFETCH_TABLE: tl.constexpr, QUANT: tl.constexpr, SOFT_FP8: tl.constexpr, READ: tl.constexpr,
                    V_TRANS: tl.constexpr):
    """One program of `_paged_decode_kernel`: keys [lo, hi) of sequence `b`, KV head `kvh`, split `sp`; `ks` / `vs`
    the KV head's scales of an FP8 cache (`QUANT`), its tiles read as `READ` / `V_TRANS` say
    (`triton_fp8.read_mode`)."""
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)  # a head dim that is no power of two is padded, its extra lanes masked
    offs_dv = tl.arange(0, DV_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    head = kvh * G + offs_g
    gmask = offs_g < G

    b64 = b.to(tl.int64)
    q = tl.load(Q + b64 * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=_dim_mask(gmask[:, None], offs_d[None, :], HEAD_DIM, D_PAD), other=0.0)

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, DV_PAD], dtype=tl.float32)
    if HAS_ALIBI:  # ALiBi slopes in base 2: the logits are scaled by log2(e) below
        slope = tl.load(ALIBI + head, mask=gmask, other=0.0).to(tl.float32) * 1.4426950408889634

    bt_row = BT + b64 * stride_btb
    k_base = KC + kvh.to(tl.int64) * stride_kh
    v_base = VC + kvh.to(tl.int64) * stride_vh
    if WRITE:
        # the step's own key/value (position seq_len - 1) go to the row's slot first, written by the one program that
        # reads that position (split 0 when no program does, e.g. a range that ends before it); a CTA barrier makes
        # the store visible to the program's other threads before the loop loads the tile holding it
        new_pos = seq_len - 1
        owner = ((new_pos >= lo) & (new_pos < hi)) | ((sp == 0) & (new_pos < kv_lo))
        slot = tl.load(SLOT + b).to(tl.int64)
        if owner & (slot >= 0):
            blk_new = slot // BLOCK_SIZE
            off_new = slot % BLOCK_SIZE
            dm, dvm = offs_d < HEAD_DIM, offs_dv < HEAD_DIM_V
            k_new = tl.load(KNEW + b64 * stride_knb + kvh * stride_knh + offs_d, mask=dm)
            v_new = tl.load(VNEW + b64 * stride_vnb + kvh * stride_vnh + offs_dv, mask=dvm)
            tl.store(k_base + blk_new * stride_kb + off_new * stride_kt + offs_d,
                     _to_cache(k_new, ks, QUANT, SOFT_FP8, KC.dtype.element_ty), mask=dm)
            tl.store(v_base + blk_new * stride_vb + off_new * stride_vt + offs_dv,
                     _to_cache(v_new, vs, QUANT, SOFT_FP8, VC.dtype.element_ty), mask=dvm)
        tl.debug_barrier()
    if QUANT:  # q . (k * ks) = ks * (q . k): the key scale joins the logit scale (with the read's factor, `triton_fp8`)
        q_mul, k_fac = _query_scale(_abs_max(q), READ)
        q = _fp8_query(q, q_mul, READ)
        qk_scale = qk_scale * ks * k_fac
        sm_scale = sm_scale * ks * k_fac
    start = (lo // BLOCK_N) * BLOCK_N
    if PREFETCH_TABLE:
        tok = start + offs_n
        blk_next = tl.load(bt_row + tok // BLOCK_SIZE, mask=(tok >= lo) & (tok < hi), other=0)
    for t0 in range(start, hi, BLOCK_N):
        tok = t0 + offs_n
        valid = (tok >= lo) & (tok < hi)
        if PREFETCH_TABLE:
            # this tile's block ids were loaded during the tile before; the next tile's go out now, so a tile waits
            # for one load (K) instead of two in a row (its table entries, then K)
            blk = blk_next.to(tl.int64)
            tok_next = tok + BLOCK_N  # always past `lo`
            blk_next = tl.load(bt_row + tok_next // BLOCK_SIZE, mask=tok_next < hi, other=0)
        else:
            blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        off = tok % BLOCK_SIZE
        # K tile loaded transposed: [D_PAD, BLOCK_N]
        k = _fp8_tile(tl.load(  # an FP8 cache's tile as `READ` says (exact); else the query's dtype already
            k_base + blk[None, :] * stride_kb + off[None, :] * stride_kt + offs_d[:, None],
            mask=_dim_mask(valid[None, :], offs_d[:, None], HEAD_DIM, D_PAD), other=0.0), READ, Q.dtype.element_ty)
        if DOT_F32:  # interpreter: no bf16 dot there, emulate with float32 operands
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        elif IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        if HAS_SOFTCAP:  # cap the scaled logits (natural units), then go to base 2
            x = s * sm_scale / softcap
            s = softcap * (1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)) * 1.4426950408889634
        else:
            s = s * qk_scale
        if HAS_ALIBI:  # slope * (key - query), the query at seq_len - 1
            s += slope[:, None] * (tok - seq_len + 1).to(tl.float32)[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = _fp8_probs(s, m_use, READ)  # exp2(s - m), scaled for a "bits" read
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_TRANS:  # loaded [DV_PAD, BLOCK_N] and transposed: converted before shared memory (`triton_fp8`)
            v = tl.trans(_fp8_tile(tl.load(
                v_base + blk[None, :] * stride_vb + off[None, :] * stride_vt + offs_dv[:, None],
                mask=_dim_mask(valid[None, :], offs_dv[:, None], HEAD_DIM_V, DV_PAD), other=0.0), READ,
                Q.dtype.element_ty))
        else:
            v = _fp8_tile(tl.load(
                v_base + blk[:, None] * stride_vb + off[:, None] * stride_vt + offs_dv[None, :],
                mask=_dim_mask(valid[:, None], offs_dv[None, :], HEAD_DIM_V, DV_PAD), other=0.0), READ,
                Q.dtype.element_ty)
        if DOT_F32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        elif IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if QUANT:  # sum p (v * vs) = vs * sum p v (and the read's factors)
        acc, l_i = _fp8_end(acc, l_i, vs, READ)

    # a sequence the fused combine would combine from one split alone is written directly, like an unsplit launch
    # writes it: no partials to store and read back, no counter (most sequences of a large batch of short contexts)
    direct = not SPLIT
    if SPLIT and FUSE_REDUCE:
        direct = parts == 1
    if direct:
        _write_output(acc, m_i, l_i, SINK, OUT, b64, head, gmask, offs_dv, stride_ob, stride_oh, HAS_SINKS,
                      HEAD_DIM_V, DV_PAD)
    else:
        pa = PACC + b64 * stride_pab + head[:, None] * stride_pah + sp * stride_pas + offs_dv[None, :]
        tl.store(pa, acc, mask=_dim_mask(gmask[:, None], offs_dv[None, :], HEAD_DIM_V, DV_PAD))
        pm = b64 * stride_pmb + head * stride_pmh + sp
        tl.store(PM + pm, m_i, mask=gmask)
        tl.store(PL + pm, l_i, mask=gmask)
        if FUSE_REDUCE:
            # the last split of (sequence, KV head) to finish combines the partials, so no second kernel is launched:
            # every thread's stores are done (barrier) before the counter is bumped (release); the last one reads
            # them after its acquire, past L1 (`_combine_splits`), and resets the counter for the next launch
            tl.debug_barrier()
            counter = CNT + b * tl.num_programs(2) + kvh
            ticket = tl.atomic_add(counter, 1, sem="acq_rel")
            if ticket == parts - 1:  # the sequence's last split to finish (a split past `parts` never ran)
                _combine_splits(PACC, PM, PL, SINK, OUT, b64, head, gmask, parts, stride_pab, stride_pah,
                                stride_pas, stride_pmb, stride_pmh, stride_ob, stride_oh, HEAD_DIM_V, HAS_SINKS,
                                DV_PAD)
                tl.atomic_xchg(counter, 0)


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_start: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_context: int | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    split_counters: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the decode kernel(s). Inputs are assumed validated (see ``hf_paged.kernels``).

    `new_kv = (key, value, slot_mapping)`: the step's own K/V ``[B, Hkv, D]``, written at the slots by the decode
    kernel itself (and attended at position ``seq_lens - 1``). `split_counters`: int32 zeros, ``>= B * Hkv``; when
    given, the split partials are combined inside the decode kernel (the counters are left at zero)."""
    B, Hq, D = query.shape
    _, Hkv, bs, _ = key_cache.shape
    Dv = value_cache.shape[-1]
    G = Hq // Hkv
    if out is None:
        out = query.new_empty(B, Hq, Dv)
    if B == 0:
        return out
    cfg_n, cfg_w, cfg_s = launch_config(D, k_scale is not None, G)
    block_n = block_n or cfg_n
    num_warps = num_warps or cfg_w
    num_stages = num_stages or cfg_s
    if max_context is None:
        max_context = block_tables.shape[1] * bs
    if num_splits is None:
        num_splits = FORCE_NUM_SPLITS
    # a forced count (tests, sweeps) cuts even short sequences into one-tile runs; the heuristic's runs are longer
    min_split = block_n if num_splits is not None else MIN_TOKENS_PER_SPLIT
    num_splits = _launch_splits(num_splits, B, Hkv, max_context, block_n, query.device)

    g_pad = max(16, triton.next_power_of_2(G))
    ieee = query.dtype == torch.float32
    has_kv_start = kv_start is not None
    kvs = kv_start if has_kv_start else seq_lens

    fuse_reduce = num_splits > 1 and split_counters is not None  # its size is checked by `kernels._decode`
    if new_kv is not None:
        k_new, v_new, slots = new_kv
        new_strides = (k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1))
    else:
        k_new = v_new = slots = query  # unused
        new_strides = (0, 0, 0, 0)
    if num_splits > 1:
        pacc = torch.empty(B, Hq, num_splits, Dv, device=query.device, dtype=torch.float32)
        pm = torch.empty(B, Hq, num_splits, device=query.device, dtype=torch.float32)
        pl = torch.empty_like(pm)
        pstrides = (pacc.stride(0), pacc.stride(1), pacc.stride(2), pm.stride(0), pm.stride(1))
    else:
        pacc = pm = pl = out  # unused
        pstrides = (0, 0, 0, 0, 0)

    read, v_trans = read_mode(query.dtype, k_scale is not None, query.is_cuda)
    _paged_decode_kernel[(num_splits, B, Hkv)](
        query, key_cache, value_cache, block_tables, seq_lens, kvs, out, pacc, pm, pl,
        sinks if sinks is not None else out, alibi_slopes if alibi_slopes is not None else out,
        k_new, v_new, slots, split_counters if fuse_reduce else seq_lens,
        k_scale if k_scale is not None else seq_lens, v_scale if v_scale is not None else seq_lens,
        float(scale) * _LOG2E, float(scale), float(softcap) if softcap is not None else 1.0,
        int(sliding_window) if sliding_window is not None else 0, int(chunk_size) if chunk_size is not None else 1,
        query.stride(0), query.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1), *pstrides, *new_strides, scale_stride(k_scale),
        G=G,
        G_PAD=g_pad,
        HEAD_DIM=D,
        HEAD_DIM_V=Dv,
        D_PAD=padded_dim(D),
        DV_PAD=padded_dim(Dv),
        BLOCK_SIZE=bs,
        BLOCK_N=block_n,
        HAS_KV_START=has_kv_start,
        HAS_WINDOW=sliding_window is not None,
        HAS_CHUNK=chunk_size is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        HAS_ALIBI=alibi_slopes is not None,
        SPLIT=num_splits > 1,
        MIN_SPLIT=min_split,
        IEEE=ieee,
        DOT_F32=not query.is_cuda,
        WRITE=new_kv is not None,
        FUSE_REDUCE=fuse_reduce,
        PREFETCH_TABLE=prefetches_table(B, Hkv, D),
        QUANT=k_scale is not None,
        SOFT_FP8=k_scale is not None and not query.is_cuda,
        READ=read,
        V_TRANS=v_trans,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1 and not fuse_reduce:
        _paged_decode_reduce_kernel[(B, Hkv)](
            pacc,
            pm,
            pl,
            sinks if sinks is not None else out,
            out,
            num_splits,
            *pstrides,
            out.stride(0),
            out.stride(1),
            G=G,
            G_PAD=triton.next_power_of_2(G),
            HEAD_DIM=Dv,
            HAS_SINKS=sinks is not None,
            D_PAD=padded_dim(Dv),
            num_warps=4 if D >= 128 else 2,
        )
    return out
