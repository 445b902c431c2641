"""`hf_paged.kernels.sampling.sample_tokens`: the Triton kernel equals the torch reference token for token (the
interpreter on CPU, real shapes on a GPU), and the draws follow transformers' warpers (temperature -> top-k -> top-p
-> min-p) in distribution, seeds included."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from scipy.stats import chi2  # noqa: E402
from transformers.generation.logits_process import (  # noqa: E402
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_paged.kernels import reference_sampling  # noqa: E402
from hf_paged.kernels.sampling import sample_tokens  # noqa: E402


def _params(rows, temperature, top_k=0, top_p=1.0, min_p=0.0, seed=0, offset=None, device="cpu"):
    def col(v, dtype):
        return torch.as_tensor(v if isinstance(v, (list, tuple)) else [v] * rows, dtype=dtype, device=device)
    off = offset if offset is not None else list(range(rows))
    return (col(temperature, torch.float32), col(top_k, torch.long), col(top_p, torch.float32),
            col(min_p, torch.float32), col(seed, torch.long), col(off, torch.long))


def _mixed(rows, vocab, device="cpu", dtype=torch.float32, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    temps = [0.0, 1.0, 0.6, 1.3, 0.9, 1.0, 0.7, 2.0][:rows] * (rows // 8 + 1)
    ks = [0, 0, 20, 5, 0, vocab, 1, 40][:rows] * (rows // 8 + 1)
    ps = [1.0, 1.0, 0.9, 0.5, 0.95, 0.3, 1.0, 0.8][:rows] * (rows // 8 + 1)
    mps = [0.0, 0.0, 0.05, 0.0, 0.1, 0.0, 0.0, 0.2][:rows] * (rows // 8 + 1)
    seeds = [(i * 7919 + 3) << (i % 3) * 20 for i in range(rows)]
    offs = [i + ((i % 2) << 32) for i in range(rows)]
    return logits.to(device), _params(rows, temps[:rows], ks[:rows], ps[:rows], mps[:rows], seeds, offs, device)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_triton_matches_reference(monkeypatch, dtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (the interpreter only runs without a GPU)
    logits, params = _mixed(8, 700, dtype=dtype, device=device)
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    ref = sample_tokens(logits, *params)
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    tri = sample_tokens(logits, *params)
    assert torch.equal(ref.cpu(), tri.cpu())
    assert ref[0] == logits[0].float().argmax()  # temperature 0 = greedy


def _search_rows(vocab):
    """Rows that send the kernel's threshold search down each of its paths: near-flat (top-p keeps most of the row),
    peaked (a few strong tokens), wide (values far apart in magnitude), ties at a boundary, -inf entries."""
    g = torch.Generator().manual_seed(7)
    flat = torch.randn(vocab, generator=g) * 0.6
    peaked = torch.randn(vocab, generator=g) * 2.5
    peaked[torch.randperm(vocab, generator=g)[:6]] += 15.0
    wide = torch.randn(vocab, generator=g) * 40.0
    ties = torch.randn(vocab, generator=g).round()
    masked = torch.randn(vocab, generator=g) * 3.0
    masked[::3] = -float("inf")
    return torch.stack([flat, peaked, wide, ties, masked])


@pytest.mark.parametrize("t,k,p,half", [(0.6, 0, 0.95, 0), (0.8, 20, 1.0, 1), (0.7, 50, 0.9, 0), (1.0, 150, 0.999, 1),
                                        (1.0, 214, 1.0, 0), (1.0, 0, 0.3, 1)])
@pytest.mark.slow
def test_triton_search_paths_match_reference(t, k, p, half):
    """The kernel's scratch list (`cap`) changes how many tokens a search pass reads, never the kept set or the
    token: a list too small for most intervals, one that takes a narrowed interval, one that holds the row. The
    thresholds are compared by the set they keep (a draw alone rarely shows a set one low-probability token off).
    Each sampling setting runs every other (cap, sort_n) pair (`half`), so every pair meets three settings (the
    interpreter takes about 10 s a launch)."""
    triton_sampling = pytest.importorskip("hf_paged.kernels.triton_sampling")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = _search_rows(224)  # (3.5 blocks of 64: full blocks and a masked tail)
    rows = logits.shape[0]
    temperature, top_k, top_p, _, seed, offset = _params(rows, t, k, p, seed=3)
    inv_t, top_k = 1.0 / temperature, top_k.to(torch.int32)
    args = [x.to(device) for x in (inv_t, top_k, top_p, torch.full((rows,), -float("inf")), seed, offset)]
    keys = reference_sampling.float_key(logits * inv_t[:, None])
    finite = logits > -float("inf")  # -inf tokens (probability 0) may sit on either side of a threshold
    want_kept = ((keys >= reference_sampling.kept_threshold(logits, inv_t, top_k, top_p)[:, None]) & finite).sum(1)
    want = reference_sampling.sample_tokens(logits, *(a.cpu() for a in args))
    # `sort_n`: the search alone (0); a sorted selection of the list as made (cap 4 or 32 <= sort_n), or after
    # shrinking it in place (cap 512, sort_n 16)
    step = 1 if device == "cuda" else 2  # (a GPU runs every pair with every setting)
    for cap, sort_n in ((4, 0), (32, 0), (512, 0), (4, 16), (512, 16), (32, 128))[half * (step - 1)::step]:
        thresholds = torch.zeros(rows, dtype=torch.int32, device=device)
        got = triton_sampling.sample_tokens(logits.to(device), *args, cap=cap, block=64, search_block=32,
                                            thresholds=thresholds, sort_n=sort_n)
        kept = ((keys >= thresholds.cpu().long()[:, None]) & finite).sum(1)
        assert torch.equal(kept, want_kept), (cap, sort_n, kept, want_kept)
        assert torch.equal(got.cpu(), want), (cap, sort_n, got, want)
    # min-p on top: the draw among the keys above the list (made while compacting) applies it too
    args[3] = torch.full((rows,), float(torch.log(torch.tensor(0.02))), device=device)
    want = reference_sampling.sample_tokens(logits, *(a.cpu() for a in args))
    for cap, sort_n in ((4, 0), (32, 0), (512, 0), (32, 16), (512, 128))[half * (step - 1)::step]:  # search alone too
        got = triton_sampling.sample_tokens(logits.to(device), *args, cap=cap, block=64, search_block=32,
                                            sort_n=sort_n)
        assert torch.equal(got.cpu(), want), ("min-p", cap, sort_n, got, want)


def _rounds_needed(logits, inv_t, top_p, log_min_p, seed, offset):
    """How many (draw, check) rounds the kernel's draw-first path takes per row (top-p, no top-k): the Gumbel-max
    over the keys from a bound up, rejected while the mass above its key reaches p * Z (then its key bounds the next
    draw). Computed in torch from the reference's pieces."""
    x = logits.float() * inv_t[:, None]
    m = x.amax(1, keepdim=True)
    keys = reference_sampling.float_key(x)
    e = torch.exp(x - m)
    k1, k2 = reference_sampling.row_keys(seed, offset)
    score = x + reference_sampling.gumbel(k1[:, None], k2[:, None], torch.arange(x.shape[1])[None, :])
    rounds = []
    for r in range(x.shape[0]):
        bound, n = keys[r][x[r] > -float("inf")].min(), 0
        while True:
            n += 1
            allowed = (keys[r] >= bound) & ((x[r] - m[r]) >= log_min_p[r])
            c = int(torch.where(allowed, score[r], -float("inf")).argmax())
            if float(e[r][keys[r] > keys[r, c]].sum()) < float(top_p[r] * e[r].sum()):
                break
            bound = keys[r, c] + 1
        rounds.append(n)
    return rounds


