"""Fused-experts kernels: Triton (the interpreter without CUDA) vs the torch reference vs a float64 oracle.

Small shapes, each case covering several things at once: rows 1 / 3 / 17, top-k 1 / 2 / 8, experts that no token
picks, equal routing weights, an expert named twice in one token's row, the expert-parallel sentinel (an index of
``E``, which must contribute nothing), gated SiLU / tanh-GELU, gpt-oss's clamped SwiGLU (interleaved gate/up,
transposed weights, biases), the raw first half with a gate function in torch between the halves, float32 and
bfloat16, and every ``BLOCK_M`` of the config table.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_paged import kernels  # noqa: E402
from hf_paged.kernels import moe, reference_moe  # noqa: E402
from hf_paged.kernels.moe import Activation  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_triton = pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")

GPT_OSS = Activation("silu", interleaved=True, alpha=1.702, gate_limit=7.0, up_limit=7.0, up_shift=1.0)
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _routing(tokens: int, experts: int, top_k: int, seed: int, *, skip=(), duplicate=False, sentinel=False,
             ties=False):
    """``(top_k_index, top_k_weights)``: distinct experts per row drawn from those not in `skip`, optionally one row
    naming an expert twice, one slot set to the sentinel ``experts``, or every weight equal."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(experts) if e not in skip])
    rows = [allowed[torch.randperm(len(allowed), generator=g)[:top_k]] for _ in range(tokens)]
    index = torch.stack(rows)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    if ties:
        weights = torch.full_like(weights, 1.0 / top_k)
    if duplicate and top_k > 1:
        index[0, 1] = index[0, 0]
    if sentinel:
        index[-1, -1] = experts
    return index, weights


