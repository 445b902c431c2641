"""The sampler's top-k fast path (`top_k_bound`): the same tokens as the full sampler, token for token. Its torch
version (`reference_sampling.sample_top_k` / `candidate_tokens`) against the reference on random rows of every float
type, k, temperature and top-p / min-p combination, and on rows built to tie at the k-th value (inside the candidate
list and past its end), at the maximum, with zeros, NaN and infinities; the Triton candidate kernel against the torch
version and the whole Triton path against the reference under the interpreter (small shapes); the host's choice
(`top_k_bound`) and the engine's picker."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hf_paged  # noqa: E402
from hf_paged.engine.device_sampling import DevicePicker  # noqa: E402
from hf_paged.kernels import reference_sampling, sampling  # noqa: E402
from hf_paged.kernels.sampling import (  # noqa: E402
    TOP_K_MAX,
    candidate_count,
    effective_top_k,
    inverse_temperature,
    sample_tokens,
    top_k_bound,
)
from hf_paged.testing import tiny_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (the interpreter only runs without a GPU)


def _rows(rows, vocab, dtype, seed, k_max=40, spread=None):
    """Random rows and normalised parameters: greedy rows (every 7th), top-k 1..k_max, top-p on for half the rows,
    min-p for a third, temperatures from tiny to 2; every other call rounds the logits (ties everywhere)."""
    g = torch.Generator().manual_seed(seed)
    scale = float(torch.rand(1, generator=g)) * 4 + 0.05 if spread is None else spread
    logits = torch.randn(rows, vocab, generator=g) * scale
    if seed % 2:
        logits = logits.round()
    temp = torch.rand(rows, generator=g) * 2
    temp[::7] = 0.0
    temp[3::11] = 1e-3
    inv_t = torch.from_numpy(inverse_temperature(temp.numpy()))
    k = torch.randint(1, k_max + 1, (rows,), generator=g)
    k = torch.from_numpy(effective_top_k(k.numpy(), vocab))
    p = torch.where(torch.rand(rows, generator=g) < 0.5, torch.rand(rows, generator=g), torch.ones(rows))
    mp = torch.rand(rows, generator=g) * 0.3
    log_mp = torch.where(torch.rand(rows, generator=g) < 0.3, torch.log(mp), torch.full((rows,), -float("inf")))
    s = torch.randint(0, 2**40, (rows,), generator=g)
    off = torch.randint(0, 2**34, (rows,), generator=g)
    return logits.to(dtype), [inv_t, k, p, log_mp, s, off]


def _candidates(logits, params, count):
    values, indices = logits.topk(count, dim=1)
    return reference_sampling.candidate_tokens(values, indices, logits.shape[1], *params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [0, 1])
def test_fast_path_gives_the_reference_tokens(dtype, seed):
    """Random rows: the fast path's tokens are the reference's, the candidates decide most rows, and every token
    they decide is the reference's."""
    logits, params = _rows(48, 300, dtype, seed)
    want = reference_sampling.sample_tokens(logits, *params)
    bound = top_k_bound(params[0].numpy(), params[1].numpy())
    assert 0 < bound <= 40
    got = reference_sampling.sample_top_k(logits, *params, candidate_count(bound, 300))
    assert torch.equal(got, want), (got != want).nonzero()
    decided = _candidates(logits, params, candidate_count(bound, 300))
    assert int((decided >= 0).sum()) >= 40
    assert torch.equal(decided[decided >= 0], want[decided >= 0])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fast_path_sweep(dtype):
    """More rows, k up to `TOP_K_MAX` (candidate lists of 512 and the whole vocabulary), flat and wide rows."""
    for seed, vocab, k_max, spread in ((2, 600, TOP_K_MAX, None), (3, 700, 64, 0.02), (4, 300, 200, 30.0)):
        logits, params = _rows(40, vocab, dtype, seed, k_max, spread)
        want = reference_sampling.sample_tokens(logits, *params)
        count = candidate_count(top_k_bound(params[0].numpy(), params[1].numpy()), vocab)
        assert torch.equal(reference_sampling.sample_top_k(logits, *params, count), want)