@pytest.mark.slow
def test_draw_first_rounds_give_the_searched_tokens():
    """Top-p rows without top-k draw first and check the draw (`draw_first_rounds` rounds, then the search; every p
    here, where the engine's rows draw first from p 0.8): the tokens equal the search's and the reference's for rows
    kept by the first draw, by a later one, and by none within the rounds (small p), with and without min-p,
    near-flat, peaked, wide, tied and -inf rows."""
    triton_sampling = pytest.importorskip("hf_paged.kernels.triton_sampling")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = _search_rows(224)
    logits = torch.cat([base] * 8)
    rows = logits.shape[0]
    ps = [0.05, 0.3, 0.8, 0.95] * (rows // 4)
    mps = [-float("inf")] * (rows // 2) + [float(torch.log(torch.tensor(0.05)))] * (rows // 2)
    temperature, top_k, top_p, _, seed, offset = _params(rows, 0.8, 0, ps, seed=[5 + 3 * i for i in range(rows)])
    inv_t, top_k = 1.0 / temperature, top_k.to(torch.int32)
    log_min_p = torch.tensor(mps)
    rounds = _rounds_needed(logits, inv_t, top_p, log_min_p, seed, offset)
    assert {1, 2, 3} <= set(rounds), rounds  # with 1 and 2 rounds, rows fall back to the search
    args = [x.to(device) for x in (inv_t, top_k, top_p, log_min_p, seed, offset)]
    want = reference_sampling.sample_tokens(logits, *(a.cpu() for a in args))
    for n in (0, 1, 2, 4):
        got = triton_sampling.sample_tokens(logits.to(device), *args, block=64, search_block=32, draw_first_rounds=n,
                                            draw_first_min_p=0.0)
        assert torch.equal(got.cpu(), want), (n, got, want)


def _exact(logits_row, t, k, p, mp):
    """transformers' warpers in generate()'s order, as a probability vector."""
    x = logits_row[None].clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    x = TemperatureLogitsWarper(t)(ids, x)
    if k:
        x = TopKLogitsWarper(k)(ids, x)
    if p < 1.0:
        x = TopPLogitsWarper(p)(ids, x)
    if mp:
        x = MinPLogitsWarper(mp)(ids, x)
    return x.softmax(-1)[0]


def _draws(logits_row, n, t, k, p, mp, seed=11):
    rows = logits_row[None].expand(n, -1)
    return sample_tokens(rows, *_params(n, t, k, p, mp, seed, list(range(n))))


@pytest.mark.parametrize("t,k,p,mp", [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0),
                                      (1.5, 8, 0.9, 0.1), (1.0, 0, 1.0, 0.2)])
def test_distribution_matches_transformers_warpers(monkeypatch, t, k, p, mp):
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    logits = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.5, 0.2, 0.0, -0.3, -1.0, -2.0, -3.0, -6.0])
    n = 1000
    tokens = _draws(logits, n, t, k, p, mp)
    probs = _exact(logits, t, k, p, mp)
    counts = torch.bincount(tokens, minlength=logits.numel()).double()
    assert counts[probs == 0].sum() == 0, "a filtered-out token was drawn"
    keep = probs > 0
    expected = probs[keep].double() * n
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert stat < chi2.ppf(1 - 1e-4, max(int(keep.sum()) - 1, 1)), (stat, counts, expected)


