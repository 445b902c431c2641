"""FP8 (e4m3fn) KV caches in the kernels: the Triton kernels (in the interpreter without CUDA) and the torch
references against naive float64 attention over the dequantised cache.

What an FP8 cache must give: the write stores ``clamp(x / scale, -448, 448)`` rounded to nearest even, byte for byte
what torch's cast gives on both backends (ties, subnormals, saturation, per-tensor and per-head scales); decode,
prefill and the fused write + decode read ``stored * scale`` (windows, softcap, sinks, chunks, ALiBi, GQA, head dims
64, 96 and 128, split-K), and the fused write + decode equals the write then the decode, bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_kernels import BACKENDS, DEVICE, HAS_CUDA, HAS_TRITON, TOL, _gen, make_paged  # noqa: E402

from hf_paged import kernels  # noqa: E402
from hf_paged.kernels import reference  # noqa: E402

FP8 = torch.float8_e4m3fn


@pytest.fixture
def backend(request, monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", request.param)
    return request.param


def _scales(hkv: int, per_head: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value scales: one per KV head (different) or one for all."""
    g = _gen(seed)
    n = hkv if per_head else 1
    ks = (0.005 + 0.02 * torch.rand(n, generator=g)).to(DEVICE)
    vs = (0.005 + 0.02 * torch.rand(n, generator=g)).to(DEVICE)
    return ks, vs


def fp8_paged(lens, starts, hkv, d, bs, per_head, seed=0):
    """`make_paged`'s float32 cache (NaN outside the attended ranges) quantised with random scales, and its
    dequantised float64 copy (the oracle's input)."""
    kc, vc, bt, sl, ks = make_paged(lens, starts, hkv, d, bs, torch.float32, seed=seed)
    k_scale, v_scale = _scales(hkv, per_head, seed + 1)
    kq = reference.quantize(kc.transpose(1, 2), k_scale).transpose(1, 2).contiguous()  # per head: [.., H, D] last
    vq = reference.quantize(vc.transpose(1, 2), v_scale).transpose(1, 2).contiguous()
    kd = kq.double() * k_scale.double().reshape(1, -1, 1, 1)
    vd = vq.double() * v_scale.double().reshape(1, -1, 1, 1)
    return (kq, vq, k_scale, v_scale), (kd, vd), bt, sl, ks