def _params(rows, inv_t, k, p=1.0, log_min_p=-float("inf")):
    def col(v, dtype):
        return torch.as_tensor(v if isinstance(v, (list, tuple)) else [v] * rows, dtype=dtype)
    return [col(inv_t, torch.float32), col(k, torch.int32), col(p, torch.float32), col(log_min_p, torch.float32),
            torch.arange(rows, dtype=torch.long) * 977 + 5, torch.arange(rows, dtype=torch.long) + 40]


def _tied_rows(vocab=64):
    """Rows with a tie at the 4th largest value that ends inside 8 candidates, one that reaches past them, ties at
    the maximum (k = 1 and greedy), and the same after a temperature that merges neighbours (x * inv_t rounds two
    values to one)."""
    base = -torch.arange(vocab, dtype=torch.float32) * 0.25 - 5.0  # distinct, falling
    inside = base.clone()
    inside[[3, 4, 5]] = float(inside[3])  # 4th..6th tied: the top-4 set has 6 tokens
    past = base.clone()
    past[3:20] = float(past[3])  # 4th..20th tied: past a list of 8
    at_max = base.clone()
    at_max[[0, 9, 30]] = 1.0  # three maxima, not adjacent in index
    rows = torch.stack([inside, past, at_max, at_max, inside[torch.randperm(vocab, generator=torch.Generator()
                                                                                        .manual_seed(0))]])
    merged = base - 2.0  # -7.0, -7.25, -7.5, ...
    v = merged[2].clone()  # two neighbours near -7.5 that `_MERGE` scales to one value: the 3rd and 4th tie in x
    while not bool(v * _MERGE == v.nextafter(torch.tensor(-1e9)) * _MERGE):
        v = v.nextafter(torch.tensor(-1e9))
    merged[2], merged[3] = v, v.nextafter(torch.tensor(-1e9))
    return torch.cat([rows, merged[None]])


_MERGE = torch.tensor(1 / 1.4, dtype=torch.float32)  # an inverse temperature (1.4) that rounds neighbours together


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_at_the_boundary_and_the_maximum(dtype):
    logits = _tied_rows().to(dtype)
    rows = logits.shape[0]
    for inv_t, k, p in ((1.0, 4, 1.0), (1.0, 4, 0.6), (3.0, 4, 1.0), (1.0, 1, 1.0), (0.0, 4, 1.0),
                        (float(_MERGE), 3, 1.0), (float(_MERGE), 3, 0.9)):
        params = _params(rows, inv_t, k, p)
        want = reference_sampling.sample_tokens(logits, *params)
        assert torch.equal(reference_sampling.sample_top_k(logits, *params, 8), want), (inv_t, k, p)
        decided = _candidates(logits, params, 8)
        assert torch.equal(decided[decided >= 0], want[decided >= 0])
        if k == 4 and inv_t == 1.0:  # the tie inside the list is decided there, the one past it is not
            assert decided[0] >= 0 and decided[4] >= 0 and decided[1] == -1
        if inv_t == 0.0:  # greedy: the least index of the tied maxima, decided inside the list
            assert decided[2] == decided[3] == want[2] == 0
        if inv_t == float(_MERGE) and dtype == torch.float32:  # distinct logits, tied once scaled: 4 kept for k = 3
            x = logits[5:].float() * inv_t
            threshold = reference_sampling.kept_threshold(logits[5:], *(t[5:] for t in params[:3]))
            kept = reference_sampling.float_key(x) >= threshold
            assert int(kept.sum()) == 4 and decided[5] >= 0
    # many draws of the tied row: every kept token of the tie (and nothing else) comes up
    many = logits[:1].expand(400, -1)
    params = _params(400, 1.0, 4)
    params[4] = torch.arange(400, dtype=torch.long)
    tokens = reference_sampling.sample_top_k(many, *params, 8)
    assert set(tokens.tolist()) == {0, 1, 2, 3, 4, 5}
    assert torch.equal(tokens, reference_sampling.sample_tokens(many, *params))