def test_ties_kept_together(monkeypatch):
    """Ties at the top-k boundary are all kept (as TopKLogitsWarper does); at the top-p boundary a tie group is kept
    or dropped as a whole: its strictly larger mass decides."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    logits = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0, -1.0, -1.0, -5.0])
    tokens = _draws(logits, 600, 1.0, 3, 1.0, 0.0)
    assert set(tokens.tolist()) == {0, 1, 2, 3}  # 3 wanted, the tie at 1.0 keeps four
    # mass above the 1.0 group < 0.9, so the whole group stays; nothing below it does
    tokens = _draws(logits, 600, 1.0, 0, 0.9, 0.0)
    e = logits.exp() / logits.exp().sum()
    assert e[0] < 0.9 <= e[:4].sum()
    assert set(tokens.tolist()) == {0, 1, 2, 3}
    assert torch.equal(_draws(logits, 50, 1.0, 1, 1.0, 0.0), torch.zeros(50, dtype=torch.long))


def test_edge_parameters_are_no_ops(monkeypatch):
    """top_p=1, top_k=0, top_k >= vocab, min_p=0 filter nothing: identical tokens to the unfiltered draw."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    logits, _ = _mixed(6, 300)
    base = sample_tokens(logits, *_params(6, 0.8, 0, 1.0, 0.0, 5))
    for k, p, mp in [(300, 1.0, 0.0), (10**6, 1.0, 0.0), (0, 1.5, 0.0), (-1, 1.0, 0.0)]:
        assert torch.equal(sample_tokens(logits, *_params(6, 0.8, k, p, mp, 5)), base)


