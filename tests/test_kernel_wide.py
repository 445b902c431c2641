"""Heads wider than 256 values in the Triton kernels (`hf_paged.kernels.triton_wide`): multi-head latent attention's
576-value latent read by 16+ query heads with the values a view of the keys, and Gemma 4's 512-value heads.

Triton runs under its interpreter on the CPU (tiny shapes, float32) and must equal the torch reference to float32
rounding. Slots no query may see hold NaN (except in the FP8 cache), so a kernel that read them would fail.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_paged import kernels  # noqa: E402
from hf_paged.kernels import reference  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BS = 8
SCALE = 576 ** -0.5


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")


def _cache(seq_lens, hkv, dk, dv, shared, visible_from=None, seed=0):
    """Paged K/V with shuffled blocks: `shared`, the values are the keys' first `dv` columns (a view, MLA's latent);
    slots before `visible_from[s]` or past a sequence hold NaN."""
    g = torch.Generator().manual_seed(seed)
    per = [-(-n // BS) for n in seq_lens]
    nb = sum(per) + 2
    kc = torch.full((nb, hkv, BS, dk), float("nan"))
    vc = None if shared else torch.full((nb, hkv, BS, dv), float("nan"))
    perm = torch.randperm(nb, generator=g)
    bt = torch.zeros(len(seq_lens), max(per) + 1, dtype=torch.int32)
    i = 0
    for s, n in enumerate(seq_lens):
        blocks = perm[i:i + per[s]]
        i += per[s]
        bt[s, :per[s]] = blocks.to(torch.int32)
        for t in range(visible_from[s] if visible_from else 0, n):
            kc[blocks[t // BS], :, t % BS] = torch.randn(hkv, dk, generator=g)
            if vc is not None:
                vc[blocks[t // BS], :, t % BS] = torch.randn(hkv, dv, generator=g)
    kc = kc.to(DEVICE)
    vc = kc[..., :dv] if shared else vc.to(DEVICE)
    return kc, vc, bt.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


def _close(out, ref):
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu(), ref.cpu(), atol=2e-5, rtol=1e-4)


def _query(rows, heads, d, seed=1):
    return torch.randn(rows, heads, d, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("hkv,g,dk,dv,shared,splits", [
    (1, 16, 576, 512, True, 1),  # DeepSeek-V2-Lite's latent: 16 query heads, values = the keys' first 512 columns
    (1, 16, 576, 512, True, 3),
    (1, 20, 576, 512, True, 3),  # two head blocks (16 + 4 heads), the separate combine
    (2, 2, 512, 512, False, 3),  # Gemma 4's global layers: 512-value heads, GQA 2:1
    (1, 16, 576, 448, True, 1),  # a narrower view: the main key tile reused, its last lanes not stored
    (1, 16, 576, 200, True, 2),  # a view narrower than the main tile: loaded on its own, at the key's stride
    (1, 40, 576, 512, True, 2),  # blocks of 32 heads (32 + 8), as a sweep may ask
])
def test_decode_wide(hkv, g, dk, dv, shared, splits):
    seq_lens, starts = [70, 5, 33], [0, 2, 3]
    kc, vc, bt, sl = _cache(seq_lens, hkv, dk, dv, shared, starts)
    ks = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    q = _query(len(seq_lens), hkv * g, dk)
    from hf_paged.kernels import triton_decode_wide, triton_wide

    assert triton_wide.values_are_keys(kc, vc) == (shared and dv > 256)
    assert triton_decode_wide._launch_splits(splits, 3, hkv, bt.shape[1] * BS, 32, DEVICE) == splits
    if g > 32:
        out = triton_decode_wide.paged_decode(q, kc, vc, bt, sl, SCALE, ks, num_splits=splits, block_h=32)
    else:
        out = kernels.paged_decode(q, kc, vc, bt, sl, SCALE, ks, _num_splits=splits)
    assert out.shape == (3, hkv * g, dv)
    _close(out, reference.paged_decode(q, kc, vc, bt, sl, SCALE, ks))


@pytest.mark.parametrize("g", [16, 20])
def test_write_and_decode_wide_split_counters(g, monkeypatch):
    """The fused K/V write and, with one head block, the in-kernel combine; with two, the combine kernel (the
    counters stay zero either way). The new value is the new key's first columns, written through the view."""
    seq_lens = [41, 9]
    kc, vc, bt, sl = _cache(seq_lens, 1, 576, 512, True, [0, 0])
    slots = torch.stack([bt[i, (n - 1) // BS].long() * BS + (n - 1) % BS for i, n in enumerate(seq_lens)])
    kc[slots // BS, :, slots % BS] = float("nan")  # the step's own slot: written by the launch before it is read
    k_new = _query(2, 1, 576, seed=3)
    q = _query(2, g, 576)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    from hf_paged.kernels import triton_decode

    kc_ref = kc.clone()
    monkeypatch.setattr(triton_decode, "FORCE_NUM_SPLITS", 2)
    out = kernels.write_and_paged_decode(q, k_new, k_new[..., :512], kc, vc, slots, bt, sl, SCALE,
                                         split_counters=counters)
    reference.write_kv(k_new, k_new[..., :512], kc_ref, kc_ref[..., :512], slots)
    torch.testing.assert_close(kc, kc_ref, equal_nan=True)
    _close(out, reference.paged_decode(q, kc_ref, kc_ref[..., :512], bt, sl, SCALE))
    assert not counters.any()


@pytest.mark.parametrize("hkv,g,dk,dv,shared,block_m", [
    (1, 16, 576, 512, True, None),
    (1, 20, 576, 512, True, 16),  # two head blocks of one token each
    (2, 2, 512, 512, False, None),
    (1, 16, 576, 200, True, None),
])
def test_prefill_wide_with_prefix(hkv, g, dk, dv, shared, block_m):
    """Chunked prefill: new queries after a cached prefix, and a left-padded fresh prompt."""
    seq_lens, q_lens, starts = [30, 11], [6, 9], [0, 2]
    kc, vc, bt, sl = _cache(seq_lens, hkv, dk, dv, shared, starts)
    ks = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=DEVICE)
    q = _query(15, hkv * g, dk)
    if block_m is None:
        out = kernels.paged_prefill(q, kc, vc, bt, cu, sl, SCALE, 9, ks)
    else:
        from hf_paged.kernels import triton_prefill_wide

        out = triton_prefill_wide.paged_prefill(q, kc, vc, bt, cu, sl, SCALE, 9, ks, block_m=block_m)
    _close(out, reference.paged_prefill(q, kc, vc, bt, cu, sl, SCALE, 9, ks))


def _features(hq):
    return dict(sliding_window=7, softcap=3.0, sinks=torch.linspace(-1.0, 2.0, hq, device=DEVICE),
                alibi_slopes=torch.linspace(0.5, 0.01, hq, device=DEVICE))


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_wide_window_softcap_sinks_alibi(kind):
    """Gemma 4's global layer options at a wide head (window, softcap) with sinks and ALiBi; blocks before the window
    hold NaN, so a read of them would show."""
    hkv, g = 2, 2
    opts = _features(hkv * g)
    if kind == "decode":
        seq_lens = [40, 6]
        kc, vc, bt, sl = _cache(seq_lens, hkv, 512, 512, False, [max(0, n - 7) for n in seq_lens])
        q = _query(2, hkv * g, 512)
        out = kernels.paged_decode(q, kc, vc, bt, sl, SCALE, _num_splits=2, **opts)
        ref = reference.paged_decode(q, kc, vc, bt, sl, SCALE, **opts)
    else:
        seq_lens, q_lens = [30, 12], [5, 12]
        kc, vc, bt, sl = _cache(seq_lens, hkv, 512, 512, False, [30 - 5 - 6, 0])
        cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=DEVICE)
        q = _query(17, hkv * g, 512)
        out = kernels.paged_prefill(q, kc, vc, bt, cu, sl, SCALE, 12, **opts)
        ref = reference.paged_prefill(q, kc, vc, bt, cu, sl, SCALE, 12, **opts)
    _close(out, ref)


def test_wide_chunked_attention_decode_and_prefill():
    seq_lens = [27, 13]
    kc, vc, bt, sl = _cache(seq_lens, 1, 576, 512, True)
    q = _query(2, 16, 576)
    _close(kernels.paged_decode(q, kc, vc, bt, sl, SCALE, chunk_size=8),
           reference.paged_decode(q, kc, vc, bt, sl, SCALE, chunk_size=8))
    cu = torch.tensor([0, 4, 17], dtype=torch.int32, device=DEVICE)
    q = _query(17, 16, 576)
    _close(kernels.paged_prefill(q, kc, vc, bt, cu, sl, SCALE, 13, chunk_size=8),
           reference.paged_prefill(q, kc, vc, bt, cu, sl, SCALE, 13, chunk_size=8))


def test_wide_fp8_cache():
    """An FP8 latent (one scale, the values a view of the keys): written by the fused decode write, read by decode
    and prefill, as the torch reference writes and reads it."""
    seq_lens = [21, 10]
    kc32, _, bt, sl = _cache(seq_lens, 1, 576, 512, True)
    kc32 = torch.nan_to_num(kc32)
    scale = torch.tensor([0.02], device=DEVICE)
    kc = (kc32 / scale).clamp(-448, 448).to(kernels.FP8_DTYPE)
    vc = kc[..., :512]
    kc_ref = kc.clone()
    slots = torch.stack([bt[i, (n - 1) // BS].long() * BS + (n - 1) % BS for i, n in enumerate(seq_lens)])
    k_new = _query(2, 1, 576, seed=4)
    q = _query(2, 16, 576)
    out = kernels.write_and_paged_decode(q, k_new, k_new[..., :512], kc, vc, slots, bt, sl, SCALE, k_scale=scale,
                                         v_scale=scale)
    reference.write_kv(k_new, k_new[..., :512], kc_ref, kc_ref[..., :512], slots, k_scale=scale, v_scale=scale)
    assert torch.equal(kc.view(torch.uint8), kc_ref.view(torch.uint8))
    _close(out, reference.paged_decode(q, kc_ref, kc_ref[..., :512], bt, sl, SCALE, k_scale=scale, v_scale=scale))
    cu = torch.tensor([0, 3, 10], dtype=torch.int32, device=DEVICE)
    q = _query(10, 16, 576)
    _close(kernels.paged_prefill(q, kc, vc, bt, cu, sl, SCALE, 7, k_scale=scale, v_scale=scale),
           reference.paged_prefill(q, kc, vc, bt, cu, sl, SCALE, 7, k_scale=scale, v_scale=scale))


def test_wide_dims_taken_up_to_1024():
    from hf_paged.kernels import checks

    assert checks.triton_dims_refusal(576, 128, 2) is None and checks.triton_dims_refusal(1024, 1, 4) is None
    assert "1024, got 1040" in checks.triton_dims_refusal(1040)
    assert checks.triton_wide_heads(576, 512) and checks.triton_wide_heads(128, 512)
    assert not checks.triton_wide_heads(256, 256) and not checks.triton_wide_heads(192, 128)


def test_wide_launch_helpers():
    """The warm-up helpers ask the wide kernels' tiles; a latent view counts as the keys only when it is one."""
    from hf_paged.kernels import triton_decode_wide, triton_prefill_wide, triton_wide

    assert triton_wide.key_split(576) == (512, 64)
    assert triton_wide.key_split(512) == (512, 0)
    assert triton_wide.key_split(1024) == (512, 512)
    assert triton_wide.key_split(128) == (128, 0)
    kc = torch.zeros(3, 1, 8, 576)
    assert triton_wide.values_are_keys(kc, kc[..., :512])
    assert not triton_wide.values_are_keys(kc, kc[..., :512].clone())
    assert not triton_wide.values_are_keys(kc, kc[..., 64:])  # another start: not the main tile
    # float32 (and more than 32 query heads) take the wide kernels; 16-bit MLA with up to 32 heads the narrow ones'
    # small tiles (`checks.small_tile_heads`), whose prefill tile holds 64 rows over the group
    assert kernels.prefill_query_tile(16, 1, 576, "cpu", torch.float32) == 1
    assert kernels.prefill_tile_lengths(16, 1, 576, 64, "cpu", torch.float32) == [2]  # one tile for every length
    assert kernels.prefill_query_tile(64, 1, 576, "cpu", torch.bfloat16) == 1
    assert kernels.prefill_query_tile(16, 1, 576, "cpu", torch.bfloat16) == 4
    assert kernels.prefill_tile_lengths(16, 1, 576, 64, "cpu", torch.bfloat16) == [2, 4]
    assert kernels.decode_variant(4, 16, 1, 576, 4096, "cpu", 512) == (False, False)  # no splits off the GPU
    assert triton_decode_wide._config(576, 512) == (16, 32, 8, 2)
    assert triton_prefill_wide._config(16, 576, 512, True) == (32, 32, 8, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hkv,g,dk,dv,latent", [(1, 16, 576, 512, True), (1, 128, 576, 512, True),
                                                (2, 8, 512, 512, False)])
def test_cuda_wide_realistic(hkv, g, dk, dv, latent):
    """bf16 on the GPU at the real widths (DeepSeek-V2-Lite's and V3's latent, a Gemma 4 global layer): the tiles
    compile (shared memory, registers) and agree with the torch reference, decode (heuristic splits, split counters,
    the fused write, an FP8 latent) and prefill after a cached prefix."""
    torch.manual_seed(0)
    seq_lens = [1000, 37, 517, 2048]
    bs = 16
    per = [-(-n // bs) for n in seq_lens]
    nb = sum(per)
    kc = torch.randn(nb, hkv, bs, dk, device="cuda", dtype=torch.bfloat16)
    vc = kc[..., :dv] if latent else torch.randn(nb, hkv, bs, dv, device="cuda", dtype=torch.bfloat16)
    bt = torch.zeros(len(seq_lens), max(per), dtype=torch.int32, device="cuda")
    perm, i = torch.randperm(nb, device="cuda").to(torch.int32), 0
    for s, n in enumerate(per):
        bt[s, :n] = perm[i:i + n]
        i += n
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(seq_lens), hkv * g, dk, device="cuda", dtype=torch.bfloat16)
    opts = {} if latent else dict(sliding_window=300, softcap=30.0)
    counters = torch.zeros(64, dtype=torch.int32, device="cuda")
    out = kernels.paged_decode(q, kc, vc, bt, sl, SCALE, split_counters=counters, **opts)
    ref = reference.paged_decode(q, kc, vc, bt, sl, SCALE, **opts)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert not counters.any()
    if latent:  # an FP8 latent, one scale for keys and values
        scale = kc.float().abs().amax().reshape(1) / 448.0
        kc8 = (kc.float() / scale).to(kernels.FP8_DTYPE)
        out = kernels.paged_decode(q, kc8, kc8[..., :dv], bt, sl, SCALE, k_scale=scale, v_scale=scale)
        ref = reference.paged_decode(q, kc8, kc8[..., :dv], bt, sl, SCALE, k_scale=scale, v_scale=scale)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    q_lens = [200, 37, 17, 64]  # new queries after cached prefixes (and one fresh prompt)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), hkv * g, dk, device="cuda", dtype=torch.bfloat16)
    out = kernels.paged_prefill(q, kc, vc, bt, cu, sl, SCALE, max(q_lens), **opts)
    ref = reference.paged_prefill(q, kc, vc, bt, cu, sl, SCALE, max(q_lens), **opts)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
