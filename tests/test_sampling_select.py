"""The sampler's sorted selection (`triton_sampling._select`) and its in-place list shrink (`_shrink`), each driven
alone by a probe kernel (the interpreter on CPU) and checked against a plain count / sum over the same tokens: the
key of a given rank, the largest key whose mass reaches a target (ties kept together), and the list kept in order."""

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


@pytest.mark.parametrize("n,sort_n", [(5, 16), (16, 16), (40, 64), (64, 64)])
def test_select_reads_the_rank_and_the_mass_off_the_sorted_keys(n, sort_n):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 2).round(decimals=1)  # ties among the keys
    keys = float_key(x)
    m = float(x.max()) + 0.5  # as if the row's max lay above the list
    e = torch.exp(x - m)
    above_cnt, above_mass = 3, 0.25
    distinct = torch.unique(keys).flip(0)  # largest first
    lo = int(keys.min())
    for rank in range(above_cnt + 1, above_cnt + n + 1):  # count: the key of rank `rank` among all tokens
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