def _weights(experts, hidden, inter, gated, bias, transposed, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    up_rows = 2 * inter if gated else inter
    w_up = torch.randn(experts, up_rows, hidden, generator=g) * hidden**-0.5
    w_down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    b_up = torch.randn(experts, up_rows, generator=g) * 0.5 if bias else None
    b_down = torch.randn(experts, hidden, generator=g) * 0.5 if bias else None
    cast = [t if t is None else t.to(dtype).to(DEVICE) for t in (w_up, w_down, b_up, b_down)]
    if transposed:  # stored (in, out) as gpt-oss does; the kernels get transposed views
        cast[0] = cast[0].transpose(1, 2).contiguous().transpose(1, 2)
        cast[1] = cast[1].transpose(1, 2).contiguous().transpose(1, 2)
    return cast


def _run(backend, monkeypatch, *args, **kwargs):
    monkeypatch.setenv("HF_PAGED_BACKEND", backend)
    return moe.fused_experts(*args, **kwargs)


# (tokens, experts, top_k, hidden, inter, activation, bias, transposed, dtype, routing options)
CASES = [
    pytest.param(1, 6, 2, 32, 16, Activation(), False, False, torch.float32, {}, id="1row-top2-silu"),
    pytest.param(3, 10, 8, 48, 24, Activation(), False, False, torch.float32, {"skip": (0,), "duplicate": True},
                 id="3rows-top8-unused-expert-duplicate"),
    pytest.param(17, 6, 1, 32, 40, Activation("gelu_tanh"), False, False, torch.float32,
                 {"skip": (2, 5), "ties": True}, id="17rows-top1-gelu-tanh-ties"),
    pytest.param(17, 8, 4, 40, 16, GPT_OSS, True, True, torch.float32, {"sentinel": True},
                 id="17rows-top4-gpt-oss-swiglu-bias-sentinel"),
    pytest.param(3, 4, 2, 64, 32, GPT_OSS._replace(interleaved=False), True, False, torch.bfloat16, {},
                 id="3rows-bf16-clamped-concat"),
    pytest.param(17, 5, 2, 32, 16, Activation("gelu"), False, False, torch.bfloat16, {"skip": (1,)},
                 id="17rows-bf16-gelu"),
]


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,activation,bias,transposed,dtype,options", CASES)
def test_fused_experts_match_the_reference_and_the_oracle(monkeypatch, tokens, experts, top_k, hidden, inter,
                                                          activation, bias, transposed, dtype, options):
    w_up, w_down, b_up, b_down = _weights(experts, hidden, inter, True, bias, transposed, dtype, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(7)).to(dtype).to(DEVICE)
    index, weights = (t.to(DEVICE) for t in _routing(tokens, experts, top_k, seed=hidden, **options))
    args = (x, index, weights, w_up, w_down, b_up, b_down, activation)
    ref = _run("torch", monkeypatch, *args)
    oracle = reference_moe.naive_experts(*(t if t is None else t.cpu() for t in args[:7]), activation)
    assert ref.shape == x.shape and ref.dtype == dtype
    torch.testing.assert_close(ref.double().cpu(), oracle, **TOL[dtype])
    if kernels.triton_available():
        out = _run("triton", monkeypatch, *args)
        assert out.shape == x.shape and out.dtype == dtype and not out.isnan().any()
        torch.testing.assert_close(out.double().cpu(), ref.double().cpu(), **TOL[dtype])
    if options.get("sentinel"):  # the dropped slot contributes nothing: the token equals its other slots alone
        keep = index.clone()
        kept_weights = weights.clone()
        kept_weights[-1, -1] = 0.0
        keep[-1, -1] = 0
        again = _run("torch", monkeypatch, x, keep, kept_weights, w_up, w_down, b_up, b_down, activation)
        torch.testing.assert_close(again, ref, **TOL[dtype])


@requires_triton
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_every_block_height_gives_the_same_rows(monkeypatch, block_m):
    """Experts with more pairs than a block (several blocks of one expert), one with a partial block, one with none."""
    triton_moe = kernels._triton_module("triton_moe")
    w_up, w_down, _, _ = _weights(4, 32, 16, True, False, False, torch.float32, seed=3)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    index, weights = (t.to(DEVICE) for t in _routing(40, 4, 2, seed=5, skip=(3,)))
    ref = _run("torch", monkeypatch, x, index, weights, w_up, w_down)
    config = triton_moe.fitted(triton_moe.MoeConfig(block_m, (32, 32, 4, 2), (32, 32, 4, 2)), 32, 16, 16, 4)
    out = _run("triton", monkeypatch, x, index, weights, w_up, w_down, config=config)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@requires_triton
def test_alignment_sorts_slots_by_expert_in_padded_runs():
    triton_moe = kernels._triton_module("triton_moe")
    index = torch.tensor([[2, 0], [2, 5], [0, 2], [5, 2]], device=DEVICE)  # expert 5: the sentinel of E = 5
    routing = triton_moe.align(index, 5, 16)
    num_pairs = index.numel()
    padded = int(routing.num_padded)
    assert padded == 32  # expert 0: 2 slots, expert 2: 4 slots, one block each; the others none
    assert routing.sorted_pairs.shape[0] >= padded and routing.num_m_blocks * 16 == routing.sorted_pairs.shape[0]
    runs = routing.sorted_pairs[:padded].view(2, 16).tolist()
    assert runs[0][:2] == [1, 4] and all(p == num_pairs for p in runs[0][2:])  # slots of expert 0, in slot order
    assert runs[1][:4] == [0, 2, 5, 7] and all(p == num_pairs for p in runs[1][4:])
    assert routing.block_expert[:2].tolist() == [0, 2]


def test_raw_halves_with_a_gate_function_between(monkeypatch):
    """The path of a module whose own gate function runs in torch: raw up rows, the gate, the down half."""
    w_up, w_down, b_up, b_down = _weights(5, 32, 16, True, True, False, torch.float32, seed=9)
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    index, weights = (t.to(DEVICE) for t in _routing(7, 5, 2, seed=4, sentinel=True))

    def gate(raw):  # a gate no Activation spells: sigmoid-gated, shifted
        g, u = raw.chunk(2, dim=-1)
        return torch.sigmoid(g) * (u - 0.5)

    expected = None
    for backend in ["torch"] + (["triton"] if kernels.triton_available() else []):
        monkeypatch.setenv("HF_PAGED_BACKEND", backend)
        raw = moe.experts_up(x, index, w_up, b_up, Activation("identity", gated=False))
        assert raw.shape == (index.numel(), 32)
        valid = (index.reshape(-1) < 5).nonzero().squeeze(1)
        inter = gate(raw)
        inter[~(index.reshape(-1) < 5)] = float("nan")  # a dropped slot's row is never read
        out = moe.experts_down(inter.contiguous(), index, weights, w_down, b_down)
        assert not out.isnan().any()
        expected = out if expected is None else expected
        torch.testing.assert_close(out, expected, **TOL[torch.float32])
        raw_ref = torch.stack([torch.nn.functional.linear(x[p // 2], w_up[index.reshape(-1)[p]], b_up[index.reshape(-1)[p]])
                               for p in valid.tolist()])
        torch.testing.assert_close(raw[valid], raw_ref, **TOL[torch.float32])


def test_zero_tokens_and_bad_arguments():
    w_up, w_down, _, _ = _weights(4, 32, 16, True, False, False, torch.float32, seed=0)
    x = torch.zeros(0, 32, device=DEVICE)
    empty = torch.zeros(0, 2, dtype=torch.long, device=DEVICE)
    assert moe.fused_experts(x, empty, empty.float(), w_up, w_down).shape == (0, 32)
    x = torch.randn(3, 32, device=DEVICE)
    index, weights = (t.to(DEVICE) for t in _routing(3, 4, 2, seed=0))
    with pytest.raises(ValueError, match="w_down"):
        moe.fused_experts(x, index, weights, w_up, w_down[:, :, :8])
    with pytest.raises(ValueError, match="top_k_weights"):
        moe.fused_experts(x, index, weights[:, :1], w_up, w_down)
    with pytest.raises(TypeError, match="top_k_index"):
        moe.fused_experts(x, index.float(), weights, w_up, w_down)
    with pytest.raises(ValueError, match="up_bias"):
        moe.fused_experts(x, index, weights, w_up, w_down, up_bias=torch.zeros(4, 3, device=DEVICE))
    with pytest.raises(ValueError, match="kind"):
        moe.fused_experts(x, index, weights, w_up, w_down, activation=Activation("relu"))
    with pytest.raises(ValueError, match="gate_limit"):
        moe.fused_experts(x, index, weights, w_up, w_down, activation=Activation(gate_limit=math.nan))


@requires_triton
def test_config_table_covers_decode_and_prefill_row_counts():
    triton_moe = kernels._triton_module("triton_moe")
    for pairs in (1, 8, 64, 512, 4096, 65536):
        config = triton_moe.choose_config(pairs, 64, 2048, 1024, 1024, 2)
        assert config.block_m in (16, 32, 64)
        for block_n, block_k, warps, stages in (config.up, config.down):
            assert 16 <= block_n <= 256 and 16 <= block_k <= 256 and warps in (4, 8) and stages >= 2
    small = triton_moe.choose_config(8, 64, 2048, 1024, 1024, 2)
    assert small.block_m == 16  # one decode row: a 16-row block
    assert triton_moe.choose_config(8, 4, 32, 16, 16, 4).up[:2] == (16, 32)  # tiles fitted to tiny dims
