"""`kernels.write_and_paged_decode`: the decode kernel writes the step's K/V and combines its own splits.

It must equal writing the K/V at their slots followed by `paged_decode`, bit for bit, with the caches left the same: on the Triton path
(interpreter on CPU, tiny shapes; compiled on a GPU) with one or several splits, with and without the split counters
(which every launch must leave at zero), with the attention options, and with rows that write nothing (slot -1).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_paged import kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")),
]


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """The torch backend's reference is not bit-reproducible on the CPU across thread splits: with 2 threads, the first
    call of a process gave other bits than the next in 4 of 10 processes (softcap + sinks case), none with 1 thread.
    The comparisons here are bit for bit, so they run on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _step(seq_lens, hkv=2, g=2, d=16, dv=16, bs=8, dtype=torch.float32, seed=0, device=DEVICE):
    """Caches with shuffled blocks, the new tokens' K/V and slots (at position seq_len - 1 of each row)."""
    gen = torch.Generator().manual_seed(seed)
    per = [-(-n // bs) for n in seq_lens]
    nb = sum(per) + 2
    kc = torch.randn(nb, hkv, bs, d, generator=gen).to(dtype)
    vc = torch.randn(nb, hkv, bs, dv, generator=gen).to(dtype)
    perm = torch.randperm(nb, generator=gen)
    bt = torch.zeros(len(seq_lens), max(per), dtype=torch.int32)
    i = 0
    for s, blocks in enumerate(per):
        bt[s, :blocks] = perm[i : i + blocks].to(torch.int32)
        i += blocks
    slots = torch.tensor([int(bt[s, (n - 1) // bs]) * bs + (n - 1) % bs for s, n in enumerate(seq_lens)],
                         dtype=torch.int32)
    q = torch.randn(len(seq_lens), hkv * g, d, generator=gen).to(dtype)
    k = torch.randn(len(seq_lens), hkv, d, generator=gen).to(dtype)
    v = torch.randn(len(seq_lens), hkv, dv, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(device) for t in (q, k, v, kc, vc, slots, bt, lens)]


def _both(q, k, v, kc, vc, slots, bt, lens, counters=None, **opts):
    """(fused output, its caches), (two-call output, its caches), from copies of the same caches."""
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    fused = kernels.write_and_paged_decode(q, k, v, kc1, vc1, slots, bt, lens, 0.3, split_counters=counters, **opts)
    bs = kc.shape[2]
    for row, slot in enumerate(slots.tolist()):  # what `write_kv` does (which wants the key's head dim in values)
        if slot >= 0:
            kc2[slot // bs, :, slot % bs] = k[row]
            vc2[slot // bs, :, slot % bs] = v[row]
    ref = kernels.paged_decode(q, kc2, vc2, bt, lens, 0.3, **opts)
    return (fused, kc1, vc1), (ref, kc2, vc2)


CASES = [dict(), dict(sliding_window=5), dict(softcap=2.0, sinks=True), dict(chunk_size=8), dict(dv=32),
         dict(kv_start=True), dict(alibi=True), dict(d=24, dv=40)]  # the last: head dims that are no power of two (padded, masked)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) or "plain")
# `make test-fast` runs one split count without counters (the Triton interpreter takes seconds a case)
@pytest.mark.parametrize("splits", [1, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("counters", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fused_equals_write_then_decode(backend, case, splits, counters, monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", backend)
    if backend == "triton":
        from hf_paged.kernels import triton_decode

        monkeypatch.setattr(triton_decode, "FORCE_NUM_SPLITS", splits)
    elif splits > 1 or counters:
        pytest.skip("splits and counters are Triton options")
    # long enough for 3 splits of 64-key tiles (fewer are clamped to what fits); rows 1 and 3 fill one run only, so
    # with counters they take the direct write (no partials), whose bits must still be the combine's
    seq_lens = [200, 5, 130, 1]
    q, k, v, kc, vc, slots, bt, lens = _step(seq_lens, d=case.get("d", 16), dv=case.get("dv", 16))
    opts = {name: case[name] for name in ("sliding_window", "softcap", "chunk_size") if name in case}
    if case.get("sinks"):
        opts["sinks"] = torch.linspace(-1.0, 2.0, q.shape[1], device=DEVICE)
    if case.get("alibi"):
        opts["alibi_slopes"] = torch.linspace(0.5, 0.01, q.shape[1], device=DEVICE)
    if case.get("kv_start"):
        # row 3 starts past its only key: no program reads the new position, split 0 must still write it
        opts["kv_start"] = torch.tensor([3, 0, 100, 1], dtype=torch.int32, device=DEVICE)
    count = torch.zeros(len(seq_lens) * k.shape[1], dtype=torch.int32, device=DEVICE) if counters else None
    if backend == "triton":
        assert triton_decode.default_num_splits(4, k.shape[1], k.shape[2], bt.shape[1] * 8, DEVICE) == splits
    (out, kc1, vc1), (ref, kc2, vc2) = _both(q, k, v, kc, vc, slots, bt, lens, count, **opts)
    assert torch.equal(out, ref)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)
    assert not torch.equal(kc1, kc)  # the new keys were written
    if count is not None:
        assert not count.any(), "the launch must leave its split counters at zero"


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_a_slot_write_nothing(backend, monkeypatch):
    """A row with slot -1 (a CUDA graph's padding) writes nothing and reads the pool as it is, like the two calls."""
    monkeypatch.setenv("HF_PAGED_BACKEND", backend)
    q, k, v, kc, vc, slots, bt, lens = _step([20, 9, 30])
    slots[1] = -1
    (out, kc1, vc1), (ref, kc2, vc2) = _both(q, k, v, kc, vc, slots, bt, lens)
    assert torch.equal(out, ref) and torch.equal(kc1, kc2) and torch.equal(vc1, vc2)
    row = int(bt[1, (9 - 1) // 8])
    assert torch.equal(kc1[row], kc[row]) and torch.equal(vc1[row], vc[row])


def test_bad_arguments_are_named():
    q, k, v, kc, vc, slots, bt, lens = _step([5, 6])
    with pytest.raises(ValueError, match="key/value"):
        kernels.write_and_paged_decode(q, k[:, :1], v, kc, vc, slots, bt, lens, 0.3)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.write_and_paged_decode(q, k, v, kc, vc, slots[:1], bt, lens, 0.3)
    with pytest.raises(TypeError, match="split_counters"):
        kernels.write_and_paged_decode(q, k, v, kc, vc, slots, bt, lens, 0.3,
                                       split_counters=torch.zeros(4, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="split_counters"):  # fewer than batch * KV heads
        kernels.write_and_paged_decode(q, k, v, kc, vc, slots, bt, lens, 0.3,
                                       split_counters=torch.zeros(k.shape[0] * k.shape[1] - 1, dtype=torch.int32,
                                                                  device=DEVICE))
    with pytest.raises(ValueError, match="seq_lens"):
        kernels.write_and_paged_decode(q, k, v, kc, vc, slots, bt, lens[:1], 0.3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_fused_combine_many_splits(dtype, monkeypatch):
    """Compiled on a GPU, GQA 4, D 128, ragged 1-3000-token contexts, the heuristic's split counts (up to 64 splits
    per row, programs racing for the counters): the same bits as the two kernels, counters back at zero, every time."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    seq_lens = [3000, 1, 700, 129, 2048, 64, 1500, 5]
    q, k, v, kc, vc, slots, bt, lens = _step(seq_lens, hkv=2, g=4, d=128, dv=128, bs=16, dtype=dtype, device="cuda")
    count = torch.zeros(len(seq_lens) * 2, dtype=torch.int32, device="cuda")
    for _ in range(20):
        (out, kc1, vc1), (ref, kc2, vc2) = _both(q, k, v, kc, vc, slots, bt, lens, count)
        assert torch.equal(out, ref) and torch.equal(kc1, kc2) and torch.equal(vc1, vc2)
        assert not count.any()
