"""Attention options of the paged kernels: sliding window, soft-capping, sinks, chunked attention, ALiBi, Dv != Dk,
head dims that are no power of two.

Each case checks Triton (interpreter on CPU, tiny shapes) == torch reference == a dense float64 oracle
(``reference.naive_attention``, an explicit softmax over a dense mask written the way transformers'
``masking_utils`` writes it). Slots a query may not see (before its window / chunk, padding) hold NaN, so a
kernel that read them would fail: for decode, that covers "blocks before the window are not read".
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_paged import kernels  # noqa: E402
from hf_paged.kernels import reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")),
]
BS = 8
HKV, G = 2, 2


@pytest.fixture
def backend(request, monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", request.param)
    return request.param


def _make(seq_lens, starts, dk, dv, first_visible, seed=0):
    """Paged K/V with shuffled blocks; slots outside ``[first_visible[s], seq_len)`` are NaN."""
    g = torch.Generator().manual_seed(seed)
    per = [-(-n // BS) for n in seq_lens]
    nb = sum(per) + 3
    kc = torch.full((nb, HKV, BS, dk), float("nan"))
    vc = torch.full((nb, HKV, BS, dv), float("nan"))
    perm = torch.randperm(nb, generator=g)
    bt = torch.zeros(len(seq_lens), max(per) + 1, dtype=torch.int32)
    i = 0
    for s, n in enumerate(seq_lens):
        blocks = perm[i : i + per[s]]
        i += per[s]
        bt[s, : per[s]] = blocks.to(torch.int32)
        for t in range(max(first_visible[s], starts[s]), n):
            kc[blocks[t // BS], :, t % BS] = torch.randn(HKV, dk, generator=g)
            vc[blocks[t // BS], :, t % BS] = torch.randn(HKV, dv, generator=g)
    to = dict(device=DEVICE)
    return (kc.to(**to), vc.to(**to), bt.to(**to), torch.tensor(seq_lens, dtype=torch.int32, **to),
            torch.tensor(starts, dtype=torch.int32, **to))


def _close(out, ref, what):
    assert not torch.isnan(out).any(), f"{what}: NaN in output"
    torch.testing.assert_close(out.double().cpu(), ref.double().cpu(), atol=3e-4, rtol=1e-4, msg=lambda m: f"{what}: {m}")


CASES = [
    dict(sliding_window=5),
    dict(softcap=2.0),
    dict(sinks=True),
    dict(chunk_size=8),
    dict(chunk_size=6),
    dict(dv=32),
    dict(sliding_window=9, softcap=3.0, sinks=True),
    dict(chunk_size=8, sinks=True, dv=32),
    dict(sliding_window=1),
    dict(dk=24),  # head dims that are no power of two: computed in padded tiles, the lanes past them masked
    dict(dk=24, dv=40, sliding_window=9, sinks=True),
    dict(alibi=True),
    dict(alibi=True, sliding_window=9, softcap=3.0, sinks=True),
    dict(alibi=True, chunk_size=8, dk=24),
]


def _opts(case):
    opts = {k: v for k, v in case.items() if k in ("sliding_window", "softcap", "chunk_size")}
    if case.get("sinks"):
        opts["sinks"] = torch.linspace(-1.0, 2.0, HKV * G, device=DEVICE)
    if case.get("alibi"):  # BLOOM's slopes for 4 heads, and one of 0.5 that makes 150 keys span 75 logits
        opts["alibi_slopes"] = torch.tensor([0.5, 2 ** -4, 2 ** -6, 2 ** -8], device=DEVICE)[: HKV * G]
    return opts


def _first_visible(n, start, pos, opts):
    lo = start
    if opts.get("sliding_window"):
        lo = max(lo, pos - opts["sliding_window"] + 1)
    if opts.get("chunk_size"):
        lo = start + (max(pos - start, 0) // opts["chunk_size"]) * opts["chunk_size"]
    return lo


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("splits", [1, pytest.param(3, marks=pytest.mark.slow)])  # 3 splits: the full suite
def test_decode_features(backend, case, splits):
    if splits > 1 and backend == "torch":
        pytest.skip("split-K is a Triton option")
    dk, dv = case.get("dk", 16), case.get("dv", 16)
    opts = _opts(case)
    seq_lens, starts = [150, 5, 70, 1], [0, 2, 3, 0]  # 150 keys: 3 splits of 64-key tiles fit (fewer are clamped)
    vis = [_first_visible(n, st, n - 1, opts) for n, st in zip(seq_lens, starts)]
    kc, vc, bt, sl, ks = _make(seq_lens, starts, dk, dv, vis)
    q = torch.randn(len(seq_lens), HKV * G, dk, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    extra = {"_num_splits": splits} if backend == "triton" else {}
    if backend == "triton":  # the forced count is what runs, not clamped to fewer tiles
        from hf_paged.kernels import triton_decode

        assert triton_decode._launch_splits(splits, 4, HKV, bt.shape[1] * BS, 64, DEVICE) == splits
    out = kernels.paged_decode(q, kc, vc, bt, sl, 0.3, ks, **opts, **extra)
    ref = reference.paged_decode(q, kc, vc, bt, sl, 0.3, ks, **opts)
    naive = reference.naive_paged_decode(q, kc, vc, bt, sl, 0.3, ks, **opts)
    assert out.shape == (len(seq_lens), HKV * G, dv)
    _close(ref, naive, "reference vs naive")
    _close(out, naive, f"{backend} vs naive")


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_prefill_features(backend, case):
    dk, dv = case.get("dk", 16), case.get("dv", 16)
    opts = _opts(case)
    # (cached prefix + new tokens): a long fresh prompt, a chunked-prefill continuation, a left-padded row
    seq_lens, q_lens, starts = [29, 26, 13], [29, 7, 10], [0, 0, 4]
    vis = [_first_visible(n, st, n - ql, opts) for n, ql, st in zip(seq_lens, q_lens, starts)]
    kc, vc, bt, sl, ks = _make(seq_lens, starts, dk, dv, vis)
    T = sum(q_lens)
    q = torch.randn(T, HKV * G, dk, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    out = kernels.paged_prefill(q, kc, vc, bt, cu, sl, 0.3, max(q_lens), ks, **opts)
    ref = reference.paged_prefill(q, kc, vc, bt, cu, sl, 0.3, max(q_lens), ks, **opts)
    naive = reference.naive_paged_prefill(q, kc, vc, bt, cu, sl, 0.3, max(q_lens), ks, **opts)
    assert out.shape == (T, HKV * G, dv)
    _close(ref, naive, "reference vs naive")
    _close(out, naive, f"{backend} vs naive")


WHOLE_TILE_CASES = [
    dict(),
    dict(sliding_window=100),
    dict(sliding_window=70, softcap=3.0, sinks=True),
    dict(chunk_size=64),  # a chunked layer keeps every tile masked
    dict(dk=24, dv=40, sliding_window=130),
    dict(alibi=True),
    dict(alibi=True, softcap=3.0, sliding_window=100),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", WHOLE_TILE_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) or "causal")
def test_prefill_whole_key_tiles(case, monkeypatch):
    """Prompts long enough that most key tiles are seen whole by every row of a query tile, which the Triton kernel
    reads without masks (`triton_prefill._prefill_tile`): a fresh prompt, one over a cached prefix with a kv_start
    that is no multiple of the key tile, one short. Slots no row may see hold NaN, so an unmasked tile that reached
    past the window or below kv_start would fail."""
    if not kernels.triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    dk, dv = case.get("dk", 16), case.get("dv", 16)
    opts = _opts(case)
    seq_lens, q_lens, starts = [300, 250, 90], [300, 120, 90], [0, 37, 5]
    vis = [_first_visible(n, st, n - ql, opts) for n, ql, st in zip(seq_lens, q_lens, starts)]
    kc, vc, bt, sl, ks = _make(seq_lens, starts, dk, dv, vis, seed=3)
    T = sum(q_lens)
    q = torch.randn(T, HKV * G, dk, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    out = kernels.paged_prefill(q, kc, vc, bt, cu, sl, 0.3, max(q_lens), ks, **opts)
    naive = reference.naive_paged_prefill(q, kc, vc, bt, cu, sl, 0.3, max(q_lens), ks, **opts)
    _close(out, naive, "triton vs naive")


def test_naive_matches_transformers_masks_and_eager_sinks():
    """The oracle's mask equals transformers' sliding-window / chunked mask functions; its sinks equal gpt-oss eager."""
    from transformers.masking_utils import and_masks, causal_mask_function, chunked_overlay, sliding_window_overlay

    L, W, C, pad = 12, 4, 5, 2
    for overlay, opts in ((sliding_window_overlay(W), dict(sliding_window=W)),
                          (chunked_overlay(C, torch.tensor([pad])), dict(chunk_size=C))):
        fn = and_masks(causal_mask_function, overlay)
        t = torch.tensor
        want = torch.tensor([[bool(fn(t(0), t(0), t(a), t(b))) and b >= pad for b in range(L)] for a in range(L)])
        # probe the oracle's mask with one-hot values: output j is nonzero iff key j is visible
        q = torch.zeros(L, 1, 1)
        k = torch.zeros(L, 1, 1)
        v = torch.eye(L).reshape(L, 1, L)
        got = reference.naive_attention(q, k, v, 1.0, list(range(L)), kv_start=pad, **opts)[:, 0] > 0
        assert torch.equal(got, want), opts
    # sinks: softmax over [logits, sink] with the sink column dropped (gpt-oss eager_attention_forward)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 2, 16, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    got = reference.naive_attention(q, k, v, 0.25, list(range(6)), sinks=sinks)
    logits = torch.einsum("qhd,khd->hqk", q, k) * 0.25
    logits = logits.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    comb = torch.cat([logits, sinks.reshape(2, 1, 1).expand(2, 6, 1)], -1).softmax(-1)[..., :-1]
    torch.testing.assert_close(got, torch.einsum("hqk,khd->qhd", comb, v))


def test_bad_options_named():
    kc, vc, bt, sl, ks = _make([4], [0], 16, 16, [0])
    q = torch.randn(1, HKV * G, 16, device=DEVICE)
    with pytest.raises(ValueError, match="sliding_window"):
        kernels.paged_decode(q, kc, vc, bt, sl, 1.0, sliding_window=0)
    with pytest.raises(TypeError, match="chunk_size"):
        kernels.paged_decode(q, kc, vc, bt, sl, 1.0, chunk_size=2.5)
    with pytest.raises(ValueError, match="softcap"):
        kernels.paged_decode(q, kc, vc, bt, sl, 1.0, softcap=-1.0)
    with pytest.raises(ValueError, match="sinks"):
        kernels.paged_decode(q, kc, vc, bt, sl, 1.0, sinks=torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="alibi_slopes"):
        kernels.paged_decode(q, kc, vc, bt, sl, 1.0, alibi_slopes=torch.zeros(3, device=DEVICE))
    with pytest.raises(TypeError, match="alibi_slopes"):
        kernels.paged_prefill(q, kc, vc, bt, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), sl, 1.0, 1,
                              alibi_slopes=torch.zeros(HKV * G, dtype=torch.long, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("opts", [dict(sliding_window=100), dict(softcap=20.0, sliding_window=300),
                                  dict(sinks=True, sliding_window=64), dict(chunk_size=256), dict(alibi=True)],
                         ids=str)
def test_cuda_features_realistic(opts, dtype, monkeypatch):
    """Compiled Triton on CUDA, GQA 8, D 128, 1000-token contexts, split-K on: == the float64 oracle."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    opts = dict(opts)
    g = torch.Generator(device="cuda").manual_seed(0)
    hkv, hq, d, bs, n = 2, 16, 128, 16, 1000
    if opts.pop("sinks", False):
        opts["sinks"] = torch.randn(hq, device="cuda", generator=g)
    if opts.pop("alibi", False):  # BLOOM's slopes for 16 heads
        opts["alibi_slopes"] = 2.0 ** -(0.5 * torch.arange(1, hq + 1, device="cuda"))
    nb = 3 * (-(-n // bs))
    kc = torch.randn(nb, hkv, bs, d, device="cuda", generator=g).to(dtype)
    vc = torch.randn(nb, hkv, bs, d, device="cuda", generator=g).to(dtype)
    bt = torch.randperm(nb, device="cuda", generator=g)[: 2 * (-(-n // bs))].reshape(2, -1).to(torch.int32)
    sl = torch.tensor([n, n - 333], dtype=torch.int32, device="cuda")
    q = torch.randn(2, hq, d, device="cuda", generator=g).to(dtype)
    tol = dict(atol=3e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=3e-4, rtol=1e-4)
    for splits in (1, 4):
        out = kernels.paged_decode(q, kc, vc, bt, sl, d**-0.5, _num_splits=splits, **opts)
        naive = reference.naive_paged_decode(q, kc, vc, bt, sl, d**-0.5, **opts)
        torch.testing.assert_close(out.double(), naive, **tol)
    qp = torch.randn(n, hq, d, device="cuda", generator=g).to(dtype)
    cu = torch.tensor([0, 600, n], dtype=torch.int32, device="cuda")  # 600 new tokens, then 400 over a prefix
    sl = torch.tensor([600, n], dtype=torch.int32, device="cuda")
    out = kernels.paged_prefill(qp, kc, vc, bt, cu, sl, d**-0.5, 600, **opts)
    naive = reference.naive_paged_prefill(qp, kc, vc, bt, cu, sl, d**-0.5, 600, **opts)
    torch.testing.assert_close(out.double(), naive, **tol)
