"""FP8 (e4m3fn) KV storage in the Triton kernels: how a value is stored, and where the scales go when it is read.

A quantised cache stores ``clamp(x / scale, -448, 448)`` rounded to the nearest e4m3 value, ties to even: what torch's
``.to(torch.float8_e4m3fn)`` gives for the clamped value (`hf_paged.kernels.reference`), so the two backends write the
same bytes. On CUDA the cast is the hardware's (``tl.float8e4nv``: round to nearest even, saturating). Triton's
interpreter converts float32 to fp8 wrongly when rounding carries into the exponent (7.99 became 4.0 in Triton 3.9)
and rounds ties up, so under the interpreter the bits are computed with integer arithmetic instead (`_e4m3_bits`,
checked against torch over every tie and random values in `tests/test_kv_fp8.py`); reading fp8 back is exact there.

Reading: the attention kernels convert an fp8 tile to the query's dtype (exact: every e4m3 value is a bf16, an fp16
and a float32) and apply the scales outside the products, in float32: the key scale multiplies the logit scale
(``q . (k * s) = s * (q . k)``) and the value scale the accumulated output, once per program (one KV head each, so a
scale per KV head costs nothing more than one per layer).

Imported lazily with the kernels (needs triton).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["FP8_MAX", "_to_cache"]

FP8_MAX = 448.0  # the largest finite float8_e4m3fn


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
