"""One Mamba 2 decode token on slotted states (`hf_paged.kernels.mamba2_decode`): the torch reference equals
transformers' own `mamba2_selective_state_update` bit for bit (float32 and bfloat16), the Triton kernel (under its
interpreter without CUDA; at a Granite-4.0-H-Tiny shape on CUDA) equals the reference, each state is updated in its
slot and no other slot is touched. The fast path that calls it runs in `tests/test_mamba2_fast.py`."""

from __future__ import annotations

import pytest
import torch
from transformers.models.bamba.modeling_bamba import mamba2_selective_state_update

from hf_paged.kernels.mamba2_decode import mamba2_decode, mamba2_decode_reference

triton = pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel under Triton's interpreter without CUDA


def inputs(rows: int, heads: int, dim: int, size: int, groups: int, dtype: torch.dtype, num_slots: int,
           device: str = "cpu", d_dtype: torch.dtype | None = None, seed: int = 0) -> dict:
    """Random decode inputs as the fast path makes them (`x`, `dt`, B, C in the model's dtype, `A` float32), `dt`
    reaching both ends of softplus (over its threshold 20, and where 1 + exp(dt) rounds to 1)."""
    gen = torch.Generator().manual_seed(seed)
    dt = torch.randn(rows, heads, generator=gen) * 2
    dt[0, 0], dt[-1, -1] = 25.0, -30.0
    args = dict(x=torch.randn(rows, heads, dim, generator=gen), dt=dt, a=-torch.rand(heads, generator=gen) * 4,
                b=torch.randn(rows, groups, size, generator=gen), c=torch.randn(rows, groups, size, generator=gen),
                d=torch.randn(heads, generator=gen), dt_bias=torch.randn(heads, generator=gen),
                state=torch.randn(num_slots, heads, dim, size, generator=gen),
                slots=torch.randperm(num_slots, generator=gen)[:rows])
    for name in ("x", "dt", "b", "c", "d", "dt_bias"):
        args[name] = args[name].to(dtype if name != "d" or d_dtype is None else d_dtype)
    return {name: t.to(device) for name, t in args.items()}


def transformers_update(args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' update called as its decode form calls it, on the rows' states gathered: (y, new states)."""
    x, size = args["x"], args["b"].shape[-1]
    dim = x.shape[-1]
    states = args["state"].index_select(0, args["slots"])
    y = mamba2_selective_state_update(
        states, x, args["dt"][:, :, None].expand(-1, -1, dim), args["a"][:, None, None].expand(-1, dim, size),
        args["b"], args["c"], args["d"][:, None].expand(-1, dim), z=None,
        dt_bias=args["dt_bias"][:, None].expand(-1, dim), dt_softplus=True)
    return y, states


def assert_close_but_flips(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    """`actual` within (`rtol`, `atol`) of `expected` but for rare flips: a 16-bit rounding that an ulp of float32
    (the GPU's `exp`, a fused multiply-add, another summation order) tips the other way moves a value, or a head's
    whole state, by an ulp of bfloat16. At most one element in a thousand (two in a small tensor) off, none by more
    than 2 % of the tensor's largest value: a rounding put in the wrong place moves most elements."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    a, e = actual.float(), expected.float()
    off = ~torch.isclose(a, e, rtol=rtol, atol=atol)
    assert int(off.sum()) <= max(2, e.numel() // 1000), f"{int(off.sum())} of {e.numel()} differ"
    assert float((a - e).abs().max()) <= 0.02 * float(e.abs().max())


def assert_slots_updated(args: dict, before: torch.Tensor, new_states: torch.Tensor, rtol: float,
                         atol: float) -> None:
    slots = args["slots"]
    assert_close_but_flips(args["state"][slots], new_states, rtol, atol)
    untouched = [s for s in range(before.shape[0]) if s not in slots.tolist()]
    assert torch.equal(args["state"][untouched], before[untouched])  # other slots are never written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 2])
def test_reference_equals_transformers_update_bit_for_bit(dtype, groups):
    args = inputs(rows=5, heads=4, dim=6, size=5, groups=groups, dtype=dtype, num_slots=9)
    before = args["state"].clone()
    expected, states = transformers_update(args)
    y = mamba2_decode_reference(**args)
    assert y.dtype == dtype and torch.equal(y, expected)
    assert_slots_updated(args, before, states, rtol=0, atol=0)


@pytest.mark.parametrize(("dims", "dtype", "d_dtype"), [
    ((4, 6, 5, 1), torch.float32, None),
    ((4, 6, 5, 2), torch.bfloat16, None),  # head_dim and state sizes masked: not powers of two
    ((4, 6, 5, 2), torch.bfloat16, torch.float32),  # x * D in float32 (D's dtype promotes over x's)
    ((2, 80, 128, 2), torch.bfloat16, None),  # head_dim over 32-row blocks: three programs a head, one masked
    ((4, 8, 16, 4), torch.float16, None),
])
def test_triton_kernel_equals_reference_in_place(dims, dtype, d_dtype, monkeypatch):
    """Under Triton's interpreter without CUDA: rows in a shuffled slot order, B / C groups repeated to the heads."""
    heads, dim, size, groups = dims
    args = inputs(rows=3, heads=heads, dim=dim, size=size, groups=groups, dtype=dtype, num_slots=7,
                  device=DEVICE, d_dtype=d_dtype)
    before = args["state"].clone()
    reference = {**args, "state": args["state"].clone()}
    expected = mamba2_decode_reference(**reference)
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    y = mamba2_decode(**args)
    assert y.dtype == dtype and y.shape == args["x"].shape
    assert_close_but_flips(y, expected, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
    assert_slots_updated(args, before, reference["state"][args["slots"]], rtol=1e-5, atol=1e-5)


def test_refuses_bad_arguments():
    args = inputs(rows=2, heads=4, dim=6, size=5, groups=2, dtype=torch.float32, num_slots=3)
    with pytest.raises(ValueError, match="shapes"):
        mamba2_decode(**{**args, "b": torch.zeros(2, 3, 5)})  # 3 groups do not divide 4 heads
    with pytest.raises(ValueError, match="shapes"):
        mamba2_decode(**{**args, "state": torch.zeros(3, 4, 6, 4)})
    with pytest.raises(TypeError, match="dt .*x's dtype"):
        mamba2_decode(**{**args, "dt": args["dt"].bfloat16()})
    with pytest.raises(ValueError, match="slots must have 1 dims"):
        mamba2_decode(**{**args, "slots": args["slots"][None]})
    with pytest.raises(TypeError, match="slots must have dtype"):
        mamba2_decode(**{**args, "slots": args["slots"].float()})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernel_on_cuda_at_a_granite_shape(dtype):
    """Granite-4.0-H-Tiny's Mamba 2 layer (48 heads of 64, state 128, one group) at 64 rows of a 96-slot pool."""
    args = inputs(rows=64, heads=48, dim=64, size=128, groups=1, dtype=dtype, num_slots=96, device="cuda")
    before = args["state"].clone()
    reference = {**args, "state": args["state"].clone()}
    expected = mamba2_decode_reference(**reference)
    y = mamba2_decode(**args)
    assert_close_but_flips(y, expected, rtol=1e-4 if dtype == torch.float32 else 1e-2, atol=1e-4)
    assert_slots_updated(args, before, reference["state"][args["slots"]], rtol=1e-5, atol=1e-4)