def _close(out, ref, dtype, what):
    assert not torch.isnan(out).any(), f"{what}: NaN in output"
    torch.testing.assert_close(out.double().cpu(), ref.double().cpu(), **TOL[dtype], msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------- #
# the write: bytes equal to torch's cast
# --------------------------------------------------------------------------- #
def _values(n: int, d: int, h: int, seed: int) -> torch.Tensor:
    """[n, h, d] values over the whole e4m3 range: random at many magnitudes, exact ties between neighbouring fp8
    values (scaled), subnormals, zeros of both signs and values past the largest finite one."""
    g = _gen(seed)
    mags = torch.tensor([1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0, 1e3])
    x = torch.randn(n * h * d, generator=g) * mags[torch.randint(0, len(mags), (n * h * d,), generator=g)]
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = codes[torch.isfinite(codes)].unique().sort().values
    ties = (finite[1:] + finite[:-1]) / 2
    special = torch.cat([ties, -ties, finite, torch.tensor([0.0, -0.0, 2.0**-10, 449.0, -500.0, 1e9])])
    x[: special.numel()] = special[: x.numel()]
    return x.reshape(n, h, d)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("d,per_head", [(64, False), (96, True), (128, True)])
def test_write_kv_stores_torchs_fp8_bytes(backend, d, per_head):
    nb, h, bs, T = 4, 2, 16, 40
    scale = torch.tensor([1.0, 0.5] if per_head else [1.0], device=DEVICE)  # values / scale: the ties stay ties
    k = _values(T, d, h, seed=d).to(DEVICE)
    v = -_values(T, d, h, seed=d + 1).to(DEVICE)
    kc = torch.zeros(nb, h, bs, d, dtype=FP8, device=DEVICE)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(nb * bs, generator=_gen(3))[:T]
    slots[[1, 7]] = -1
    slots = slots.to(torch.int32).to(DEVICE)
    kernels.write_kv(k, v, kc, vc, slots, k_scale=scale, v_scale=scale)
    exp_k, exp_v = torch.zeros_like(kc), torch.zeros_like(vc)
    for t in range(T):
        s = int(slots[t])
        if s >= 0:
            exp_k[s // bs, :, s % bs] = (k[t] / scale[:, None]).clamp(-448, 448).to(FP8)
            exp_v[s // bs, :, s % bs] = (v[t] / scale[:, None]).clamp(-448, 448).to(FP8)
    assert torch.equal(kc.view(torch.uint8), exp_k.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), exp_v.view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_write_kv_fp8_from_bfloat16(backend):
    """16-bit key states are quantised from their own value (divided in float32)."""
    h, d, bs = 2, 64, 8
    scale = torch.tensor([0.03], device=DEVICE)
    k = torch.randn(5, h, d, generator=_gen(1)).to(torch.bfloat16).to(DEVICE)
    kc = torch.zeros(2, h, bs, d, dtype=FP8, device=DEVICE)
    vc = torch.zeros_like(kc)
    slots = torch.arange(5, dtype=torch.int32, device=DEVICE)
    kernels.write_kv(k, k, kc, vc, slots, k_scale=scale, v_scale=scale)
    exp = (k.float() / scale).clamp(-448, 448).to(FP8)
    assert torch.equal(kc[0, :, :5].transpose(0, 1).contiguous().view(torch.uint8), exp.view(torch.uint8))


# --------------------------------------------------------------------------- #
# decode and prefill read stored * scale
# --------------------------------------------------------------------------- #
# (query dtype, Hq, Hkv, D, block size, lens, starts, forced splits, per-head scales, options)
DECODE_CASES = [
    pytest.param(torch.float32, 4, 2, 64, 16, [1, 30, 70], [0, 5, 0], None, False, {}, id="f32-gqa2-d64"),
    pytest.param(torch.bfloat16, 8, 2, 128, 16, [9, 66], [0, 3], 3, True, {}, id="bf16-gqa4-d128-split"),
    pytest.param(torch.float32, 6, 2, 96, 8, [17, 40], [0, 0], None, True,
                 dict(sliding_window=11, softcap=5.0), id="f32-d96-window-softcap"),
    pytest.param(torch.float16, 4, 1, 64, 16, [33, 5], [0, 0], 2, False,
                 dict(sinks=True, chunk_size=16), id="f16-mqa-sinks-chunk"),
    pytest.param(torch.bfloat16, 4, 2, 64, 16, [12, 50], [0, 4], 2, True,
                 dict(alibi=True, softcap=5.0), id="bf16-alibi-softcap-split"),
    # a group over 16 query heads keeps the bf16 tile (`triton_decode.FP8_MAX_GROUP`)
    pytest.param(torch.bfloat16, 32, 1, 64, 16, [20, 45], [0, 0], 2, False, {}, id="bf16-mqa32-d64-split"),
]


def _opts(opts: dict, hq: int) -> dict:
    out = dict(opts)
    if out.get("sinks") is True:
        out["sinks"] = torch.randn(hq, generator=_gen(9)).to(DEVICE)
    if out.pop("alibi", False):  # BLOOM-like slopes, one of 0.5 (a bias far larger than the logits)
        out["alibi_slopes"] = (0.5 * 2.0 ** -(2 * torch.arange(hq, dtype=torch.float32))).to(DEVICE)
    return out


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype,hq,hkv,d,bs,lens,starts,splits,per_head,opts", DECODE_CASES)
def test_decode_reads_fp8(backend, dtype, hq, hkv, d, bs, lens, starts, splits, per_head, opts):
    (kq, vq, k_scale, v_scale), (kd, vd), bt, sl, kvs = fp8_paged(lens, starts, hkv, d, bs, per_head, seed=d)
    opts = _opts(opts, hq)
    q = torch.randn(len(lens), hq, d, generator=_gen(2)).to(dtype).to(DEVICE)
    kv_start = kvs if any(starts) else None
    out = kernels.paged_decode(q, kq, vq, bt, sl, d**-0.5, kv_start, k_scale=k_scale, v_scale=v_scale,
                               _num_splits=splits if backend == "triton" else None, **opts)
    naive = reference.naive_paged_decode(q.double(), kd, vd, bt, sl, d**-0.5, kv_start, **opts)
    assert out.dtype == dtype
    _close(out, naive, dtype, backend)


PREFILL_CASES = [
    pytest.param(torch.float32, 4, 2, 64, 16, [(5, 20, 0), (16, 16, 0)], {}, False, id="f32-gqa2-d64"),
    pytest.param(torch.bfloat16, 8, 2, 128, 8, [(7, 40, 3), (1, 9, 0)], dict(sliding_window=9), True,
                 id="bf16-d128-window"),
    pytest.param(torch.float32, 6, 2, 96, 16, [(12, 30, 0)], dict(softcap=4.0, sinks=True), True,
                 id="f32-d96-softcap-sinks"),
    pytest.param(torch.float32, 2, 2, 64, 8, [(20, 20, 0)], dict(chunk_size=8), False, id="f32-mha-chunk"),
    pytest.param(torch.float32, 4, 2, 64, 16, [(9, 33, 2), (4, 4, 0)], dict(alibi=True), True, id="f32-alibi"),
]


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype,hq,hkv,d,bs,seqs,opts,per_head", PREFILL_CASES)
def test_prefill_reads_fp8(backend, dtype, hq, hkv, d, bs, seqs, opts, per_head):
    q_lens, lens, starts = [s[0] for s in seqs], [s[1] for s in seqs], [s[2] for s in seqs]
    (kq, vq, k_scale, v_scale), (kd, vd), bt, sl, kvs = fp8_paged(lens, starts, hkv, d, bs, per_head, seed=d + 1)
    opts = _opts(opts, hq)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(cu[-1]), hq, d, generator=_gen(4)).to(dtype).to(DEVICE)
    kv_start = kvs if any(starts) else None
    out = kernels.paged_prefill(q, kq, vq, bt, cu, sl, d**-0.5, max(q_lens), kv_start, k_scale=k_scale,
                                v_scale=v_scale, **opts)
    naive = reference.naive_paged_prefill(q.double(), kd, vd, bt, cu, sl, d**-0.5, max(q_lens), kv_start, **opts)
    assert out.dtype == dtype
    _close(out, naive, dtype, backend)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("splits", [None, 2])
def test_fused_write_and_decode_equals_write_then_decode(monkeypatch, splits):
    """The decode kernel's own write of the step's K/V stores the bytes `write_kv` stores, and reads them back the
    same way: output and cache bit for bit."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    hq, hkv, d, bs = 4, 2, 64, 16
    lens = [20, 45]
    (kq, vq, k_scale, v_scale), _, bt, sl, _ = fp8_paged(lens, [0, 0], hkv, d, bs, True, seed=11)
    kq = torch.nan_to_num(kq.float()).to(FP8)  # slots the step writes held NaN (never read before)
    vq = torch.nan_to_num(vq.float()).to(FP8)
    g = _gen(5)
    q = torch.randn(2, hq, d, generator=g).to(DEVICE)
    k_new = torch.randn(2, hkv, d, generator=g).to(DEVICE)
    v_new = torch.randn(2, hkv, d, generator=g).to(DEVICE)
    slots = torch.stack([bt[i, (n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lens)]).to(torch.int32)
    k1, v1, k2, v2 = kq.clone(), vq.clone(), kq.clone(), vq.clone()
    kernels.write_kv(k_new, v_new, k1, v1, slots, k_scale=k_scale, v_scale=v_scale)
    a = kernels.paged_decode(q, k1, v1, bt, sl, 0.125, k_scale=k_scale, v_scale=v_scale, _num_splits=splits)
    counters = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    b = kernels.write_and_paged_decode(q, k_new, v_new, k2, v2, slots, bt, sl, 0.125, split_counters=counters,
                                       k_scale=k_scale, v_scale=v_scale)
    if splits is None:
        assert torch.equal(a, b)
    else:  # (the fused launch picks its own split count: the same keys, another summation order)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(k1.view(torch.uint8), k2.view(torch.uint8))
    assert torch.equal(v1.view(torch.uint8), v2.view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_copy_blocks_copies_fp8_bytes(backend):
    pool = torch.randn(2, 2, 6, 2, 8, 64, generator=_gen(1)).to(FP8).to(DEVICE)
    before = pool.clone()
    kernels.copy_blocks(pool, [0, 3], [5, 1])
    assert torch.equal(pool[:, :, 5].view(torch.uint8), before[:, :, 0].view(torch.uint8))
    assert torch.equal(pool[:, :, 1].view(torch.uint8), before[:, :, 3].view(torch.uint8))
    assert torch.equal(pool[:, :, 2].view(torch.uint8), before[:, :, 2].view(torch.uint8))


def test_fp8_argument_errors():
    kc = torch.zeros(2, 2, 8, 64, dtype=FP8, device=DEVICE)
    q = torch.zeros(1, 2, 64, device=DEVICE)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    sl = torch.ones(1, dtype=torch.int32, device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    with pytest.raises(TypeError, match="k_scale"):
        kernels.paged_decode(q, kc, kc, bt, sl, 0.1)
    with pytest.raises(ValueError, match="v_scale"):
        kernels.paged_decode(q, kc, kc, bt, sl, 0.1, k_scale=one, v_scale=torch.ones(3, device=DEVICE))
    with pytest.raises(TypeError, match="k_scale"):
        kernels.paged_decode(q, kc, kc, bt, sl, 0.1, k_scale=one.double(), v_scale=one)
    with pytest.raises(TypeError, match="k_scale / v_scale are for"):
        bf = torch.zeros(2, 2, 8, 64, dtype=torch.bfloat16, device=DEVICE)
        kernels.paged_decode(q.bfloat16(), bf, bf, bt, sl, 0.1, k_scale=one, v_scale=one)
    with pytest.raises(TypeError, match="k_scale"):
        kernels.write_kv(q[:, :2], q[:, :2], kc, kc, sl)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_hardware_fp8_cast_matches_torch(monkeypatch):
    """On CUDA the write uses the hardware's cast (`tl.float8e4nv`): the same bytes as torch's."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    k = _values(64, 128, 2, seed=0).cuda()
    kc = torch.zeros(4, 2, 16, 128, dtype=FP8, device="cuda")
    vc = torch.zeros_like(kc)
    scale = torch.ones(1, device="cuda")
    kernels.write_kv(k, k, kc, vc, torch.arange(64, dtype=torch.int32, device="cuda"), k_scale=scale,
                     v_scale=scale)
    exp = k.clamp(-448, 448).to(FP8)
    assert torch.equal(kc.transpose(1, 2).reshape(64, 2, 128).view(torch.uint8), exp.view(torch.uint8))
