"""How the decode kernels read an FP8 (e4m3fn) cache: `triton_fp8.READ_MODE` ("cast", "fp16", "bits", "bits_asm", each
also with the value tile loaded transposed: "_t"), a compile-time choice the GPU benchmark compares
(`benchmarks/bench_decode_kernel.py --fp8-read-modes`).

What must hold: the "bits" read (e4m3 byte to bf16 bits with integer ops) is exactly ``value * 2^-120`` for every byte
but the two NaNs, in torch and in the Triton helper (its inline-PTX form on CUDA), and the "fp16" read is exact; every
mode's decode, narrow and wide kernels, gives the float64 reference's result within the bf16 tolerance (the interpreter
on the CPU, where "bits_asm" would run as "bits" and is left out); the "fp16" read keeps queries beyond float16's range
(|q| > 65,504, or tiny) exact; float32 and float16 queries read "cast"; an unknown mode is a ValueError naming the
setting.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from test_kernels import DEVICE, TOL, _gen  # noqa: E402
from test_kv_fp8_kernels import fp8_paged  # noqa: E402

from hf_paged import kernels  # noqa: E402
from hf_paged.kernels import reference, triton_decode_wide, triton_fp8  # noqa: E402

FP8 = torch.float8_e4m3fn
# under the interpreter "bits_asm" runs as "bits": left out there; the wide kernel reads "_t" as the plain mode
MODES = [m for m in triton_fp8.READ_MODES if torch.cuda.is_available() or not m.startswith("bits_asm")]
WIDE_MODES = [m for m in MODES if not m.endswith("_t")]


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")


def _bytes() -> tuple[torch.Tensor, torch.Tensor]:
    """All 256 e4m3 bytes and which of them are numbers (0x7F and 0xFF are NaN)."""
    codes = torch.arange(256, dtype=torch.uint8)
    return codes, torch.isfinite(codes.view(FP8).float())


def test_bits_read_is_the_value_times_2_to_the_minus_120_for_every_byte():
    codes, finite = _bytes()
    assert finite.sum() == 254
    bits = ((codes.view(torch.int8).to(torch.int32) << 4) & 0x87F0).to(torch.int16).view(torch.bfloat16)
    value = codes.view(FP8).double()
    assert torch.equal(bits.double()[finite] * 2.0**120, value[finite])
    subnormal = finite & (value.abs() < 2.0**-6) & (value != 0)  # e4m3's 14 subnormals land on bf16's
    assert subnormal.sum() == 14 and (bits.double()[subnormal].abs() < 2.0**-126).all()
    assert torch.equal(torch.signbit(bits.float()), torch.signbit(value.float()))  # -0 too


@triton.jit
def _read_kernel(X, Y, READ: tl.constexpr):
    offs = tl.arange(0, 256)
    y = triton_fp8._fp8_tile(tl.load(X + offs), READ, tl.bfloat16)
    tl.store(Y + offs, y.to(tl.int16, bitcast=True))


@pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")
@pytest.mark.parametrize("mode", ["bits", "fp16", pytest.param("bits_asm", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="inline PTX: CUDA only"))])
def test_triton_read_gives_the_expected_bits(mode):
    """The kernels' helper: "bits" (and "bits_asm") gives the bf16 bits above, "fp16" torch's (exact) float16
    conversion."""
    codes, finite = _bytes()
    out = torch.empty(256, dtype=torch.int16, device=DEVICE)
    _read_kernel[(1,)](codes.view(FP8).to(DEVICE), out, READ=mode)
    if mode != "fp16":
        expected = ((codes.view(torch.int8).to(torch.int32) << 4) & 0x87F0).to(torch.int16)
    else:
        expected = codes.view(FP8).to(torch.float16).view(torch.int16)
    assert torch.equal(out.cpu()[finite], expected[finite])


# (Hq, Hkv, D, block size, lens, starts, forced splits, per-head scales, options)
CASES = [
    pytest.param(8, 2, 128, 16, [9, 66], [0, 3], 3, True, {}, id="gqa4-d128-split"),
    pytest.param(4, 2, 64, 16, [12, 50], [0, 4], 2, True, dict(softcap=5.0, sinks=True), id="softcap-sinks-split"),
    pytest.param(4, 1, 64, 8, [17, 40], [0, 0], None, False, dict(sliding_window=11), id="mqa-window"),
]


def _decode(mode, monkeypatch, hq, hkv, d, bs, lens, starts, splits, per_head, opts, q_mul=1.0):
    """The Triton decode of an FP8 cache read in `mode`, and the float64 reference over the dequantised cache."""
    monkeypatch.setattr(triton_fp8, "READ_MODE", mode)
    (kq, vq, k_scale, v_scale), (kd, vd), bt, sl, kvs = fp8_paged(lens, starts, hkv, d, bs, per_head, seed=d)
    if opts.get("sinks") is True:
        opts = dict(opts, sinks=torch.randn(hq, generator=_gen(9)).to(DEVICE))
    q = (torch.randn(len(lens), hq, d, generator=_gen(2)) * q_mul).to(torch.bfloat16).to(DEVICE)
    kv_start = kvs if any(starts) else None
    out = kernels.paged_decode(q, kq, vq, bt, sl, d**-0.5 / q_mul, kv_start, k_scale=k_scale, v_scale=v_scale,
                               _num_splits=splits, **opts)
    naive = reference.naive_paged_decode(q.double(), kd, vd, bt, sl, d**-0.5 / q_mul, kv_start, **opts)
    assert out.dtype == torch.bfloat16 and not torch.isnan(out).any()
    return out, naive


@pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hq,hkv,d,bs,lens,starts,splits,per_head,opts", CASES)
def test_every_read_mode_decodes_as_the_reference(monkeypatch, mode, hq, hkv, d, bs, lens, starts, splits, per_head,
                                                  opts):
    out, naive = _decode(mode, monkeypatch, hq, hkv, d, bs, lens, starts, splits, per_head, opts)
    torch.testing.assert_close(out.double().cpu(), naive.cpu(), **TOL[torch.bfloat16])


@pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")
@pytest.mark.parametrize("q_mul", [1e5, 1e-6])
@pytest.mark.parametrize("mode", ["fp16", "fp16_t"])
def test_fp16_read_keeps_queries_beyond_float16s_range(monkeypatch, q_mul, mode):
    """|q| up to ~4e5 (float16 overflows past 65,504) or ~1e-6 (float16 subnormals): the power-of-two prescale keeps
    the logits those of the "cast" read, the scale given as 1 / q_mul so the softmax is the usual one."""
    args = (8, 2, 128, 16, [9, 66], [0, 3], 3, True, {})
    cast, naive = _decode("cast", monkeypatch, *args, q_mul=q_mul)
    fp16, _ = _decode(mode, monkeypatch, *args, q_mul=q_mul)
    torch.testing.assert_close(fp16.double().cpu(), naive.cpu(), **TOL[torch.bfloat16])
    torch.testing.assert_close(fp16, cast, **TOL[torch.bfloat16])


def _wide_cache(seq_lens, hkv, dk, dv, shared, scale, seed=0):
    """An FP8 paged cache of `dk`-wide keys (values: the keys' first `dv` columns when `shared`), its block table."""
    g = _gen(seed)
    bs = 8
    per = [-(-n // bs) for n in seq_lens]
    nb = sum(per) + 1
    kc = (torch.randn(nb, hkv, bs, dk, generator=g) / scale).clamp(-448, 448).to(FP8).to(DEVICE)
    vc = kc[..., :dv] if shared else (torch.randn(nb, hkv, bs, dv, generator=g) / scale).to(FP8).to(DEVICE)
    bt = torch.randperm(nb, generator=g)[:sum(per)].to(torch.int32)
    table = torch.zeros(len(seq_lens), max(per), dtype=torch.int32)
    i = 0
    for s, n in enumerate(per):
        table[s, :n] = bt[i:i + n]
        i += n
    return kc, vc, table.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


@pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")
@pytest.mark.parametrize("mode", WIDE_MODES)
@pytest.mark.parametrize("hkv,g,dk,dv,shared", [(1, 16, 576, 512, True), (2, 2, 320, 320, False)],
                         ids=["latent", "d320"])
def test_every_read_mode_in_the_wide_kernel(monkeypatch, mode, hkv, g, dk, dv, shared):
    """The wide kernel (heads over 256; called directly: bf16 latents of at most 32 query heads per KV head take the
    narrow kernel's small tiles): MLA's latent (the values the keys' first 512 columns, read once, a 64-wide key
    rest) and separate values with a key rest, split in two."""
    monkeypatch.setattr(triton_fp8, "READ_MODE", mode)
    scale = torch.tensor([0.01], device=DEVICE)
    kc, vc, bt, sl = _wide_cache([21, 10], hkv, dk, dv, shared, 0.01)
    q = torch.randn(2, hkv * g, dk, generator=_gen(3)).to(torch.bfloat16).to(DEVICE)
    out = triton_decode_wide.paged_decode(q, kc, vc, bt, sl, dk**-0.5, k_scale=scale, v_scale=scale, num_splits=2)
    ref = reference.paged_decode(q.double(), kc, vc, bt, sl, dk**-0.5, k_scale=scale.double(),
                                 v_scale=scale.double())
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), **TOL[torch.bfloat16])


def test_read_mode_applies_to_bfloat16_queries_over_an_fp8_cache(monkeypatch):
    monkeypatch.setattr(triton_fp8, "READ_MODE", "bits_t")
    assert triton_fp8.read_mode(torch.bfloat16, True) == ("bits", True)
    assert triton_fp8.read_mode(torch.bfloat16, False) == ("cast", False)  # a bf16 cache: nothing to convert
    assert triton_fp8.read_mode(torch.float16, True) == ("cast", False)  # fp8 -> fp16 is the short path already
    assert triton_fp8.read_mode(torch.float32, True) == ("cast", False)  # IEEE float32 dots
    monkeypatch.setattr(triton_fp8, "READ_MODE", "bits_asm")
    assert triton_fp8.read_mode(torch.bfloat16, True) == ("bits_asm", False)
    assert triton_fp8.read_mode(torch.bfloat16, True, cuda=False) == ("bits", False)  # the interpreter runs no PTX
    assert set(triton_fp8.READ_MODES) == {"cast", "fp16", "bits", "bits_asm", "cast_t", "fp16_t", "bits_t",
                                          "bits_asm_t"}
    monkeypatch.setattr(triton_fp8, "READ_MODE", "bf8")
    with pytest.raises(ValueError, match="HF_PAGED_FP8_READ"):
        triton_fp8.read_mode(torch.bfloat16, True)


def test_an_fp8_cache_launches_its_own_tile_and_splits_alike(monkeypatch):
    """An FP8 cache's default tile is its own (`triton_decode._FP8_CONFIGS`: one warp, 32 keys; the bf16 tile ran an
    FP8 step no faster than a bf16 one) for groups of up to 16 query heads, a bf16 cache's is unchanged, and the split
    heuristic cuts alike for both tiles (its runs are longer than either), so the JIT warm-up's variant keys hold for
    both caches."""
    from hf_paged.kernels import triton_decode as td

    for d in (64, 128, 256):
        assert td.launch_config(d, quantized=True) == td._FP8_CONFIGS[d]
        assert td.launch_config(d, quantized=True)[1] == 1
        assert td.launch_config(d) == td._CONFIGS[d]
    assert td.launch_config(96, quantized=True) == td._FP8_CONFIGS[128]  # padded to a power of two
    assert td.launch_config(1024, quantized=True) == td._CONFIGS[1024]  # no FP8 entry: the bf16 one
    # a group wider than one 16-row tile (MQA: 32-128 query heads a KV head) keeps the bf16 tile: one warp would
    # hold its whole accumulator
    assert td.launch_config(128, quantized=True, group=16) == td._FP8_CONFIGS[128]
    assert td.launch_config(128, quantized=True, group=17) == td._CONFIGS[128]
    monkeypatch.setattr(td, "_device_sms", lambda device: 132)
    for batch in (1, 3, 8, 64, 200, 512):
        for context in (16, 200, 256, 257, 1000, 4096, 65536):
            bf16, fp8 = (td._launch_splits(None, batch, 8, context, td.launch_config(128, q)[0], "cuda")
                         for q in (False, True))
            assert bf16 == fp8, (batch, context)