def test_zeros_nan_and_infinities_fall_back():
    """Values the key domain orders differently from floats (zeros), NaN and infinite maxima are left to the full
    sampler: the tokens stay the reference's."""
    vocab = 40
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(6, vocab, generator=g).abs() + 1.0
    rows[0, :5] = -rows[0, :5]
    rows[0] = -rows[0].abs()
    rows[0, 7] = 0.0
    rows[0, 8] = -0.0  # the maximum is a zero
    rows[1, 3] = float("nan")
    rows[2, 5] = float("inf")
    rows[3, :] = -float("inf")
    rows[3, 2] = 0.5  # one finite token; the k-th is -inf
    rows[4, 10] = 3e38  # overflows to inf after the temperature
    rows[5, 0] = 9.0  # a clean row: decided
    params = _params(6, [1.0, 1.0, 1.0, 1.0, 2.0, 1.0], 3, 0.9)
    want = reference_sampling.sample_tokens(rows, *params)
    decided = _candidates(rows, params, 8)
    assert decided[:5].tolist() == [-1] * 5 and decided[5] >= 0
    assert torch.equal(reference_sampling.sample_top_k(rows, *params, 8), want)
    # greedy rows: a NaN row and an all -inf row fall back too
    params[0] = torch.zeros(6)
    assert torch.equal(reference_sampling.sample_top_k(rows, *params, 8), rows.argmax(1))


def test_dispatch_and_bound(monkeypatch):
    """`sample_tokens(..., top_k_bound=...)` on the torch backend: the fast path's tokens are the plain call's for
    the right bound, a bound below some row's k (that row falls back) and a row with top-k off; the bound is read on
    the host from the sampled rows only."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    logits, params = _rows(24, 200, torch.float32, 5, k_max=20)
    temperature = torch.where(params[0] > 0, 1.0 / params[0].clamp_min(1e-30), 0.0)
    args = (logits, temperature, params[1].long(), params[2], torch.zeros(24), params[4], params[5])
    want = sample_tokens(*args)
    calls = []
    monkeypatch.setattr(reference_sampling, "sample_top_k",
                        lambda *a: calls.append(a[-1]) or _real_sample_top_k(*a))
    assert torch.equal(sample_tokens(*args, top_k_bound=20), want)
    assert torch.equal(sample_tokens(*args, top_k_bound=3), want)
    assert calls == [candidate_count(20, 200), candidate_count(3, 200)]
    assert torch.equal(sample_tokens(*args, top_k_bound=TOP_K_MAX + 1), want) and len(calls) == 2  # no fast path
    off = list(args)
    off[2] = params[1].long().clone()
    off[2][5] = 0
    assert torch.equal(sample_tokens(*off, top_k_bound=20), sample_tokens(*off))
    with pytest.raises(ValueError, match="top_k_bound"):
        sample_tokens(*args, top_k_bound=-1)
    inv_t, k = np.array([0.0, 1.0, 2.0], np.float32), np.array([0, 5, 64], np.int32)
    assert top_k_bound(inv_t, k) == 64
    assert top_k_bound(inv_t, np.array([0, 5, 0], np.int32)) == 0  # a sampled row without top-k
    assert top_k_bound(inv_t, np.array([0, 5, TOP_K_MAX + 1], np.int32)) == 0
    assert top_k_bound(np.zeros(3, np.float32), k) == 0  # nothing sampled
    assert candidate_count(64, 262144) == 128 and candidate_count(5, 262144) == 37 and candidate_count(50, 60) == 60
    assert candidate_count(TOP_K_MAX, 10**6) == 512


_real_sample_top_k = reference_sampling.sample_top_k


def test_triton_candidate_kernel_matches_torch():
    """The candidate kernel (interpreter on the CPU) returns the torch version's tokens and -1s, ties and all."""
    tt = pytest.importorskip("hf_paged.kernels.triton_topk_sampling")
    for seed, dtype in ((6, torch.bfloat16), (7, torch.float32)):
        logits, params = _rows(12, 160, dtype, seed, k_max=10)
        values, indices = logits.topk(24, dim=1)
        want = reference_sampling.candidate_tokens(values, indices, 160, *params)
        got = tt.candidate_tokens(values.to(DEVICE), indices.to(DEVICE), 160, *(t.to(DEVICE) for t in params),
                                  candidate_block=32)
        assert torch.equal(got.cpu(), want), (got, want)
    logits = _tied_rows().to(torch.bfloat16)
    params = _params(logits.shape[0], 1.0, 4, 0.6)
    values, indices = logits.topk(8, dim=1)
    want = reference_sampling.candidate_tokens(values, indices, 64, *params)
    got = tt.candidate_tokens(values.to(DEVICE), indices.to(DEVICE), 64, *(t.to(DEVICE) for t in params),
                              candidate_block=16)
    assert torch.equal(got.cpu(), want) and (want == -1).any() and (want >= 0).any()


