"""Kernel tests: Triton kernels vs the torch references vs naive float64 attention.

Without CUDA the Triton kernels run in the interpreter (``TRITON_INTERPRET=1``, set here
before triton is imported), so the cases are few and small but each one covers many
features at once: shuffled physical blocks, context lengths that are not multiples of
the block size (and 1), kv_start > 0, empty key ranges, NaN in every slot outside the
attended ranges, GQA ratios 1/4/8, block sizes 8/16/32, head dims 64/128, float32 and
bfloat16, split-K on and off.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_paged import kernels  # noqa: E402
from hf_paged.kernels import reference  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
HAS_TRITON = kernels.triton_available()

BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")),
]
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

TOL = {
    torch.float32: dict(atol=2e-4, rtol=1e-4),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
}


@pytest.fixture
def backend(request, monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", request.param)
    return request.param


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def make_paged(seq_lens, kv_starts, num_kv_heads, head_dim, block_size, dtype, seed=0, extra_blocks=5):
    """Random cache with shuffled physical blocks; every slot outside [kv_start, seq_len) is NaN."""
    g = _gen(seed)
    n_per_seq = [max(1, -(-n // block_size)) for n in seq_lens]
    num_blocks = sum(n_per_seq) + extra_blocks
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    kc = torch.full(shape, float("nan"), dtype=dtype)
    vc = torch.full(shape, float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(n_per_seq) + 2  # padded table width
    bt = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    i = 0
    for s, (n, lo) in enumerate(zip(seq_lens, kv_starts)):
        blocks = perm[i : i + n_per_seq[s]]
        i += n_per_seq[s]
        bt[s, : len(blocks)] = blocks.to(torch.int32)
        for t in range(max(lo, 0), n):
            b, o = blocks[t // block_size], t % block_size
            kc[b, :, o] = torch.randn(num_kv_heads, head_dim, generator=g).to(dtype)
            vc[b, :, o] = torch.randn(num_kv_heads, head_dim, generator=g).to(dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    ks = torch.tensor(kv_starts, dtype=torch.int32)
    return kc.to(DEVICE), vc.to(DEVICE), bt.to(DEVICE), sl.to(DEVICE), ks.to(DEVICE)


def _assert_close(out, ref, dtype, what=""):
    assert not torch.isnan(out).any(), f"{what}: NaN in output"
    torch.testing.assert_close(out.double().cpu(), ref.double().cpu(), **TOL[dtype], msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------- #
# decode
# --------------------------------------------------------------------------- #
# (dtype, Hq, Hkv, D, block_size, seq_lens, kv_starts or None, forced num_splits list)
DECODE_CASES = [
    pytest.param(torch.float32, 2, 2, 64, 8, [1, 9, 37], None, [None], id="f32-mha-bs8-d64"),
    pytest.param(torch.bfloat16, 8, 2, 128, 16, [1, 50, 130, 16], [0, 7, 100, 0], [None, 3], id="bf16-gqa4-bs16-d128"),
    pytest.param(torch.float32, 8, 1, 64, 32, [0, 33, 200, 5, 64], [0, 40, 60, 5, 0], [1, 4], id="f32-gqa8-bs32-d64"),
    pytest.param(torch.float16, 14, 2, 64, 16, [3, 100], [0, 17], [2], id="f16-gqa7-bs16-d64"),
    # head dims that are no power of two (phi-3's 96, phi-2's 80): padded tiles, masked lanes
    pytest.param(torch.bfloat16, 6, 2, 96, 16, [1, 50, 130], [0, 7, 0], [None, 3], id="bf16-gqa3-bs16-d96"),
    pytest.param(torch.float32, 4, 4, 80, 8, [9, 37, 2], None, [None, 2], id="f32-mha-bs8-d80"),
    # multi-head latent attention (hf_paged.attention.adapters.mla): 16 heads over one 576-wide latent, small tiles
    pytest.param(torch.bfloat16, 16, 1, 576, 16, [1, 40, 19], [0, 3, 0], [None, 2], id="bf16-mla-bs16-d576"),
]


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype,hq,hkv,d,bs,lens,starts,splits", DECODE_CASES)
def test_paged_decode(backend, dtype, hq, hkv, d, bs, lens, starts, splits):
    starts_l = starts if starts is not None else [0] * len(lens)
    kc, vc, bt, sl, ks = make_paged(lens, starts_l, hkv, d, bs, dtype, seed=len(lens) + d)
    q = torch.randn(len(lens), hq, d, generator=_gen(1)).to(dtype).to(DEVICE)
    scale = d**-0.5
    kv_start = ks if starts is not None else None
    naive = reference.naive_paged_decode(q, kc, vc, bt, sl, scale, kv_start)
    for ns in splits if backend == "triton" else [None]:
        out = kernels.paged_decode(q, kc, vc, bt, sl, scale, kv_start, _num_splits=ns)
        assert out.shape == q.shape and out.dtype == dtype
        _assert_close(out, naive, dtype, f"{backend} splits={ns}")
    # empty ranges (seq_len 0, kv_start >= seq_len) are exact zeros
    for b, (n, lo) in enumerate(zip(lens, starts_l)):
        if n <= lo:
            assert torch.all(out[b] == 0)


# --------------------------------------------------------------------------- #
# prefill
# --------------------------------------------------------------------------- #
# (dtype, Hq, Hkv, D, block_size, [(q_len, seq_len, kv_start)], extra pad rows)
PREFILL_CASES = [
    pytest.param(torch.float32, 2, 2, 64, 8, [(5, 5, 0), (1, 20, 0), (17, 40, 0)], 3, id="f32-mha-bs8-d64"),
    pytest.param(
        torch.bfloat16,
        8,
        2,
        128,
        16,
        [(33, 33, 0), (8, 70, 30), (10, 25, 20), (0, 12, 0)],
        0,
        id="bf16-gqa4-bs16-d128-kvstart",
    ),
    pytest.param(torch.float32, 8, 1, 64, 32, [(40, 100, 0), (3, 3, 0), (1, 1, 0)], 2, id="f32-gqa8-bs32-d64"),
    pytest.param(torch.float16, 14, 2, 64, 16, [(12, 30, 4), (5, 5, 0)], 1, id="f16-gqa7-bs16-d64"),
    pytest.param(torch.bfloat16, 6, 2, 96, 16, [(20, 45, 3), (1, 9, 0)], 2, id="bf16-gqa3-bs16-d96"),
    pytest.param(torch.float32, 4, 4, 80, 8, [(17, 17, 0), (3, 30, 0)], 0, id="f32-mha-bs8-d80"),
    pytest.param(torch.bfloat16, 20, 1, 576, 16, [(9, 20, 0), (1, 7, 0)], 1, id="bf16-mla-g20-bs16-d576"),
]


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype,hq,hkv,d,bs,seqs,pad", PREFILL_CASES)
def test_paged_prefill(backend, dtype, hq, hkv, d, bs, seqs, pad):
    q_lens = [s[0] for s in seqs]
    lens = [s[1] for s in seqs]
    starts = [s[2] for s in seqs]
    kc, vc, bt, sl, ks = make_paged(lens, starts, hkv, d, bs, dtype, seed=len(seqs) + d)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    T = cu[-1] + pad
    q = torch.randn(T, hq, d, generator=_gen(2)).to(dtype).to(DEVICE)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    kv_start = ks if any(starts) else None
    scale = d**-0.5
    out = kernels.paged_prefill(q, kc, vc, bt, cu_t, sl, scale, max(q_lens), kv_start)
    naive = reference.naive_paged_prefill(q, kc, vc, bt, cu_t, sl, scale, max(q_lens), kv_start)
    assert out.shape == q.shape and out.dtype == dtype
    _assert_close(out, naive, dtype, backend)
    assert torch.all(out[cu[-1] :] == 0), "rows outside every sequence must be zero"
    for s, (ql, n, lo) in enumerate(seqs):  # rows at positions < kv_start: exact zeros
        for i in range(ql):
            if n - ql + i < lo:
                assert torch.all(out[cu[s] + i] == 0)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_prefill_matches_decode(backend):
    """A one-token prefill per sequence equals decode (same positions, same kv_start)."""
    dtype = torch.float32
    lens, starts = [7, 30, 65], [0, 3, 64]
    kc, vc, bt, sl, ks = make_paged(lens, starts, 2, 64, 16, dtype, seed=5)
    q = torch.randn(3, 4, 64, generator=_gen(3)).to(DEVICE)
    cu = torch.arange(4, dtype=torch.int32, device=DEVICE)
    a = kernels.paged_prefill(q, kc, vc, bt, cu, sl, 0.125, 1, ks)
    b = kernels.paged_decode(q, kc, vc, bt, sl, 0.125, ks)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- #
# cache ops
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype,src_dtype,d", [(torch.float32, torch.float32, 64), (torch.bfloat16, torch.float32, 64),
                                               (torch.float32, torch.float32, 96)])
def test_write_kv(backend, dtype, src_dtype, d):
    nb, h, bs, T = 6, 4, 8, 13
    g = _gen(7)
    kc = torch.randn(nb, h, bs, d, generator=g).to(dtype).to(DEVICE)
    vc = torch.randn(nb, h, bs, d, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(T, h, d, generator=g).to(src_dtype).to(DEVICE)
    v = torch.randn(T, h, d, generator=g).to(src_dtype).to(DEVICE)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[[2, 5, 11]] = -1
    slots = slots.to(torch.int32).to(DEVICE)
    exp_k, exp_v = kc.clone(), vc.clone()
    for t in range(T):
        s = int(slots[t])
        if s >= 0:
            exp_k[s // bs, :, s % bs] = k[t].to(dtype)
            exp_v[s // bs, :, s % bs] = v[t].to(dtype)
    kernels.write_kv(k, v, kc, vc, slots)
    if backend == "triton" and not HAS_CUDA and dtype != src_dtype:
        # the interpreter truncates float32 -> bfloat16 instead of rounding to nearest: 1 ulp
        torch.testing.assert_close(kc, exp_k, atol=0, rtol=2**-7)
        torch.testing.assert_close(vc, exp_v, atol=0, rtol=2**-7)
    else:
        assert torch.equal(kc, exp_k) and torch.equal(vc, exp_v)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dv", [16, None], ids=["values-narrower", "values-are-keys"])
@pytest.mark.parametrize("fp8", [False, True])
def test_write_kv_values_of_another_width_or_none(backend, dv, fp8):
    """K and V of different widths (MiMo-V2-Flash: 48 and 16) are written each into its own cache; with `value` and
    `value_cache` None (a layer whose values are its keys) only the keys are written."""
    nb, h, bs, T, d = 5, 2, 8, 9, 48
    g = _gen(3)
    dtype = kernels.FP8_DTYPE if fp8 else torch.float32
    kc = torch.zeros(nb, h, bs, d, device=DEVICE).to(dtype)
    vc = torch.zeros(nb, h, bs, dv, device=DEVICE).to(dtype) if dv else None
    k = (torch.randn(T, h, d, generator=g) * 0.1).to(DEVICE)
    v = (torch.randn(T, h, dv, generator=g) * 0.1).to(DEVICE) if dv else None
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[4] = -1
    slots = slots.to(torch.int32).to(DEVICE)
    scales = dict(k_scale=torch.full((h,), 0.01, device=DEVICE), v_scale=torch.full((1,), 0.02, device=DEVICE)) \
        if fp8 else {}
    kernels.write_kv(k, v, kc, vc, slots, **scales)
    exp_k = torch.zeros(nb, h, bs, d, device=DEVICE).to(dtype)
    exp_v = torch.zeros(nb, h, bs, dv, device=DEVICE).to(dtype) if dv else None
    reference.write_kv(k, v, exp_k, exp_v, slots, **scales)
    assert torch.equal(kc.view(torch.uint8), exp_k.view(torch.uint8))
    assert int((kc.float() != 0).any(-1).sum()) == (T - 1) * h
    if dv:
        assert torch.equal(vc.view(torch.uint8), exp_v.view(torch.uint8)) and bool((vc.float() != 0).any())
    with pytest.raises(ValueError, match="both"):
        kernels.write_kv(k, k if v is None else v, kc, None, slots, **scales)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_write_kv_into_pool_view(backend):
    """Writing through pool[l, 0] / pool[l, 1] views touches only that layer."""
    pool = torch.zeros(3, 2, 4, 2, 16, 32, device=DEVICE)
    k = torch.randn(5, 2, 32, device=DEVICE)
    v = torch.randn(5, 2, 32, device=DEVICE)
    slots = torch.tensor([0, 17, -1, 63, 40], dtype=torch.int64, device=DEVICE)
    kernels.write_kv(k, v, pool[1, 0], pool[1, 1], slots)
    assert pool[0].abs().sum() == 0 and pool[2].abs().sum() == 0
    assert torch.equal(pool[1, 0, 1, :, 1], k[1]) and torch.equal(pool[1, 1, 3, :, 15], v[3])
    assert torch.equal(pool[1, 0, 2, :, 8], k[4])
    assert int((pool[1] != 0).sum()) == 4 * 2 * 2 * 32


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("lead", [(3, 2), ()], ids=["pool", "single-cache"])
def test_copy_blocks(backend, lead):
    g = _gen(9)
    pool = torch.randn(*lead, 10, 2, 8, 16, generator=g).to(torch.bfloat16).to(DEVICE)
    src = torch.tensor([1, 4, 4, 7], device=DEVICE)
    dst = torch.tensor([0, 2, 9, 5], device=DEVICE)
    exp = pool.clone()
    bd = pool.dim() - 4
    for s, t in zip(src.tolist(), dst.tolist()):
        exp.select(bd, t).copy_(pool.select(bd, s))
    kernels.copy_blocks(pool, src.to(torch.int32), dst)
    assert torch.equal(pool, exp)
    kernels.copy_blocks(pool, [3], [8])  # python lists accepted
    assert torch.equal(pool.select(bd, 8), pool.select(bd, 3))
    kernels.copy_blocks(pool, [], [])  # no-op


# --------------------------------------------------------------------------- #
# dispatch / validation (no kernels launched)
# --------------------------------------------------------------------------- #
def test_backend_selection(monkeypatch):
    monkeypatch.delenv("HF_PAGED_BACKEND", raising=False)
    assert kernels.get_backend("cpu") == "torch"
    if HAS_CUDA and HAS_TRITON:
        assert kernels.get_backend("cuda") == "triton"
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    assert kernels.get_backend("cuda") == "torch"
    monkeypatch.setenv("HF_PAGED_BACKEND", "bogus")
    with pytest.raises(ValueError, match="HF_PAGED_BACKEND"):
        kernels.get_backend("cpu")


def test_validation_errors(monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    kc = torch.zeros(4, 2, 8, 64)
    vc = torch.zeros(4, 2, 8, 64)
    q = torch.zeros(2, 4, 64)
    bt = torch.zeros(2, 3, dtype=torch.int32)
    sl = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="query"):
        kernels.paged_decode(q[0], kc, vc, bt, sl, 1.0)
    with pytest.raises(TypeError, match="block_tables"):
        kernels.paged_decode(q, kc, vc, bt.float(), sl, 1.0)
    with pytest.raises(ValueError, match="kv heads"):
        kernels.paged_decode(torch.zeros(2, 3, 64), kc, vc, bt, sl, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        kernels.paged_decode(torch.zeros(2, 4, 32), kc, vc, bt, sl, 1.0)
    with pytest.raises(TypeError, match="dtype"):
        kernels.paged_decode(q.half(), kc, vc, bt, sl, 1.0)
    with pytest.raises(ValueError, match="value_cache"):
        kernels.paged_decode(q, kc, vc[:, :1], bt, sl, 1.0)
    with pytest.raises(ValueError, match="kv_start"):
        kernels.paged_decode(q, kc, vc, bt, sl, 1.0, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        kernels.paged_prefill(q, kc, vc, bt, torch.zeros(2, dtype=torch.int32), sl, 1.0, 1)
    with pytest.raises(TypeError, match="max_seqlen_q"):
        kernels.paged_prefill(q, kc, vc, bt, torch.zeros(3, dtype=torch.int32), sl, 1.0, torch.tensor(1))
    with pytest.raises(ValueError, match="slot_mapping"):
        kc4 = torch.zeros(4, 4, 8, 64)
        kernels.write_kv(q, q, kc4, kc4.clone(), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="key/value"):
        kernels.write_kv(q, q, kc, vc, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="src"):
        kernels.copy_blocks(torch.zeros(4, 2, 8, 64), torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2))


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_dim_checks(monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    kc = torch.zeros(4, 2, 8, 1040, device=DEVICE)  # wider than the wide kernels take (1,024)
    q = torch.zeros(2, 4, 1040, device=DEVICE)
    bt = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    sl = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim from 1 to 1024, got 1040"):
        kernels.paged_decode(q, kc, kc, bt, sl, 1.0)
    kc = torch.zeros(4, 2, 12, 64, device=DEVICE)
    with pytest.raises(ValueError, match="block_size"):
        kernels.paged_decode(torch.zeros(2, 4, 64, device=DEVICE), kc, kc, bt, sl, 1.0)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_split_heuristic():
    from hf_paged.kernels import triton_decode as td

    dev = "cuda" if HAS_CUDA else "cpu"
    assert td.choose_num_splits(1, 1, 100, 64, dev) == 1  # short context: no split
    sms = td._device_sms(torch.device(dev))
    big = td.choose_num_splits(1, 1, 1 << 16, 64, dev)
    assert 1 <= big <= td.MAX_SPLITS
    if sms > 1:
        assert big > 1
        assert td.choose_num_splits(4096, 8, 1 << 16, 64, dev) == 1  # plenty of programs already


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_split_heuristic_on_an_h100_sized_device(monkeypatch):
    """Long sequences are split in big batches too (a ragged batch's longest sequence otherwise holds the launch up),
    the fewer programs a batch gives the more splits its grid has, and the interpreter never splits by itself."""
    from hf_paged.kernels import triton_decode as td

    monkeypatch.setattr(td, "_device_sms", lambda device: 132)
    assert td.choose_num_splits(256, 8, 4096, 64, "cuda") == td.MIN_SPLITS
    assert td.choose_num_splits(24, 8, 4096, 64, "cuda") == 16  # 256 programs want 32 splits; the table has 16 runs
    assert td.choose_num_splits(1, 8, 1 << 16, 64, "cuda") == td.MAX_SPLITS
    assert td.choose_num_splits(24, 8, 300, 64, "cuda") == 2  # no more splits than 256-key runs in the table
    assert td.choose_num_splits(24, 8, td.MIN_TOKENS_PER_SPLIT, 64, "cuda") == 1
    assert td.choose_num_splits(1024, 8, 4096, 64, "cuda") == 1  # 8192 programs: 62 per SM already
    assert td.choose_num_splits(24, 8, 4096, 64, "cpu") == 1


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_split_count_same_for_a_batch_and_its_graph_bucket(monkeypatch):
    """A graph step runs the batch padded to its bucket: the split count (hence every sequence's cut, hence its
    output bits) must not change with that padding, nor with the table width, or graph and eager steps differ."""
    from hf_paged.kernels import triton_decode as td
    from hf_paged.runner.shapes import decode_buckets

    monkeypatch.setattr(td, "_device_sms", lambda device: 132)
    for max_seqs in (256, 200, 48):
        buckets = decode_buckets(max_seqs)
        for batch in range(1, max_seqs + 1):
            bucket = next(s for s in buckets if s >= batch)
            for hkv in (1, 2, 8):
                graph = td.choose_num_splits(bucket, hkv, 8192, 64, "cuda")
                assert td.choose_num_splits(batch, hkv, 8192, 64, "cuda") == graph, (batch, bucket, hkv)
                # a narrower eager table caps the count only where no sequence could use more
                eager = td.choose_num_splits(batch, hkv, 1000, 64, "cuda")
                assert eager == graph or eager >= -(-1000 // td.MIN_TOKENS_PER_SPLIT)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("starts", [False, True])
@pytest.mark.slow
def test_decode_split_output_independent_of_batch_padding_and_width(monkeypatch, starts):
    """A sequence's output bits depend on its own keys and the split count only: not on padding rows, the table
    width, or grid splits it does not use (the reduction adds their exact zeros in split order)."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    lens, kv_lo = [1, 97, 200, 256], [0, 0, 70, 130]
    kc, vc, bt, sl, ks = make_paged(lens, kv_lo if starts else [0] * 4, 2, 64, 16, torch.float32, seed=3)
    q = torch.randn(4, 4, 64, generator=_gen(5)).to(DEVICE)
    kv_start = ks if starts else None
    # every sequence spans at most 256 keys: four one-tile runs of 64, so 4 and 8 grid splits cut them alike
    base = kernels.paged_decode(q, kc, vc, bt, sl, 0.125, kv_start, _num_splits=4)
    pad = 3
    wide = torch.full((4 + pad, bt.shape[1] * 2), 0, dtype=bt.dtype, device=bt.device)
    wide[:4, : bt.shape[1]] = bt
    q_pad = torch.cat([q, torch.randn(pad, 4, 64, generator=_gen(6)).to(DEVICE)])
    sl_pad = torch.cat([sl, torch.zeros(pad, dtype=sl.dtype, device=sl.device)])
    ks_pad = torch.cat([ks, torch.zeros(pad, dtype=ks.dtype, device=ks.device)]) if starts else None
    for splits in (4, 8):
        out = kernels.paged_decode(q_pad, kc, vc, wide, sl_pad, 0.125, ks_pad, _num_splits=splits)
        assert torch.equal(out[:4], base), splits
        assert torch.all(out[4:] == 0)
    naive = reference.naive_paged_decode(q, kc, vc, bt, sl, 0.125, kv_start)
    _assert_close(base, naive, torch.float32, "split")


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("splits", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_decode_block_ids_loaded_ahead_give_the_same_bits(monkeypatch, splits):
    """Loading each tile's block ids one tile ahead (`PREFETCH_TABLE`) changes no bit of the output: ranges that
    start and end mid-tile (kv_start), runs of several tiles, tables padded with -1, an empty sequence."""
    from hf_paged.kernels import triton_decode as td

    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    lens, kv_lo = [0, 61, 200, 333], [0, 3, 70, 130]
    kc, vc, bt, sl, ks = make_paged(lens, kv_lo, 2, 64, 16, torch.float32, seed=11)
    q = torch.randn(4, 4, 64, generator=_gen(7)).to(DEVICE)
    assert td.prefetches_table(4, 2, 64)
    outs = {}
    for ahead in (True, False):
        monkeypatch.setattr(td, "PREFETCH_TABLE", ahead)
        outs[ahead] = kernels.paged_decode(q, kc, vc, bt, sl, 0.125, ks, _num_splits=splits)
    assert torch.equal(outs[True], outs[False])
    _assert_close(outs[True], reference.naive_paged_decode(q, kc, vc, bt, sl, 0.125, ks), torch.float32, "ahead")


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_decode_variant_keys_tell_whether_block_ids_are_loaded_ahead():
    """The rule (few programs, head dims up to 64) is part of the warm-up's variant key, so a warm-up compiles both
    kernels where a model's buckets use both."""
    from hf_paged.kernels import triton_decode as td

    assert td.prefetches_table(64, 8, 64) and td.prefetches_table(33, 8, 64) and not td.prefetches_table(65, 8, 64)
    assert td.prefetches_table(256, 2, 64) and not td.prefetches_table(1, 8, 128)
    assert td.launch_variant(64, 32, 8, 64, 64, 8192, "cpu") != td.launch_variant(128, 32, 8, 64, 64, 8192, "cpu")
    assert td.launch_variant(1, 32, 8, 128, 128, 8192, "cpu") == td.launch_variant(256, 32, 8, 128, 128, 8192, "cpu")


# --------------------------------------------------------------------------- #
# real GPU only
# --------------------------------------------------------------------------- #
@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,L,bs", [(4, 32, 8, 128, 3000, 16), (64, 16, 16, 64, 257, 32)])
def test_decode_cuda_heuristic_splits(monkeypatch, b, hq, hkv, d, L, bs):
    """Default heuristic (possibly split) on real shapes vs the torch reference."""
    monkeypatch.delenv("HF_PAGED_BACKEND", raising=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    nb = b * (-(-L // bs)) + 3
    kc = torch.randn(nb, hkv, bs, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(nb, hkv, bs, d, device="cuda", dtype=torch.bfloat16, generator=g)
    bt = torch.randperm(nb, device="cuda", generator=g)[: b * (-(-L // bs))].view(b, -1).to(torch.int32)
    sl = torch.randint(1, L + 1, (b,), device="cuda", generator=g, dtype=torch.int32)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    out = kernels.paged_decode(q, kc, vc, bt, sl, d**-0.5)
    ref = reference.paged_decode(q, kc, vc, bt, sl, d**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@requires_cuda
@pytest.mark.gpu
def test_decode_cuda_graph_capture(monkeypatch):
    """The Triton decode path has no host syncs: it can be captured in a CUDA graph."""
    monkeypatch.delenv("HF_PAGED_BACKEND", raising=False)
    b, hq, hkv, d, bs, L = 8, 16, 4, 128, 16, 1024
    nb = b * L // bs
    kc = torch.randn(nb, hkv, bs, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.randperm(nb, device="cuda").view(b, -1).to(torch.int32)
    sl = torch.full((b,), L - 5, device="cuda", dtype=torch.int32)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    kernels.paged_decode(q, kc, vc, bt, sl, 0.1)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.paged_decode(q, kc, vc, bt, sl, 0.1)
    sl.fill_(L - 100)
    graph.replay()
    torch.cuda.synchronize()
    ref = reference.paged_decode(q, kc, vc, bt, sl, 0.1)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def _random_paged_cuda(b, hkv, d, bs, max_len, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    per = -(-max_len // bs)
    nb = b * per + 3
    kc = torch.randn(nb, hkv, bs, d, device="cuda", dtype=dtype, generator=g)
    vc = torch.randn(nb, hkv, bs, d, device="cuda", dtype=dtype, generator=g)
    bt = torch.randperm(nb, device="cuda", generator=g)[: b * per].view(b, per).to(torch.int32)
    return kc, vc, bt, g


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d,bs,dtype", [
    (8, 2, 256, 128, torch.bfloat16), (4, 4, 16, 8, torch.bfloat16), (16, 2, 32, 256, torch.bfloat16),
    (12, 4, 128, 64, torch.bfloat16), (32, 32, 96, 16, torch.bfloat16), (8, 2, 80, 16, torch.bfloat16),
    (4, 1, 192, 16, torch.bfloat16),
    # float32 tiles take twice the shared memory: the tile table keeps them within the GPU's
    (8, 2, 256, 16, torch.float32), (12, 4, 128, 16, torch.float32), (32, 8, 64, 16, torch.float32)])
def test_cuda_dims_sweep(monkeypatch, hq, hkv, d, bs, dtype):
    """Head dims 16..256 and block sizes 8..256 on the real GPU, decode and long prefill, vs the reference."""
    monkeypatch.delenv("HF_PAGED_BACKEND", raising=False)
    b, L = 3, 1300
    kc, vc, bt, g = _random_paged_cuda(b, hkv, d, bs, L, dtype=dtype, seed=d + bs)
    sl = torch.tensor([L, 1, 700], device="cuda", dtype=torch.int32)
    ks = torch.tensor([0, 0, 650], device="cuda", dtype=torch.int32)
    q = torch.randn(b, hq, d, device="cuda", dtype=dtype, generator=g)
    for ns in (None, 1, 5):
        out = kernels.paged_decode(q, kc, vc, bt, sl, d**-0.5, ks, _num_splits=ns)
        ref = reference.paged_decode(q, kc, vc, bt, sl, d**-0.5, ks)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    q_lens = [1100, 1, 64]
    cu = torch.tensor([0, 1100, 1101, 1165], device="cuda", dtype=torch.int32)
    qp = torch.randn(1170, hq, d, device="cuda", dtype=dtype, generator=g)
    out = kernels.paged_prefill(qp, kc, vc, bt, cu, sl, d**-0.5, max(q_lens), ks)
    ref = reference.paged_prefill(qp, kc, vc, bt, cu, sl, d**-0.5, max(q_lens), ks)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.all(out[1165:] == 0)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_prefill_warm_up_lengths_cover_every_tile_shape(monkeypatch, device):
    """`prefill_tile_lengths` runs one query length per kernel variant the prefill kernel can pick (tile shape and
    whole-tile mode, for steps whose sequences all have that length): every power of two up to 8192 maps to the
    variant of one of them, and no two of them share one (a warm-up forward each)."""
    pytest.importorskip("triton")
    from hf_paged.kernels import triton_prefill

    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    on_cuda = device == "cuda"
    for (heads, kv_heads, head_dim), dtype in itertools.product(
            ((32, 8, 64), (16, 8, 128), (8, 8, 256), (64, 8, 128), (14, 2, 64), (32, 32, 96)),
            (torch.bfloat16, torch.float32)):
        group, elem = heads // kv_heads, dtype.itemsize
        lengths = kernels.prefill_tile_lengths(heads, kv_heads, head_dim, 8192, device, dtype)
        powers = [2 ** i for i in range(1, 14)]
        variants = [(triton_prefill._config(group, head_dim, q, on_cuda, elem),
                     triton_prefill._whole_tiles(head_dim, q, False)) for q in (*lengths, *powers)]
        variants, every = variants[: len(lengths)], variants[len(lengths):]
        assert len(set(variants)) == len(variants) and lengths[0] == 2
        assert set(every) == set(variants)
        shapes = [v[0] for v in variants]
        if dtype == torch.float32:  # twice the bytes a tile: never the 3-stage or the 128 x 256 ones
            assert all(stages == 2 and block_m * triton_prefill.padded_dim(head_dim) <= 128 * 128
                       for block_m, _, _, stages in shapes)
    assert max(kernels.prefill_tile_lengths(8, 8, 64, 40, device)) <= 40  # never longer than a step's budget
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    assert kernels.prefill_tile_lengths(32, 8, 64, 8192, device) == [2]  # nothing to compile