def test_seeds_independent_of_batch(monkeypatch):
    """A row's token depends on its own (seed, offset) only: same in any batch order or size, and in every run."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    logits, params = _mixed(8, 400)
    full = sample_tokens(logits, *params)
    assert torch.equal(full, sample_tokens(logits, *params))
    perm = torch.tensor([5, 2, 7, 0, 3])
    sub = sample_tokens(logits[perm], *(x[perm] for x in params))
    assert torch.equal(sub, full[perm])
    rows = torch.tensor([1] * 40)  # the same row at 40 offsets: the draws differ (a live random stream)
    temps, ks, ps, mps, seeds, _ = (x[rows] for x in params)
    draws = sample_tokens(logits[rows], temps, ks, ps, mps, seeds, torch.arange(40))
    assert len(set(draws.tolist())) > 5
    other = sample_tokens(logits[rows], temps, ks, ps, mps, seeds + 1, torch.arange(40))
    assert not torch.equal(draws, other)


def test_uniform_bits_are_uniform():
    k1, k2 = reference_sampling.row_keys(torch.tensor(123), torch.tensor(7))
    bits = reference_sampling.uniform_bits(k1, k2, torch.arange(1 << 16))
    assert int(bits.min()) >= 0 and int(bits.max()) < 2**32
    counts = torch.bincount((bits >> 28).long(), minlength=16).double()
    assert float(((counts - 4096) ** 2 / 4096).sum()) < chi2.ppf(1 - 1e-4, 15)


def test_validation():
    logits = torch.zeros(2, 10)
    params = list(_params(2, 1.0))
    with pytest.raises(ValueError, match="top_p"):
        sample_tokens(logits, params[0], params[1], params[2][:1], *params[3:])
    with pytest.raises(TypeError, match="seed"):
        sample_tokens(logits, *params[:4], params[4].float(), params[5])
    with pytest.raises(ValueError, match="logits"):
        sample_tokens(logits[0], *params)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows,vocab,dtype", [(1, 32000, torch.float32), (64, 128256, torch.bfloat16),
                                              (256, 151936, torch.float32)])
def test_gpu_triton_matches_reference(monkeypatch, rows, vocab, dtype):
    logits, params = _mixed(rows, vocab, device="cuda", dtype=dtype, gen_seed=rows)
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    tri = sample_tokens(logits, *params)
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    ref = sample_tokens(logits, *params)
    assert torch.equal(tri.cpu(), ref.cpu()), (tri != ref).nonzero()


def _temperatures():
    """Temperatures whose inverse rounds every way: tiny, huge, subnormal, zero, negative, random."""
    g = torch.Generator().manual_seed(5)
    special = torch.tensor([0.0, -1.0, 1e-38, 1e-30, 1e-31, 3e38, 1.0, 0.7, 0.1, 1 / 3, 2.0 ** -126, 1e-45])
    return torch.cat([special, torch.rand(4000, generator=g) * 3, torch.exp(torch.randn(4000, generator=g) * 20)])


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_host_normalisation_is_bitwise_the_devices(device):
    """The picker computes the inverse temperature and the effective top-k on the host (numpy); the dispatcher
    computes them with torch on the logits' device. They must agree to the bit, or a picked token could change."""
    from hf_paged.kernels.sampling import effective_top_k, inverse_temperature

    t = _temperatures().float()
    host = torch.from_numpy(inverse_temperature(t.numpy()))
    on_device = inverse_temperature(t.to(device)).cpu()
    assert host.dtype == on_device.dtype == torch.float32
    assert torch.equal(host.view(torch.int32), on_device.view(torch.int32))
    k = torch.tensor([-3, 0, 1, 5, 99, 100, 101, 2**40])
    assert torch.equal(torch.from_numpy(effective_top_k(k.numpy(), 100)), effective_top_k(k.to(device), 100).cpu())


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_engine_picker_draws_what_sample_tokens_draws(monkeypatch, backend):
    """`DevicePicker.pick` (normalised on the host, min-p log on the device only when a row has min-p) gives the
    tokens of `sample_tokens` for the same rows: mixed greedy / top-k / top-p / min-p rows, and rows without
    min-p; through the reference and through the Triton kernel (the interpreter on the CPU)."""
    from hf_paged.engine.device_sampling import DevicePicker

    monkeypatch.setenv("HF_PAGED_BACKEND", backend)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the interpreter only runs without a GPU
    for rows, with_min_p in ((8, True), (8, False), (19, True)):
        logits, params = _mixed(rows, 300, device=device, gen_seed=rows)
        temps, ks, ps, mps, seeds, offs = (p.tolist() for p in params)
        if not with_min_p:
            mps = [0.0] * rows
            params = params[:3] + (torch.zeros(rows, device=device),) + params[4:]
        picker = DevicePicker(device, max_rows=4, seed=0)  # grows to the step
        specs = list(zip(temps, ks, ps, mps, seeds))
        assert torch.equal(picker.pick(logits, specs, offs), sample_tokens(logits, *params))
        assert torch.equal(picker.pick(logits, specs, offs), sample_tokens(logits, *params))  # the other buffer set
