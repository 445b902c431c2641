"""The sampler's sorted selection (`triton_sampling._select`), its in-place list shrink (`_shrink`) and the search
step that joins them (`_sort_step`), each driven alone by a probe kernel (the interpreter on CPU) and checked against
a plain count / sum over the same tokens: the key of a given rank, the largest key whose mass reaches a target (ties
kept together), the list kept in order, and the ties at an interval's low end kept through a shrink."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
ts = pytest.importorskip("hf_paged.kernels.triton_sampling")

from hf_paged.kernels.reference_sampling import float_key  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _select_probe(x_ptr, n, m, lo, above_cnt, above_mass, target_count, target_mass, use_mass, out_key, out_cnt,
                  out_mass, SORT_N: tl.constexpr):
    key, cnt, mass = ts._select(x_ptr, n, m, lo, above_cnt, above_mass, target_count, target_mass, use_mass != 0,
                                SORT_N)
    tl.store(out_key, key)
    tl.store(out_cnt, cnt)
    tl.store(out_mass, mass)


@triton.jit
def _shrink_probe(x_ptr, i_ptr, n, lo, hi, out_n, BLOCK: tl.constexpr):
    tl.store(out_n, ts._shrink(x_ptr, i_ptr, n, lo, hi, BLOCK))


def _select(x, m, lo, above_cnt, above_mass, target_count, target_mass, use_mass, sort_n):
    outs = [torch.zeros(1, dtype=dt, device=DEVICE) for dt in (torch.int32, torch.int32, torch.float32)]
    _select_probe[(1,)](x.to(DEVICE), x.numel(), m, lo, above_cnt, above_mass, target_count, target_mass,
                        int(use_mass), *outs, SORT_N=sort_n)
    return int(outs[0]), int(outs[1]), float(outs[2])


def _stats_at(keys, e, key, above_cnt, above_mass):
    ge = keys >= key
    return above_cnt + int(ge.sum()), above_mass + float(e[ge].sum())


@pytest.mark.parametrize("n,sort_n", [(5, 16), pytest.param(16, 16, marks=pytest.mark.slow), pytest.param(40, 64, marks=pytest.mark.slow),
                                      pytest.param(64, 64, marks=pytest.mark.slow)])
def test_select_reads_the_rank_and_the_mass_off_the_sorted_keys(n, sort_n):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 2).round(decimals=1)  # ties among the keys
    keys = float_key(x)
    m = float(x.max()) + 0.5  # as if the row's max lay above the list
    e = torch.exp(x - m)
    above_cnt, above_mass = 3, 0.25
    distinct = torch.unique(keys).flip(0)  # largest first
    lo = int(keys.min())
    # count: the key of rank `rank` among all tokens (every rank of the short lists, every third of the long ones:
    # each launch is a second of the Triton interpreter)
    for rank in range(above_cnt + 1, above_cnt + n + 1, 1 if n <= 16 else 3):
        want = int(torch.sort(keys, descending=True).values[rank - above_cnt - 1])
        key, cnt, mass = _select(x, m, lo, above_cnt, above_mass, rank, 0.0, False, sort_n)
        assert key == want, (rank, key, want)
        want_cnt, want_mass = _stats_at(keys, e, want, above_cnt, above_mass)
        assert cnt == want_cnt and mass == pytest.approx(want_mass, rel=1e-5)
    stats = [_stats_at(keys, e, int(u), above_cnt, above_mass)[1] for u in distinct]
    for k, u in enumerate(distinct.tolist()):  # mass: targets between two keys' masses pick the lower key
        below = stats[k - 1] if k else above_mass
        target = (below + stats[k]) / 2
        key, cnt, mass = _select(x, m, lo, above_cnt, above_mass, 0, target, True, sort_n)
        assert key == u, (k, key, u)
        assert (cnt, mass) == (_stats_at(keys, e, u, above_cnt, 0.0)[0], pytest.approx(stats[k], rel=1e-5))
    # a mass target that rounding put just out of reach: the search's lower end stands
    key, _, _ = _select(x, m, lo, above_cnt, above_mass, 0, stats[-1] * 1.01, True, sort_n)
    assert key == lo


@pytest.mark.parametrize("block", [4, 16, 64])
def test_shrink_keeps_the_keys_in_range_in_place_in_order(block):
    g = torch.Generator().manual_seed(block)
    n = 50
    x = torch.randn(n, generator=g).round(decimals=1)
    idx = torch.randperm(1000, generator=g)[:n].to(torch.int32)
    keys = float_key(x)
    for lo, hi in ((float_key(torch.tensor(-0.5)), float_key(torch.tensor(0.7))), (int(keys.min()), int(keys.max())),
                   (int(keys.max()) + 1, int(keys.max()) + 5)):
        lo, hi = int(lo), int(hi)
        xs, ids = x.clone().to(DEVICE), idx.clone().to(DEVICE)
        out = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        _shrink_probe[(1,)](xs, ids, n, lo, hi, out, BLOCK=block)
        sel = (keys >= lo) & (keys <= hi)
        kept = int(out)
        assert kept == int(sel.sum())
        assert torch.equal(xs.cpu()[:kept], x[sel]) and torch.equal(ids.cpu()[:kept], idx[sel])


@triton.jit
def _sort_step_probe(x_ptr, i_ptr, m, lo, hi, lo_cnt, lo_mass, hi_cnt, hi_mass, list_lo, list_hi, list_n, above_cnt,
                     above_mass, target_count, target_mass, use_mass, out_i, out_f, SEARCH_BLOCK: tl.constexpr,
                     SORT_N: tl.constexpr):
    key, cnt, mass, list_lo, list_hi, list_n, above_cnt, above_mass = ts._sort_step(
        x_ptr, i_ptr, m, lo, hi, lo_cnt, lo_mass, hi_cnt, hi_mass, list_lo, list_hi, list_n, above_cnt, above_mass,
        target_count, target_mass, use_mass != 0, SEARCH_BLOCK, SORT_N)
    tl.store(out_i, key)
    tl.store(out_i + 1, cnt)
    tl.store(out_i + 2, list_lo)
    tl.store(out_i + 3, list_hi)
    tl.store(out_i + 4, list_n)
    tl.store(out_i + 5, above_cnt)
    tl.store(out_f, mass)
    tl.store(out_f + 1, above_mass)


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("use_mass", [False, True])
def test_sort_step_shrinks_a_long_list_to_the_interval_with_the_keys_at_its_low_end(wide, use_mass):
    """A list longer than SORT_N is shrunk before the sort: from `lo` up to the list's top when those fit SORT_N, else
    to `[lo, hi]` (the stats above it then those above `hi`). Tokens whose key is `lo` itself (ties at the interval's
    low end) must stay in the list: when the answer is `lo` they are counted in its stats, and the draw reads them."""
    sort_n, n = 16, 40
    x = torch.tensor([3.0, 2.5, 2.5, 2.0, 1.5, 1.5, 1.5, 1.0, 0.5, 0.5] + [0.0] * 4 + [-0.5] * 3 + [-1.0] * 3
                     + [-2.0 - 0.1 * i for i in range(n - 20)])
    x = x[torch.randperm(n, generator=torch.Generator().manual_seed(7))]  # the list's order is the row's, not sorted
    idx = torch.arange(100, 100 + n, dtype=torch.int32)
    keys = float_key(x)
    m = float(x.max()) + 0.5
    e = torch.exp(x - m)
    above_cnt, above_mass = 3, 0.25  # tokens above the list
    # the interval: [key(0.0), key(3.0)] (wide: [key(-1.0), key(1.5)]: from -1.0 up, more than SORT_N tokens)
    lo_v, hi_v = (-1.0, 1.5) if wide else (0.0, 3.0)
    lo, hi = int(float_key(torch.tensor(lo_v))), int(float_key(torch.tensor(hi_v)))
    lo_cnt, lo_mass = _stats_at(keys, e, lo, above_cnt, above_mass)
    hi_cnt, hi_mass = _stats_at(keys, e, hi + 1, above_cnt, above_mass)
    assert (lo_cnt - above_cnt > sort_n) == wide and (lo_cnt - hi_cnt <= sort_n)
    # the targets make `lo` itself the answer: every tie at lo is needed to reach them
    target_count = 0 if use_mass else lo_cnt
    next_mass = _stats_at(keys, e, lo + 1, above_cnt, above_mass)[1]
    target_mass = (next_mass + lo_mass) / 2 if use_mass else 0.0
    xs, ids = x.clone().to(DEVICE), idx.clone().to(DEVICE)
    out_i = torch.zeros(6, dtype=torch.int32, device=DEVICE)
    out_f = torch.zeros(2, dtype=torch.float32, device=DEVICE)
    list_lo, list_hi = int(keys.min()), int(keys.max())
    _sort_step_probe[(1,)](xs, ids, m, lo, hi, lo_cnt, lo_mass, hi_cnt, hi_mass, list_lo, list_hi, n, above_cnt,
                           above_mass, target_count, target_mass, int(use_mass), out_i, out_f, SEARCH_BLOCK=8,
                           SORT_N=sort_n)
    key, cnt, new_lo, new_hi, new_n, new_above = out_i.cpu().tolist()
    mass, new_above_mass = out_f.cpu().tolist()
    assert key == lo and cnt == lo_cnt and mass == pytest.approx(lo_mass, rel=1e-5)
    want_hi = hi if wide else list_hi
    want_above = (hi_cnt, hi_mass) if wide else (above_cnt, above_mass)
    assert (new_lo, new_hi, new_above) == (lo, want_hi, want_above[0])
    assert new_above_mass == pytest.approx(want_above[1], rel=1e-6)
    sel = (keys >= lo) & (keys <= want_hi)
    assert new_n == int(sel.sum())
    assert torch.equal(xs.cpu()[:new_n], x[sel]) and torch.equal(ids.cpu()[:new_n], idx[sel])
