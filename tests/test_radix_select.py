"""The radix select of the top-k fast path (`triton_radix_select.select_top`, under the interpreter without a GPU)
and its torch reference (`reference_select`) against ``torch.topk``: the same values, unique indices holding them,
on rows with ties at the boundary, NaN, infinities, signed zeros, equal rows and lists as wide as the row; and the
fast path's tokens with either selection (the tokens are the reference sampler's)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_paged.kernels import reference_sampling, reference_select  # noqa: E402
from hf_paged.kernels.sampling import (  # noqa: E402
    candidate_count,
    effective_top_k,
    inverse_temperature,
    log_min_p,
    sample_tokens,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cases(dtype: torch.dtype, vocab: int = 1500, seed: int = 0) -> torch.Tensor:
    """Eight rows: distinct values, rounded (ties everywhere, the boundary among them), NaN and infinities, three
    finite values among -inf (the list ends in -inf ties), one value everywhere but four, signed zeros at the boundary
    (negatives, then 30 zeros of either sign), peaked (six values far above), and the rounded row again."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, vocab, generator=g) * 3
    x[1] = x[1].round()
    x[2, [5, vocab // 2]] = float("nan")
    x[2, [7, 8]] = float("inf")
    x[2, 9:40] = -float("inf")
    x[3] = -float("inf")
    x[3, [3, vocab // 2, vocab - 1]] = torch.tensor([1.0, -2.0, 1.0])
    x[4] = 0.75
    x[4, 60:64] = 2.0  # (taken late by the list that overflows: the radix passes must rewrite it whole)
    x[5] = -x[5].abs() - 1
    x[5, 100:130] = 0.0
    x[5, 100:130:3] = -0.0
    x[6, torch.randperm(vocab, generator=g)[:6]] += 40.0
    x[7] = x[1]
    return x.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as floats (NaN equal to NaN, -0.0 to +0.0)."""
    a, b = a.float(), b.float()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _check_selection(logits: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, want: torch.Tensor):
    """`values` are `want` (sorted from the largest, as floats) and `indices` distinct positions holding them."""
    count = want.shape[1]
    assert values.shape == indices.shape == want.shape and values.dtype == logits.dtype
    assert _same(values, want), (values, want)
    assert _same(logits.gather(1, indices.long()), values)
    assert all(len(set(row)) == count for row in indices.tolist())


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_topk(dtype):
    """The torch reference returns torch.topk's values (with unique indices holding them) for every row and count,
    counts past the row's width included, and its threshold is the count-th largest key."""
    logits = _cases(dtype, vocab=700)
    for count in (1, 37, 128, 700, 900):
        values, indices = reference_select.select_top(logits, count)
        _check_selection(logits, values, indices, logits.topk(min(count, 700), dim=1).values)
    keys = reference_select.order_keys(logits)
    threshold, ties = reference_select.radix_threshold(keys, 50, reference_select.key_bits(dtype))
    kth = keys.sort(1, descending=True).values[:, 49]
    assert torch.equal(threshold, kth)
    assert torch.equal(ties, 50 - (keys > kth[:, None]).sum(1))
    for group in (1, 4, 16, 64):  # the bound from group maxima: never above the count-th key, so the list holds it
        bound = reference_select.group_bound(keys, 50, group)
        sizes = reference_select.list_sizes(keys, 50, group, dtype)  # all the count largest, or every key but -inf
        finite = (keys > reference_select.neg_inf_key(dtype)).sum(1)
        assert bool((bound <= kth).all()) and bool(((sizes >= 50) | (sizes == finite)).all())
    assert bool((reference_select.list_sizes(keys, 50, 4, dtype)[[0, 6]] <= 100).all())  # and near it on random rows
    assert int(reference_select.list_sizes(keys, 50, 4, dtype)[3]) == 3  # a masked row: its three finite values
    assert bool((keys == 32767 if dtype != torch.float32 else keys == 2**31 - 1)[2, [5, 350]].all())  # NaN: the top


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_reference(dtype):
    """The Triton selection (several programs a row) gives the reference's values, its indices distinct positions
    holding them, with the same set above the threshold; a row whose list did not overflow (the bound's path) exactly
    the reference's list, indices included; rows of ties and masks overflow and take the radix passes (histograms
    added with atomics, tied keys through a counter); a list as wide as the row takes all of it."""
    tt = pytest.importorskip("hf_paged.kernels.triton_radix_select")
    logits = _cases(dtype, vocab=1024, seed=1)
    want, want_idx = reference_select.select_top(logits, 48)
    sizes = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    values, indices = tt.select_top(logits.to(DEVICE), 48, block=256, chunk=512, group=8, cap=128, sizes=sizes)
    values, indices = values.cpu(), indices.cpu()
    _check_selection(logits, values, indices, want)
    keys = reference_select.order_keys(logits)
    threshold, _ = reference_select.radix_threshold(keys, 48, reference_select.key_bits(dtype))
    assert torch.equal(sizes.cpu().long(), reference_select.list_sizes(keys, 48, 8, dtype))  # the bound's
    easy = sizes.cpu() <= 128
    # both paths taken: equal values overflow; a row masked to three values does not (its -inf ties follow them)
    assert easy[[0, 3, 6]].all() and not easy[4].any()
    bits = torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(values[easy].view(bits), want[easy].view(bits))
    assert torch.equal(indices[easy].long(), want_idx[easy])
    for row in range(logits.shape[0]):
        above = keys[row, want_idx[row]] > threshold[row]
        assert set(want_idx[row][above].tolist()) == set(indices[row][keys[row, indices[row].long()] > threshold[row]]
                                                        .tolist())
    narrow = logits[:3, :40]
    values, indices = tt.select_top(narrow.to(DEVICE), 64, block=16, chunk=32)
    _check_selection(narrow, values.cpu(), indices.cpu(), narrow.topk(40, dim=1).values)


def test_kernel_with_tl_sort():
    """The GPU's way of ordering the bound's groups and the list (``tl.sort``), at a size the interpreter's sort
    takes in a second: the reference's list exactly."""
    tt = pytest.importorskip("hf_paged.kernels.triton_radix_select")
    logits = _cases(torch.bfloat16, vocab=512, seed=5)[[0, 6]]
    want, want_idx = reference_select.select_top(logits, 12)
    sizes = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    values, indices = tt.select_top(logits.to(DEVICE), 12, block=128, chunk=256, group=16, cap=32, sort=True,
                                    sizes=sizes)
    assert torch.equal(sizes.cpu().long(), reference_select.list_sizes(reference_select.order_keys(logits), 12, 16,
                                                                       logits.dtype))
    assert bool((sizes <= 32).all())
    assert torch.equal(values.cpu().view(torch.int16), want.view(torch.int16))
    assert torch.equal(indices.cpu().long(), want_idx)


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_rows_skip_the_radix_passes(dtype):
    """Rows masked to a few tokens (a grammar's, min-p's: the rest -inf) keep -inf out of their list: none overflows,
    so none takes the radix passes, and each is the reference's answer exactly, its least-index -inf elements after
    its finite ones: fewer finite tokens than the count (scattered, or in the row's last tile), none at all, NaN among
    -inf, more finite tokens than the count but fewer than the list (all -inf groups but a few)."""
    tt = pytest.importorskip("hf_paged.kernels.triton_radix_select")
    g = torch.Generator().manual_seed(7)
    vocab, count = 1024, 48
    x = torch.full((6, vocab), -float("inf"))
    x[0, torch.randperm(vocab, generator=g)[:5]] = torch.randn(5, generator=g)
    x[1, vocab - 20:] = torch.randn(20, generator=g)  # the finite tokens last: the -inf ones come first in the row
    x[3, [10, 500]] = float("nan")
    x[3, 900] = 1.0
    x[4, 64:96] = torch.randn(32, generator=g)  # 32 + 40 finite, in a few groups: more than the count
    x[4, 256:296] = torch.randn(40, generator=g)
    x[5] = x[0]
    x = x.to(dtype)
    want, want_idx = reference_select.select_top(x, count)
    sizes = torch.zeros(6, dtype=torch.int32, device=DEVICE)
    values, indices = tt.select_top(x.to(DEVICE), count, block=256, chunk=512, group=8, cap=128, sizes=sizes)
    finite = (reference_select.order_keys(x) > reference_select.neg_inf_key(dtype)).sum(1)
    assert torch.equal(sizes.cpu().long(), finite) and bool((sizes <= 128).all())  # no row overflowed
    bits = torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(values.cpu().view(bits), want.view(bits))
    assert torch.equal(indices.cpu().long(), want_idx)


def test_candidates_ignore_the_tie_choice():
    """The candidate kernel's torch twin gives the same tokens and -1s for torch.topk's list, the radix select's and
    the same list with other tied indices at its end and the equal values' order shuffled (what torch.topk leaves
    open): rows tied at the boundary decided or not, greedy and sampled."""
    logits = _cases(torch.bfloat16, vocab=600, seed=2)
    rows = logits.shape[0]
    k = torch.full((rows,), 12, dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    for inv_t in (0.0, 1.0, 1.7):
        params = [torch.full((rows,), inv_t), k, torch.full((rows,), 0.9), torch.full((rows,), -float("inf")),
                  torch.arange(rows) * 31 + 1, torch.arange(rows) + 5]
        want = reference_sampling.candidate_tokens(*logits.topk(30, dim=1), 600, *params)
        values, indices = reference_select.select_top(logits, 30)
        assert torch.equal(reference_sampling.candidate_tokens(values, indices, 600, *params), want)
        # the same values, the tied indices replaced by others of the row with the boundary value, equal ones shuffled
        for row in range(rows):
            tied = (logits[row] == values[row, -1]).nonzero()[:, 0]
            at = (values[row] == values[row, -1]).nonzero()[:, 0]
            indices[row, at] = tied[torch.randperm(tied.numel(), generator=g)[: at.numel()]]
            for v in values[row].unique():
                same = (values[row] == v).nonzero()[:, 0]
                indices[row, same] = indices[row, same[torch.randperm(same.numel(), generator=g)]]
        assert _same(logits.gather(1, indices), values)
        assert torch.equal(reference_sampling.candidate_tokens(values, indices, 600, *params), want)
        assert (want == -1).any() and (want >= 0).any()


def test_warm_up_compiles_every_top_k_variant(monkeypatch):
    """With the radix select chosen, the sampler's warm-up runs it once for every compiled variant that a top-k bound
    up to TOP_K_MAX can take (its sizes are compile-time constants of the candidate count), so no served step
    compiles; with torch.topk, or off the Triton backend, it runs nothing."""
    tt = pytest.importorskip("hf_paged.kernels.triton_topk_sampling")
    from hf_paged.kernels import sampling

    calls = []
    monkeypatch.setattr(tt.triton_radix_select, "select_top", lambda x, c: calls.append((tuple(x.shape), c)))
    monkeypatch.setattr(sampling, "get_backend", lambda device: "triton")
    monkeypatch.setattr(tt, "TOPK_SELECT", "torch")
    assert sampling.warm_up_selection(262144, torch.bfloat16, torch.device("cpu")) == [] and calls == []
    monkeypatch.setattr(tt, "TOPK_SELECT", "radix")
    for vocab in (262144, 151936, 32000, 300):
        calls.clear()
        warmed = sampling.warm_up_selection(vocab, torch.bfloat16, torch.device("cpu"))
        assert [c for _, c in calls] == warmed and all(shape == (1, vocab) for shape, _ in calls)
        variants = {tt.triton_radix_select.variant(vocab, c) for c in warmed}
        assert len(variants) == len(warmed)  # one call a variant
        for bound in range(1, sampling.TOP_K_MAX + 1):
            assert tt.triton_radix_select.variant(vocab, sampling.candidate_count(bound, vocab)) in variants, bound
    monkeypatch.setattr(sampling, "get_backend", lambda device: "torch")
    assert sampling.warm_up_selection(262144, torch.bfloat16, torch.device("cpu")) == []


def test_select_switch(monkeypatch):
    """`TOPK_SELECT` picks the selection at each call; an unknown one is refused."""
    tt = pytest.importorskip("hf_paged.kernels.triton_topk_sampling")
    logits = _cases(torch.float32, vocab=64)[:2].to(DEVICE)
    calls = []
    monkeypatch.setattr(tt.triton_radix_select, "select_top", lambda x, c: calls.append(c) or x.topk(c, dim=1))
    monkeypatch.setattr(tt, "TOPK_SELECT", "radix")
    tt.select_candidates(logits, 8)
    assert calls == [8]
    tt.select_candidates(logits, 8, "torch")
    assert calls == [8]
    with pytest.raises(ValueError, match="top-k selection"):
        tt.select_candidates(logits, 8, "bitonic")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_tokens_with_the_radix_select(monkeypatch, dtype):
    """Through the sampler's entry point (`sample_tokens(..., top_k_bound=k)`, Triton backend) the radix select gives
    the full kernel's tokens (the reference sampler's but for the NaN row), as torch.topk does: greedy and sampled rows, top-p and min-p, ties at the k-th
    value inside and past the list, a NaN row, a row of -inf ties, a flat row, greedy ties."""
    tt = pytest.importorskip("hf_paged.kernels.triton_topk_sampling")

    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    logits = _cases(dtype, vocab=1024, seed=4)
    rows = logits.shape[0]
    temperature = torch.tensor([0.8, 1.0, 0.0, 1.3, 0.7, 1.0, 0.0, 0.0])
    top_k = torch.tensor([10, 5, 20, 2, 20, 16, 8, 20])
    top_p = torch.tensor([0.9, 1.0, 1.0, 0.8, 0.95, 0.9, 1.0, 0.5])
    min_p = torch.tensor([0.0, 0.05, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0])
    seed, offset = torch.arange(rows) * 101 + 3, torch.arange(rows) + 17
    args = [t.to(DEVICE) for t in (logits, temperature, top_k, top_p, min_p, seed, offset)]
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    reference = sample_tokens(*(a.cpu() for a in args))
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    want = sample_tokens(*args).cpu()  # the full kernel
    # (the Triton kernel and the torch reference take different tokens of a row with NaN, fast path or not)
    clean = torch.arange(rows) != 2
    assert torch.equal(want[clean], reference[clean])
    selects = []
    real = tt.triton_radix_select.select_top
    monkeypatch.setattr(tt.triton_radix_select, "select_top", lambda x, c: selects.append(c) or real(x, c))
    for select in tt.SELECTS:
        monkeypatch.setattr(tt, "TOPK_SELECT", select)
        got = sample_tokens(*args, top_k_bound=20)
        assert torch.equal(got.cpu(), want), (select, got, want)
    assert selects == [candidate_count(20, 1024)]
    # most rows are decided by the candidates the radix select returns (not left to the full kernel)
    normalised = (inverse_temperature(args[1]), effective_top_k(args[2], 1024), args[3], log_min_p(args[4]), seed.to(DEVICE),
                  offset.to(DEVICE))
    decided = tt.candidate_tokens(*real(args[0], candidate_count(20, 1024)), 1024, *normalised).cpu()
    assert int((decided >= 0).sum()) >= 5 and torch.equal(decided[decided >= 0], want[decided >= 0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,count", [(262144, 128), (151936, 52), (32000, 512)])
def test_gpu_select_matches_topk(dtype, vocab, count):
    """Real shapes on the GPU (one row to several chunks a row, 240 rows): torch.topk's values, distinct indices
    holding them, the same from a CUDA-graph replay (fixed launches, no sync); rows of ties, NaN and -inf included."""
    tt = pytest.importorskip("hf_paged.kernels.triton_radix_select")
    g = torch.Generator(device="cuda").manual_seed(vocab)
    for rows in (1, 240):
        logits = torch.randn(rows, vocab, generator=g, device="cuda")
        if rows > 1:
            logits[1] = logits[1].round()
            logits[2, :3] = float("nan")
            logits[3, 10:] = -float("inf")
            logits[4] = 1.0
        logits = logits.to(dtype)
        values, indices = tt.select_top(logits, count)
        _check_selection(logits, values, indices, logits.topk(min(count, vocab), dim=1).values)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = tt.select_top(logits, count)
        logits.copy_(logits.flip(1))
        graph.replay()
        _check_selection(logits, *captured, logits.topk(min(count, vocab), dim=1).values)
