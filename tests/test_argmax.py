"""`kernels.sampling.argmax_rows`, the engine's greedy pick: `torch.argmax(dim=-1)`'s answer on every backend.

The Triton kernel cuts rows into chunks and lets the last chunk of a row pick among them; the tests force one and
many chunks per row (by pretending the GPU has 8 or 64 SMs; with more rows than SMs torch's argmax runs), and check ties (first index), NaN (first NaN), rows
of -inf, half precision, strided rows, the engine's picker (`greedy_picker`) reusing its scratch across shapes
(its counters left at zero).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_paged import kernels  # noqa: E402
from hf_paged.kernels.sampling import argmax_rows, greedy_picker  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")),
]


def _rows(kind: str, rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=gen)
    if kind == "ties":
        x = torch.randint(0, 3, (rows, vocab), generator=gen).float()
    elif kind == "neg-inf":
        x[:] = float("-inf")
        x[-1, vocab // 2] = -1e30  # one row with a finite maximum among -inf
    elif kind == "nan":
        x[0, vocab // 2] = float("nan")
        x[0, vocab - 1] = float("nan")
        x[-1, 0] = float("inf")
    elif kind == "bf16":
        x = (x * 4).round().bfloat16()  # many ties
    return x.to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sms", [8, pytest.param(64, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["random", "ties", "neg-inf", "nan", "bf16"])
def test_argmax_rows_equals_torch(backend, sms, kind, monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", backend)
    if backend == "triton":
        from hf_paged.kernels import triton_argmax

        monkeypatch.setattr(triton_argmax, "_device_sms", lambda device: sms)
    elif sms != 8:
        pytest.skip("chunks are a Triton option: the torch backend runs once")
    gen = torch.Generator().manual_seed(0)
    pick = greedy_picker(DEVICE)  # one scratch for every call below, as the engine's picker keeps it
    for rows, vocab in ((1, 5), (3, 1500), (5, 4097), (1, 9000), (2, 3000), (9, 2000)):
        x = _rows(kind, rows, vocab, gen)
        for got in (argmax_rows(x), pick(x)):
            assert got.dtype == torch.int64 and got.device == x.device
            assert torch.equal(got, x.argmax(dim=-1)), (rows, vocab)
    if backend == "triton":
        assert not pick.counters.any(), "every launch must leave the row counters at zero"


@pytest.mark.parametrize("backend", BACKENDS)
def test_argmax_rows_strided_and_empty(backend, monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", backend)
    x = torch.randn(4, 3000, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert torch.equal(argmax_rows(x[::2]), x[::2].argmax(-1))  # row stride 6000
    assert torch.equal(argmax_rows(x[:, 7:2000]), x[:, 7:2000].argmax(-1))
    assert torch.equal(argmax_rows(x.t().contiguous().t()), x.argmax(-1))  # not unit stride in the vocabulary
    assert torch.equal(greedy_picker(DEVICE)(x.t().contiguous().t()), x.argmax(-1))
    assert argmax_rows(x[:0]).shape == (0,)


@pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")
def test_greedy_pick_warm_up_runs_both_paths(monkeypatch):
    """One row through the kernel, one more row than SMs through torch's argmax (what a big batch's pick runs)."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    from hf_paged.kernels import triton_argmax

    monkeypatch.setattr(triton_argmax, "_device_sms", lambda device: 4)
    pick = greedy_picker(DEVICE)
    calls = []
    monkeypatch.setattr(torch.Tensor, "argmax", lambda self, *a, **k: calls.append(self.shape[0]) or
                        torch.zeros(self.shape[0], dtype=torch.int64, device=self.device))
    pick.warm_up(300, torch.float32)
    assert calls == [5]  # the 5-row pick went to torch
    assert pick.values is not None and not pick.counters.any()  # the 1-row pick ran the kernel


def test_argmax_rows_bad_input_is_named():
    with pytest.raises(ValueError, match="logits"):
        argmax_rows(torch.zeros(5, device=DEVICE))
    with pytest.raises(TypeError, match="logits"):
        argmax_rows(torch.zeros(2, 5, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="vocabulary"):
        argmax_rows(torch.zeros(2, 0, device=DEVICE))