def test_triton_fast_path_matches_reference():
    """The whole Triton path (topk, candidate kernel, the full kernel for the undecided rows only) gives the
    reference's tokens: rows decided by the candidates, a tie past the list and a greedy tie past it."""
    tt = pytest.importorskip("hf_paged.kernels.triton_topk_sampling")
    vocab = 96
    logits, params = _rows(6, vocab, torch.bfloat16, 8, k_max=6)
    logits[1, :] = 2.0  # flat: a tie at every rank, past the list
    logits[2, 3:40] = 100.0  # greedy or not, the maximum tied past the list
    params[0][2] = 0.0
    want = reference_sampling.sample_tokens(logits, *params)
    decided = _candidates(logits, params, 16)
    assert decided[1] == decided[2] == -1 and int((decided >= 0).sum()) >= 3
    got = tt.sample_top_k(logits.to(DEVICE), *(t.to(DEVICE) for t in params), 16, candidate_block=16,
                          search_block=32)
    assert torch.equal(got.cpu(), want), (got, want)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_picker_takes_the_fast_path(monkeypatch, backend):
    """The engine's picker passes the bound of its host columns: top-k steps take the fast path (same tokens as
    with it switched off), a step with a row without top-k does not."""
    monkeypatch.setenv("HF_PAGED_BACKEND", backend)
    device = torch.device(DEVICE)
    seen = []
    real = sampling.sample_normalised
    monkeypatch.setattr("hf_paged.engine.device_sampling.sample_normalised",
                        lambda *a, **kw: seen.append(kw["top_k_bound"]) or real(*a, **kw))
    g = torch.Generator().manual_seed(9)
    logits = (torch.randn(6, 120, generator=g) * 2).to(torch.bfloat16).to(device)
    specs = [(0.0, 0, 1.0, 0.0, 1), (0.8, 5, 0.9, 0.0, 2), (1.0, 12, 1.0, 0.05, 3), (0.6, 1, 1.0, 0.0, 4),
             (1.3, 7, 0.5, 0.0, 5), (1.0, 3, 0.95, 0.1, 6)]
    offsets = [3, 4, 5, 6, 7 | (1 << 32), 8]
    picker = DevicePicker(device, max_rows=8, seed=0)
    fast = picker.pick(logits, specs, offsets)
    picker.top_k_fast_path = False
    slow = picker.pick(logits, specs, offsets)
    assert torch.equal(fast, slow)
    without_k = specs[:5] + [(1.0, 0, 0.95, 0.1, 6)]
    picker.top_k_fast_path = True
    picker.pick(logits, without_k, offsets)
    assert seen == [12, 0, 0]


