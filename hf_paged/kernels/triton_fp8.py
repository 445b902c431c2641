"""FP8 (e4m3fn) KV storage in the Triton kernels: how a value is stored, and where the scales go when it is read.

A quantised cache stores ``clamp(x / scale, -448, 448)`` rounded to the nearest e4m3 value, ties to even: what torch's
``.to(torch.float8_e4m3fn)`` gives for the clamped value (`hf_paged.kernels.reference`), so the two backends write the
same bytes. On CUDA the cast is the hardware's (``tl.float8e4nv``: round to nearest even, saturating). Triton's
interpreter converts float32 to fp8 wrongly when rounding carries into the exponent (7.99 became 4.0 in Triton 3.9)
and rounds ties up, so under the interpreter the bits are computed with integer arithmetic instead (`_e4m3_bits`,
checked against torch over every tie and random values in `tests/test_kv_fp8.py`); reading fp8 back is exact there.

Reading: the attention kernels convert an fp8 tile into a 16-bit operand of their dots and apply the scales outside
the products, in float32: the key scale multiplies the logit scale (``q . (k * s) = s * (q . k)``) and the value scale
the accumulated output, once per program (one KV head each, so a scale per KV head costs nothing more than one per
layer). How the decode kernels (`triton_decode`, `triton_decode_wide`; prefill always casts) make a tile an operand
is `READ_MODE` (env ``HF_PAGED_FP8_READ``), a compile-time choice for bfloat16 queries (`read_mode`: float16 queries
take the short path already, float32 ones keep "cast", their dots IEEE float32). Why: replayed from CUDA graphs on an
H200 the decode kernel took as long over an FP8 cache as over a bf16 one (1.5-2.0 TB/s of its bytes), bound by the
per-element work, not the bytes. Compiled for sm90 (Triton 3.9, on the CPU), a 64-key tile of the d-128 GQA-4 loop
is, per thread, 553 SASS instructions over a bf16 cache, 907 "cast", 715 "fp16", 940 "bits", 870 "bits_asm" (881,
686, 1065, 869 with "_t"); of these, conversions (F2F / F2FP: 16 a clock per SM by the CUDA guide's throughput
table, against 64-128 for integer and float ops) are 1.5 an element for "cast", 0.5 for "fp16", none for "bits" /
"bits_asm". At 1.5 an element a 256 x 2k llama-8b step's conversions alone would take about as long as a bf16
cache's bytes (~0.4 ms on an H200), consistent with the measurement (an estimate; the GPU benchmark,
``bench_decode_kernel.py --fp8-read-modes``, decided: "fp16", the default, was the fastest at every shape, though
still short of reading the half-size cache in half the time). The larger cause proved to be the launch tile: Nsight
Compute found the 4-warp, 64-key tile held to 3 programs an SM by its registers (latency-bound at 2.4 TB/s); with
one warp and 32 keys (`triton_decode._FP8_CONFIGS`) the "fp16" read runs 1.3-1.6x as fast as the bf16 cache, and
still leads the modes there (H200: 1.58-1.60x at llama-8b shapes against 1.10-1.33 "bits", 1.20-1.27 "bits_asm",
0.98-1.12 "cast"). The modes:

* ``"cast"``: the tile converted to the query's dtype (exact: every e4m3 value is a bf16, an fp16 and a float32). On
  sm90 that is ``cvt.rn.f16x2.e4m3x2`` per pair, then an fp16 -> bf16 conversion per element.
* ``"fp16"``: the tile converted to float16 (the pair conversion alone, exact), both dots in float16 (float32
  accumulation): the query converted once per program, ``p`` (in [0, 1]) in float16, 3 bits more precise than
  bfloat16. bf16 -> fp16 is exact only in fp16's normal range, so the query is first multiplied by a power of two
  that brings its largest magnitude (over the program's rows) into [2^14, 2^15) (`_query_scale`), and the logit
  scale divided by it: no value overflows (fp16's largest is 65,504), and an element is rounded only if it is below
  2^-29 of that largest (fp16's subnormals), a part of the logits under float32's own rounding.
* ``"cast_t"``, ``"fp16_t"``, ``"bits_t"``, ``"bits_asm_t"``: the same conversion with the value tile loaded
  ``[D, BLOCK_N]`` and transposed (`tl.trans`). Loaded as ``[BLOCK_N, D]``, Triton keeps it fp8 in shared memory and
  converts it in the dot's operand layout, which it reads one byte a load (64 ``LDS.U8`` a thread a tile: the operand
  runs along the keys, the bytes along D, and ``ldmatrix`` transposes only 16-bit elements); transposed, it is
  converted in registers and goes through shared memory in 16 bits (``ldmatrix.trans``), fewer shared-memory
  instructions for more register shuffles. The wide kernel ignores "_t".
* ``"bits"``: the e4m3 byte ``x`` becomes bf16 bits ``(sign_extend(x) << 4) & 0x87F0`` (sign to bit 15, exponent
  and mantissa moved up 4 bits): exactly ``value * 2^-120``, subnormals included (e4m3's map onto bf16's; checked
  over all 256 bytes in `tests/test_kv_fp8_read.py`), integer ops instead of conversions. The factors stay out of
  float32's subnormal range: the query is multiplied by 2^64 (exact for |q| < 2^64) and the logit scale by 2^56;
  ``p`` by 2^64 (``exp2(s - (m - 64))``, free), the sum of ``p`` by 2^-64 after the loop and the output by 2^56. An
  e4m3 subnormal (|x| < 2^-6, of at most 448) is a bf16 subnormal: should a tensor core flush it (the interpreter's
  bf16 -> float32 conversion does), it reads as zero, an error below the quantisation of 2^-6.
* ``"bits_asm"``: "bits" two elements to a 32-bit instruction (`_BITS_ASM`: a byte permute, a shift, a mask per
  pair; LLVM's code for "bits" works a byte at a time). CUDA only: "bits" elsewhere (the interpreter runs no PTX).

Imported lazily with the kernels (needs triton).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["FP8_MAX", "READ_MODE", "READ_MODES", "_fp8_end", "_fp8_probs", "_fp8_query", "_fp8_tile", "_to_cache",
           "read_mode"]

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_CONVERSIONS = ("cast", "fp16", "bits", "bits_asm")
READ_MODES = _CONVERSIONS + tuple(f"{m}_t" for m in _CONVERSIONS)  # "_t": the value tile loaded transposed
#: how the decode kernels read an fp8 tile (see the module docstring): "fp16", the fastest at every llama-8b shape on
#: an H200 (1.05-1.13x the bf16 cache's time against 0.93-0.97x for "cast"; "bits_asm" 1.03-1.09x, "bits" 1.01-1.07x,
#: the transposed-value variants slower; `benchmarks/results/h200_2026-11-29f`) and the most precise
READ_MODE = os.environ.get("HF_PAGED_FP8_READ", "").strip().lower() or "fp16"
_BITS_Q = tl.constexpr(2.0**64)  # "bits": the query's and p's multiplier
_BITS_LOGIT = tl.constexpr(2.0**56)  # 2^120 / 2^64: the logit scale's and the output's factor
_BITS_SUM = tl.constexpr(2.0**-64)
# "bits_asm": four e4m3 bytes ($2) to four bf16 ($0: elements 0-1, $1: 2-3), each pair a byte permute that
# sign-extends them into the halves of a word, a shift by 4 and a mask that keeps the sign bit 15 and bits 4-10
_BITS_ASM = tl.constexpr(
    "{\n"
    "prmt.b32 $0, $2, 0, 0x9180;\n"
    "prmt.b32 $1, $2, 0, 0xB3A2;\n"
    "shl.b32 $0, $0, 4;\n"
    "shl.b32 $1, $1, 4;\n"
    "and.b32 $0, $0, 0x87F087F0;\n"
    "and.b32 $1, $1, 0x87F087F0;\n"
    "}")


def read_mode(query_dtype: torch.dtype, quantized: bool, cuda: bool = True) -> tuple[str, bool]:
    """What a decode launch compiles of `READ_MODE`: the conversion (the kernels' ``READ``) and whether the value
    tile is loaded transposed (``V_TRANS``). "cast" and untransposed for a cache of the query's own type and for
    queries other than bfloat16 (see the module docstring); "bits_asm" is "bits" off CUDA (the interpreter runs no
    PTX). A ValueError names an unknown mode."""
    if READ_MODE not in READ_MODES:
        raise ValueError(f"triton_fp8.READ_MODE (HF_PAGED_FP8_READ) must be one of {READ_MODES}, not {READ_MODE!r}")
    if not quantized or query_dtype != torch.bfloat16:
        return "cast", False
    conversion = READ_MODE.removesuffix("_t")
    return "bits" if conversion == "bits_asm" and not cuda else conversion, READ_MODE.endswith("_t")


@triton.jit
def _e4m3_bits(x):
    """The float8_e4m3fn bits (int32, 0-255) of float32 `x` in [-448, 448], rounded to nearest even, by integer
    arithmetic (the interpreter's own conversion is wrong, see the module docstring)."""
    xi = x.to(tl.int32, bitcast=True)
    sign = (xi >> 24) & 0x80
    a = xi & 0x7FFFFFFF
    # a normal e4m3 (|x| >= 2^-6): keep 3 mantissa bits, rounding to nearest even; a carry moves into the exponent
    rounded = a + 0x7FFFF + ((a >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)  # rebias the exponent: 127 - 7 = 120
    # a subnormal one: k * 2^-9, k = round_half_even(|x| * 512) in 0..8 (8 encodes 2^-6, the smallest normal)
    y = tl.abs(x) * 512.0
    k = y.to(tl.int32)
    frac = y - k.to(tl.float32)
    k = k + ((frac > 0.5) | ((frac == 0.5) & ((k & 1) == 1))).to(tl.int32)
    return sign | tl.where((a >> 23) >= 121, normal, k)


@triton.jit
def _to_cache(x, scale, QUANT: tl.constexpr, SOFT_FP8: tl.constexpr, OUT_TY: tl.constexpr):
    """`x` as a cache of element type `OUT_TY` stores it: cast, or (`QUANT`) divided by `scale` (float32, broadcast),
    clamped to the e4m3 range and rounded (`SOFT_FP8`: by `_e4m3_bits`, under the interpreter)."""
    if QUANT:
        x = tl.math.div_rn(x.to(tl.float32), scale)
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        if SOFT_FP8:
            return _e4m3_bits(x).to(tl.uint8).to(OUT_TY, bitcast=True)
    return x.to(OUT_TY)


@triton.jit
def _abs_max(x):
    """max |x| over a 2-D tile, in float32 (a scalar)."""
    return tl.max(tl.max(tl.abs(x.to(tl.float32)), 1), 0)


@triton.jit
def _query_scale(qmax, READ: tl.constexpr):
    """(query multiplier, logit factor) of a read mode, float32 powers of two: the query is multiplied by the first
    before its dots, the logit scale by the second (for "fp16", `qmax` = the query's largest magnitude brought into
    [2^14, 2^15); the exponent clamped so both stay normal floats: an all-zero query gets 2^124)."""
    if READ == "fp16":
        e = ((qmax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(qmax)) for a normal qmax
        e = tl.minimum(tl.maximum(e, -110), 127)
        return ((141 - e) << 23).to(tl.float32, bitcast=True), ((113 + e) << 23).to(tl.float32, bitcast=True)
    elif READ == "bits" or READ == "bits_asm":
        return _BITS_Q, _BITS_LOGIT
    else:
        return 1.0, 1.0


@triton.jit
def _fp8_query(q, mul, READ: tl.constexpr):
    """The query tile as the dots' operand: times `mul` (`_query_scale`; exact) in float16 ("fp16") or bfloat16
    ("bits"); as it is for "cast"."""
    if READ == "fp16":
        return (q.to(tl.float32) * mul).to(tl.float16)
    elif READ == "bits" or READ == "bits_asm":
        return (q.to(tl.float32) * mul).to(tl.bfloat16)
    else:
        return q


@triton.jit
def _fp8_tile(x, READ: tl.constexpr, TY: tl.constexpr):
    """A loaded cache tile as a dot operand: converted to `TY` (the query's dtype: "cast", or a cache of that type
    already), to float16 ("fp16"), or its e4m3 bits moved into bfloat16 ones, ``value * 2^-120`` ("bits")."""
    if READ == "fp16":
        return x.to(tl.float16)
    elif READ == "bits":
        bits = (x.to(tl.int8, bitcast=True).to(tl.int32) << 4) & 0x87F0  # sign extended: bit 15 kept, 11-14 cleared
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif READ == "bits_asm":  # the same bits, two elements a 32-bit op (CUDA only)
        bits = tl.inline_asm_elementwise(_BITS_ASM, "=r,=r,r", [x.to(tl.int8, bitcast=True)], dtype=tl.int16,
                                         is_pure=True, pack=4)
        return bits.to(tl.bfloat16, bitcast=True)
    else:
        return x.to(TY)


@triton.jit
def _fp8_probs(s, m, READ: tl.constexpr):
    """``exp2(s - m)`` over rows (`m` per row); for "bits" times 2^64, so that ``p * v * 2^-120`` stays a normal
    float32 (undone by `_fp8_end`)."""
    if READ == "bits" or READ == "bits_asm":
        return tl.math.exp2(s - (m - 64.0)[:, None])  # 2^64 = _BITS_Q
    else:
        return tl.math.exp2(s - m[:, None])


@triton.jit
def _fp8_end(acc, l_i, vs, READ: tl.constexpr):
    """After the loop: the accumulator times the value scale (``sum p (v * vs) = vs * sum p v``) and, for "bits",
    2^56 (values read as 2^-120 of theirs, ``p`` 2^64 of its), the sum of ``p`` times 2^-64."""
    if READ == "bits" or READ == "bits_asm":
        return acc * (vs * _BITS_LOGIT), l_i * _BITS_SUM
    else:
        return acc * vs, l_i
