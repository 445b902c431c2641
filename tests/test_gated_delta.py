"""The gated delta rule on slotted states (`hf_paged.kernels.gdn_decode`) against transformers' own recurrent
reference, for both backends (Triton runs under its interpreter without CUDA), and the GPU fast path of Qwen3.5's
gated DeltaNet layers (`hf_paged.attention.gated_deltanet`) run on the CPU (`FORCE`) against transformers' tokens."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.attention import gated_deltanet
from hf_paged.kernels.gated_delta import gdn_decode

try:
    from tests.helpers import assert_all_returned, engine_greedy
    from tests.test_hybrid import hybrid, references
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import assert_all_returned, engine_greedy
    from test_hybrid import hybrid, references

triton = pytest.importorskip("triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dims", [(2, 8, 16), (3, 16, 8)])
def test_decode_matches_transformers_recurrent_rule_in_place(backend, dims, monkeypatch):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    monkeypatch.setenv("HF_PAGED_BACKEND", backend)
    heads, dk, dv = dims
    gen = torch.Generator().manual_seed(3)
    rows, num_slots = 4, 7
    q, k = (torch.randn(rows, heads, dk, generator=gen) for _ in range(2))
    v = torch.randn(rows, heads, dv, generator=gen)
    g = -torch.rand(rows, heads, generator=gen)
    beta = torch.rand(rows, heads, generator=gen)
    state = torch.randn(num_slots, heads, dk, dv, generator=gen)
    slots = torch.tensor([5, 0, 3, 6])
    before = state.clone()
    out = gdn_decode(q, k, v, g, beta, state, slots, scale=dk ** -0.5)
    for b in range(rows):  # transformers: [batch, time, heads, dim], state [batch, heads, K, V]
        ref, final = torch_recurrent_gated_delta_rule(
            q[b : b + 1, None], k[b : b + 1, None], v[b : b + 1, None], g[b : b + 1, None], beta[b : b + 1, None],
            initial_state=before[slots[b]][None].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[b], ref[0, 0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state[slots[b]], final[0], rtol=1e-4, atol=1e-5)
    untouched = [s for s in range(num_slots) if s not in slots.tolist()]
    assert torch.equal(state[untouched], before[untouched])  # other slots are never written


def test_decode_refuses_bad_shapes():
    q = torch.zeros(2, 2, 8)
    with pytest.raises(ValueError, match="shapes"):
        gdn_decode(q, q, torch.zeros(2, 3, 8), torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(4, 2, 8, 8),
                   torch.tensor([0, 1]), 1.0)
    with pytest.raises(ValueError, match="slots"):
        gdn_decode(q, q, q, torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(4, 2, 8, 8), torch.tensor(0), 1.0)


@pytest.mark.parametrize("path", ["eager", "static-chunked", pytest.param("compiled", marks=pytest.mark.slow)])
def test_fast_path_gives_transformers_tokens(path, monkeypatch):
    """The fast path (varlen convolution, `gdn_decode`, the chunked rule over all prefill chunks) on every engine
    path: ragged steps that mix decoding rows with prefill chunks resumed from a state, the static decode buffers,
    and the compiled decode step (the opaque ops). The torch backend: the Triton kernel is compared above, and the
    interpreter would run the attention kernels too (minutes)."""
    monkeypatch.setattr(gated_deltanet, "FORCE", True)
    calls = {"decode": 0, "ragged": 0}
    for name in calls:
        original = getattr(gated_deltanet.GatedDeltaNetPath, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(gated_deltanet.GatedDeltaNetPath, name, counted)
    model = hybrid("qwen3_5_text")
    prompts, refs = references("qwen3_5_text")
    kwargs = dict(num_blocks=96, block_size=4)
    if path == "static-chunked":
        kwargs.update(max_num_batched_tokens=7, max_num_seqs=3)
    if path == "compiled":
        torch._dynamo.reset()
        kwargs.update(compile_decode=True, max_num_seqs=8)
    engine = hf_paged.Engine(model, **kwargs)
    try:
        if path == "static-chunked":
            engine.runner.decode_mode = "static"
        assert sum("_hf_paged_fast" in m.__dict__ for m in model.modules()) == 3  # qwen3_5's three DeltaNet layers
        assert engine_greedy(engine, prompts) == refs
        assert calls["ragged"] > 0 and (calls["decode"] > 0 or path == "eager"), calls
        if path != "eager":
            assert engine.runner.graph_steps > 0
        assert_all_returned(engine)
    finally:
        engine.close()
        if path == "compiled":
            torch._dynamo.reset()


def test_ragged_step_ignores_padding_rows():
    """A CUDA ragged step pads its tokens to a bucket (rows of no sequence): the fast path computes the sequences'
    rows as without the padding, gives the padding zeros and leaves the states as without it."""
    module = hybrid("qwen3_5_text").model.layers[0].linear_attn
    path = gated_deltanet.GatedDeltaNetPath(module)
    gen = torch.Generator().manual_seed(0)

    class Pool:
        def __init__(self):
            conv = torch.randn(4, module.conv1d.in_channels, path.kernel, generator=gen)
            state = torch.randn(4, module.num_v_heads, module.head_k_dim, module.head_v_dim, generator=gen)
            self.tensors = {(0, "conv", 0): conv, (0, "recurrent", 0): state}

        def clone(self):
            other = Pool.__new__(Pool)
            other.tensors = {key: t.clone() for key, t in self.tensors.items()}
            return other

    hidden = torch.randn(9, module.in_proj_qkv.in_features, generator=gen)
    rows = [(0, 5, False), (5, 1, True), (6, 3, True)]  # a fresh prompt, a decoding row, a resumed chunk
    slots = torch.tensor([2, 0, 3])
    pool = Pool()
    padded_pool = pool.clone()
    with torch.no_grad():
        out = path.ragged(module, hidden, rows, slots, pool)
        padded = path.ragged(module, torch.cat([hidden, torch.randn(4, hidden.shape[1], generator=gen)]), rows, slots,
                             padded_pool)
    torch.testing.assert_close(padded[:9], out)
    assert not padded[9:].any()
    for key, t in pool.tensors.items():
        torch.testing.assert_close(padded_pool.tensors[key], t)


def test_broken_fla_install_is_reported_not_swallowed(monkeypatch):
    """fla-core whose import fails (e.g. its dependency einops missing) would make prefill fall back to the slow torch
    reference silently: the fast path warns with the reason and falls back; fla simply absent stays quiet."""
    import importlib.machinery
    import importlib.util
    import sys
    import types
    import warnings

    gated_deltanet._fla_chunk.cache_clear()
    with monkeypatch.context() as patch, warnings.catch_warnings():
        patch.setattr(importlib.util, "find_spec", lambda name, *args: None)  # not installed
        warnings.simplefilter("error")
        assert gated_deltanet._fla_chunk() is None
    gated_deltanet._fla_chunk.cache_clear()
    broken = types.ModuleType("fla")
    broken.__path__ = []  # a package without its `ops`: the import of the kernel fails
    broken.__spec__ = importlib.machinery.ModuleSpec("fla", None, is_package=True)
    monkeypatch.setitem(sys.modules, "fla", broken)
    with pytest.warns(UserWarning, match="cannot be imported"):
        assert gated_deltanet._fla_chunk() is None
    gated_deltanet._fla_chunk.cache_clear()


def test_warm_up_covers_the_counts_that_compile_anew(monkeypatch):
    """`gated_deltanet.warm_up` calls fla's variable-length chunk once per count of `warm_up_counts` (every l2-norm
    block count up to the token limit, token counts that are and are not multiples of 16, 1 / 3 / 16 sequences, short
    steps), with each call's inputs consistent: cu_seqlens from 0 to the tokens, one initial state a sequence. Without
    CUDA (or fla) it does nothing."""
    counts = gated_deltanet.warm_up_counts(8192, 32)
    assert {-(-t * 32 // 65536) for t, _ in counts} == {1, 2, 3, 4}
    assert {t % 16 == 0 for t, _ in counts} == {True, False} and {n for _, n in counts} == {1, 3, 16}
    assert min(t for t, _ in counts) == 1 and max(t for t, _ in counts) == 8192
    assert all(0 < n <= t <= 64 for t, n in gated_deltanet.warm_up_counts(64, 4))

    model = torch.nn.Linear(2, 2)
    assert gated_deltanet.warm_up(model, 512) == 0  # no fast path on CUDA: nothing to warm
    calls = []

    def fake_fla(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                 use_qk_l2norm_in_kernel):
        tokens = q.shape[1]
        assert q.shape == k.shape == (1, tokens, 4, 8) and v.shape == (1, tokens, 4, 16)
        assert g.shape == beta.shape == (1, tokens, 4) and g.dtype == torch.float32 and (g <= 0).all()
        assert cu_seqlens_cpu[0] == 0 and cu_seqlens_cpu[-1] == tokens and (cu_seqlens_cpu.diff() > 0).all()
        assert initial_state.shape == (len(cu_seqlens_cpu) - 1, 4, 8, 16) and output_final_state
        calls.append((tokens, len(cu_seqlens_cpu) - 1))

    monkeypatch.setattr(gated_deltanet, "_fla_chunk", lambda: fake_fla)
    monkeypatch.setattr(gated_deltanet, "_fast_shapes",
                        lambda m: {(4, 8, 16, torch.float32, torch.device("cpu"))})
    assert gated_deltanet.warm_up(model, 512) == len(calls) == len(gated_deltanet.warm_up_counts(512, 4))
    assert calls == gated_deltanet.warm_up_counts(512, 4)