def test_engine_tokens_are_the_same_with_the_fast_path(monkeypatch):
    """An engine (tiny llama, static decode path: pipelined, batched) gives every request the same tokens with the
    fast path on and off: top-k rows with top-p and min-p, and greedy rows in the same steps."""
    model = tiny_model("llama", seed=4)
    prompts = [[5 + i, 17, 33 + 2 * i, 8] for i in range(6)]
    params = [hf_paged.SamplingParams(max_new_tokens=10, ignore_eos=True, do_sample=True, temperature=0.9, top_k=20,
                                      top_p=0.9, seed=1),
              hf_paged.SamplingParams(max_new_tokens=10, ignore_eos=True, do_sample=True, temperature=1.3, top_k=50,
                                      min_p=0.05, seed=2),
              hf_paged.SamplingParams(max_new_tokens=10, ignore_eos=True),
              hf_paged.SamplingParams(max_new_tokens=10, ignore_eos=True, do_sample=True, top_k=5, seed=4),
              hf_paged.SamplingParams(max_new_tokens=10, ignore_eos=True, do_sample=True, temperature=0.5, top_k=1,
                                      seed=5),
              hf_paged.SamplingParams(max_new_tokens=10, ignore_eos=True, do_sample=True, top_k=64, top_p=0.5,
                                      seed=6)]
    calls = []
    real = reference_sampling.sample_top_k
    monkeypatch.setattr(reference_sampling, "sample_top_k", lambda *a: calls.append(a[-1]) or real(*a))
    runs = []
    for fast in (True, False):
        monkeypatch.setattr(DevicePicker, "top_k_fast_path", fast)
        engine = hf_paged.Engine(model, block_size=4, num_blocks=100, max_num_seqs=8, seed=0)
        engine.runner.decode_mode = "static"
        runs.append([o.outputs[0].token_ids for o in engine.generate(prompts, params)])
        engine.close()
        if fast:
            assert len(calls) >= 9  # every step samples through it (its bound: 64)
            calls.clear()
    assert not calls
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("vocab,k,temperature", [(262144, 64, 1.0), (151936, 20, 0.7), (32000, 256, 0.8)])
@pytest.mark.parametrize("select", ["torch", "radix"])
def test_gpu_fast_path_matches_the_full_kernel(monkeypatch, vocab, k, temperature, select):
    """Real shapes on the GPU: the fast path's tokens (its list from torch.topk or the radix select) are the full
    kernel's for 240 bf16 rows (flat, peaked, greedy rows, a tie at the k-th value past the list, a NaN row), and the
    reference's for a greedy, a flat and a peaked row."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    monkeypatch.setattr(pytest.importorskip("hf_paged.kernels.triton_topk_sampling"), "TOPK_SELECT", select)
    rows = 240
    g = torch.Generator(device="cuda").manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=g, device="cuda")
    logits[rows // 2:] *= 2.5
    logits[rows // 2:, :6] += 15.0
    logits[5, : 4 * k] = 9.0  # a tie at the k-th value reaching past the candidates: the full kernel decides it
    logits[6, 1] = float("nan")
    logits = logits.to(torch.bfloat16)
    temp = torch.full((rows,), temperature, device="cuda")
    temp[::9] = 0.0
    args = (logits, temp, torch.full((rows,), k, device="cuda"), torch.full((rows,), 0.95, device="cuda"),
            torch.where(torch.arange(rows, device="cuda") % 3 == 0, 0.02, 0.0),
            torch.arange(rows, device="cuda") * 7919 + 1, torch.full((rows,), 77, device="cuda"))
    full = sample_tokens(*args)
    fast = sample_tokens(*args, top_k_bound=k)
    assert torch.equal(fast, full), (fast != full).nonzero()
    few = torch.tensor([0, 1, 130])  # (the reference reads a row of 262,144 in seconds)
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    ref = sample_tokens(*(a[few.to(a.device)].cpu() for a in args))
    assert torch.equal(fast[few.cuda()].cpu(), ref)
