"""The Mamba 2 fast path of hybrid models (`hf_paged.attention.mamba2`), run on the CPU (`FORCE`) against
transformers: greedy tokens of Granite 4 hybrid, Bamba, Falcon-H1 (with and without its gated RMS norm) and
Nemotron-H equal `generate()`'s with chunked prefill, prefix hits resumed from state checkpoints, both preemption
modes and parallel samples, with every step through the fast path (the mixers' own forward never runs per chunk);
the torch reference of the variable-length scan (`kernels.reference_gla`, what flash-linear-attention's
`chunk_simple_gla` computes on the GPU) equals transformers' own `mamba2_chunk_scan`.

The tiny configs make every quirk count: two groups of B / C (repeated to the heads), a `time_step_limit` whose upper
bound clamps most steps of the chunk scan (not the one-token update: transformers clamps only the former), a
convolution with and without bias, Falcon-H1's multipliers and grouped norm (gate before the norm), Nemotron-H's
grouped norm, and prompts longer than the models' scan chunks (16 tokens)."""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pytest
import torch

import hf_paged
from hf_paged.attention import mamba2, varlen
from hf_paged.kernels.reference_gla import chunk_simple_gla_reference

try:
    from tests.helpers import (
        assert_all_returned,
        dense,
        dense_generate,
        engine_greedy,
        generating_model,
        greedy_references,
        random_prompts,
    )
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import (
        assert_all_returned,
        dense,
        dense_generate,
        engine_greedy,
        generating_model,
        greedy_references,
        random_prompts,
    )

# the file on one worker: the cached models and transformers' references are built once
pytestmark = pytest.mark.xdist_group("mamba2_fast")

LIMIT = (0.0, 0.9)  # softplus(dt + dt_bias) is about 1.3 at the jittered init: the clamp bites
VARIANTS = {
    "granitemoehybrid": ("granitemoehybrid", dict(mamba_n_groups=2, time_step_limit=LIMIT)),
    "bamba": ("bamba", dict(mamba_n_groups=2, mamba_conv_bias=False, time_step_limit=LIMIT)),
    "falcon_h1": ("falcon_h1", dict(mamba_n_groups=2, time_step_limit=LIMIT, ssm_in_multiplier=0.8,
                                    ssm_multipliers=[0.9, 1.2, 0.7, 1.1, 1.3])),
    "falcon_h1_norm": ("falcon_h1", dict(mamba_n_groups=2, mamba_rms_norm=True, mamba_norm_before_gate=False,
                                         ssm_multipliers=[1.1, 0.8, 1.2, 0.9, 0.7])),
    "nemotron_h": ("nemotron_h", dict(layers_block_type=["linear_attention", "full_attention", "mlp"],
                                      mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                                      chunk_size=16)),
}
LENGTHS = (1, 23, 7, 40, 3, 16, 11)


@functools.cache
def model(variant: str):
    family, overrides = VARIANTS[variant]
    return generating_model(family, **overrides)


@functools.cache
def references(variant: str) -> tuple[list[list[int]], list[list[int]]]:
    return greedy_references(model(variant), LENGTHS, seed=5)


@pytest.fixture
def spied(monkeypatch):
    """FORCE on, and counters: the fast path's ragged and decode calls, and the mixers' own forward calls by token
    count (the generic path's), once `watch(engine)` is called (after the engine profiled the states with that
    forward)."""
    monkeypatch.setattr(mamba2, "FORCE", True)
    calls = {"ragged": 0, "fast_decode": 0, "chunk": 0, "decode": 0}
    for name, key in (("ragged", "ragged"), ("decode", "fast_decode")):
        original = getattr(mamba2.Mamba2Path, name)

        def counted(*args, _original=original, _key=key, **kwargs):
            calls[_key] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(mamba2.Mamba2Path, name, counted)

    def watch(engine):
        modules = [m for m in engine.model.modules() if "_hf_paged_mamba2" in m.__dict__]
        assert modules and all(isinstance(m._hf_paged_mamba2, mamba2.Mamba2Path) for m in modules)
        for module in modules:
            own = module._hf_paged_forward

            def counted(*args, _own=own, **kwargs):
                hidden = args[0] if args else next(iter(kwargs.values()))
                calls["chunk" if hidden.shape[1] > 1 else "decode"] += 1
                return _own(*args, **kwargs)

            monkeypatch.setitem(module.__dict__, "_hf_paged_forward", counted)
        return calls

    return watch


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fast_path_gives_transformers_tokens_with_chunked_prefill(variant, spied):
    """Prompts cut into chunks of at most 6 tokens (states carried between chunks, decoding rows in the same steps):
    every step runs through the fast path, never the mixer's own forward."""
    prompts, refs = references(variant)
    engine = hf_paged.Engine(model(variant), num_blocks=96, block_size=4, max_num_batched_tokens=6, max_num_seqs=3)
    calls = spied(engine)
    assert engine_greedy(engine, prompts) == refs
    assert calls["ragged"] > 0 and calls["chunk"] == calls["decode"] == 0, calls
    assert_all_returned(engine)


def test_fast_paths_off_runs_the_generic_adapter(spied, monkeypatch):
    """`varlen.FAST_PATHS` off (the benchmarks' `*_generic` systems): the mixers' own forward runs per chunk and for
    the decoding rows, the fast path never, and the tokens are the same."""
    monkeypatch.setattr(varlen, "FAST_PATHS", False)
    prompts, refs = references("granitemoehybrid")
    engine = hf_paged.Engine(model("granitemoehybrid"), num_blocks=96, block_size=4, max_num_batched_tokens=6,
                             max_num_seqs=3)
    calls = spied(engine)
    assert engine_greedy(engine, prompts) == refs
    assert calls["ragged"] == calls["fast_decode"] == 0 and calls["chunk"] > 0 and calls["decode"] > 0, calls
    assert_all_returned(engine)


@pytest.mark.parametrize("variant", ["granitemoehybrid", "falcon_h1_norm"])
def test_static_decode_steps_run_the_fast_decode(variant, spied):
    """The GPU's decode path (static buffers, padded buckets, what CUDA graphs record) runs decode-only steps through
    the fast path's `decode`, steps with a prefill chunk through `ragged`. Falcon-H1 with its gated norm (what its
    checkpoints use) is the case the mixer's own decode form cannot run for more than one row."""
    prompts, refs = references(variant)
    engine = hf_paged.Engine(model(variant), num_blocks=96, block_size=4, max_num_batched_tokens=8)
    engine.runner.decode_mode = "static"
    calls = spied(engine)
    assert engine_greedy(engine, prompts) == refs
    assert engine.runner.graph_steps > 0
    assert calls["ragged"] > 0 and calls["fast_decode"] > 0 and calls["chunk"] == calls["decode"] == 0, calls
    assert_all_returned(engine)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["granitemoehybrid", "falcon_h1_norm"])
def test_compiled_decode_step_keeps_working(variant, spied):
    """With `compile_decode`, decode-only steps run the compiled layers (the fast path's `decode` traced, its states
    through the opaque state ops) and ragged steps the fast path eagerly: transformers' tokens, no graph break."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    prompts, refs = references(variant)
    engine = hf_paged.Engine(model(variant), num_blocks=96, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                             compile_decode=True)
    try:
        calls = spied(engine)
        assert engine_greedy(engine, prompts) == refs
        assert engine.runner.graph_steps > 0 and engine.runner.compile_failure is None
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert calls["ragged"] > 0 and calls["fast_decode"] > 0 and calls["chunk"] == calls["decode"] == 0, calls
        assert_all_returned(engine)
    finally:
        engine.close()
        torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_tokens(mode, spied):
    """Recompute and swap preemption give transformers' tokens. A variant without a biting time-step limit: a
    recomputed sequence runs its generated tokens through the chunk scan, which transformers clamps, where its own
    generate() ran them through the one-token update, which it does not (so with the clamp they differ by design)."""
    prompts, refs = references("falcon_h1_norm")
    engine = hf_paged.Engine(model("falcon_h1_norm"), num_blocks=14, block_size=4, preemption_mode=mode,
                             swap_space=0.01 if mode == "swap" else 0.0)
    calls = spied(engine)
    assert engine_greedy(engine, prompts) == refs
    assert engine.scheduler.num_preemptions[mode] > 0 and calls["ragged"] > 0 and calls["chunk"] == 0
    assert_all_returned(engine)


@pytest.mark.parametrize("variant", ["granitemoehybrid", "nemotron_h"])
def test_prefix_hits_resume_from_state_checkpoints(variant, spied):
    """Prompts sharing a 22-token system prompt: the later ones resume from the state checkpoint of its whole blocks
    (a chunk that continues a restored state) and give transformers' tokens."""
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, 200, (22,), generator=g).tolist()
    prompts = [system + torch.randint(3, 200, (int(n),), generator=g).tolist()
               for n in torch.randint(2, 9, (6,), generator=g)]
    refs = _transformers_tokens(model(variant), prompts)
    engine = hf_paged.Engine(model(variant), num_blocks=160, block_size=4)
    calls = spied(engine)
    assert engine_greedy(engine, prompts[:1]) + engine_greedy(engine, prompts[1:]) == refs
    assert engine.prefix_cache_stats().hit_tokens >= 4 * 20
    assert engine.block_manager.state.checkpoint_hits >= 4 and calls["chunk"] == 0
    assert_all_returned(engine)


def _transformers_tokens(m, prompts: list[list[int]], new: int = 8) -> list[list[int]]:
    """transformers' greedy tokens (DynamicCache, the plain model), `new` per prompt, on the model's device."""
    device = next(m.parameters()).device
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        out = dense_generate(m, input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False, eos_token_id=None)
        outs.append(out[0, len(p):].tolist())
    return outs


def test_parallel_samples_score_as_transformers_scores_them(spied):
    """Forked samples each carry their own state: every sample's log-probabilities equal those of transformers'
    forward over that very sequence (a variant without a biting time-step limit: that forward runs the sampled tokens
    through the chunk scan, see `test_preemption_keeps_tokens`)."""
    m = model("falcon_h1_norm")
    prompts = random_prompts((9, 21), seed=2, vocab=200)
    engine = hf_paged.Engine(m, num_blocks=96, block_size=4, max_num_batched_tokens=8)
    calls = spied(engine)
    params = hf_paged.SamplingParams(max_new_tokens=6, do_sample=True, num_return_sequences=3, seed=11, logprobs=1,
                                     ignore_eos=True)
    outputs = engine.generate(prompts, params)
    assert calls["ragged"] > 0 and calls["chunk"] == calls["decode"] == 0
    for prompt, out in zip(prompts, outputs):
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # forks that went their own ways
        for completion in out.outputs:
            with dense(m), torch.no_grad():
                logits = m(input_ids=torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1 : -1]
            expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion.token_ids)[:, None])
            got = torch.tensor([lp for lp, _ in completion.logprobs])
            torch.testing.assert_close(got, expected[:, 0], atol=2e-4, rtol=1e-4)
    assert_all_returned(engine)


@pytest.mark.parametrize("variant", ["granitemoehybrid", "falcon_h1"])
def test_bfloat16_matches_the_generic_path(variant, monkeypatch):
    """In bfloat16 the fast path rounds where transformers' own code does (the chunk scan's output reaches the norm in
    float32, the one-token update's in bfloat16): the same tokens and log-probabilities as the generic adapter, which
    runs the mixer's own forward, over ragged steps mixing prefill chunks and decoding rows."""
    family, overrides = VARIANTS[variant]
    m = generating_model(family, **overrides).to(torch.bfloat16)
    prompts = random_prompts((1, 23, 7, 40, 11), seed=5, vocab=200)
    params = hf_paged.SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=1)
    runs = []
    for force in (False, True):
        monkeypatch.setattr(mamba2, "FORCE", force)
        engine = hf_paged.Engine(m, num_blocks=96, block_size=4, max_num_batched_tokens=12, max_num_seqs=4)
        runs.append([o.outputs[0] for o in engine.generate(prompts, params)])
        assert_all_returned(engine)
    for generic, fast in zip(*runs):
        assert fast.token_ids == generic.token_ids
        torch.testing.assert_close(torch.tensor([lp for lp, _ in fast.logprobs]),
                                   torch.tensor([lp for lp, _ in generic.logprobs]), atol=2e-2, rtol=0)


def test_reference_scan_equals_transformers_chunk_scan():
    """Mamba 2 as a scalar-gated linear recurrence (q = C, k = B repeated to the heads, v = x * dt, g = dt * A, plus
    D * x): the variable-length reference over several packed sequences, each from its own initial state (and one
    longer than a 64-token chunk), equals transformers' `mamba2_chunk_scan` sequence by sequence, outputs and final
    states, with `dt` clamped to a time-step limit and two groups."""
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    g = torch.Generator().manual_seed(0)
    heads, dim, size, groups = 4, 8, 6, 2
    lens = [5, 70, 1, 17]
    tokens = sum(lens)
    x = torch.randn(tokens, heads, dim, generator=g)
    b, c = (torch.randn(tokens, groups, size, generator=g) for _ in range(2))
    dt, dt_bias = torch.randn(tokens, heads, generator=g), torch.rand(heads, generator=g)
    a, d = -2 * torch.rand(heads, generator=g), torch.randn(heads, generator=g)
    initial = torch.randn(len(lens), heads, dim, size, generator=g)
    outs, finals, start = [], [], 0
    for i, n in enumerate(lens):
        out, final = mamba2_chunk_scan(x[None, start : start + n], dt[None, start : start + n], a,
                                       b[None, start : start + n], c[None, start : start + n], chunk_size=16, D=d,
                                       dt_bias=dt_bias, initial_states=initial[i : i + 1], dt_softplus=True,
                                       dt_limit=LIMIT, return_final_states=True)
        outs.append(out[0])
        finals.append(final[0])
        start += n
    step = torch.nn.functional.softplus(dt + dt_bias).clamp(*LIMIT)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]))
    q, k = c.repeat_interleave(2, 1)[None], b.repeat_interleave(2, 1)[None]
    out, final = chunk_simple_gla_reference(q, k, (x * step[..., None])[None], (step * a)[None], cu,
                                            initial.transpose(-1, -2), scale=1.0)
    torch.testing.assert_close(out[0] + d[:, None] * x, torch.cat(outs), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final.transpose(-1, -2), torch.stack(finals), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_simple_gla_reference(q, k, x[None], step[None], cu + 1, initial.transpose(-1, -2))
    with pytest.raises(ValueError, match="shapes"):
        chunk_simple_gla_reference(q, k, x[None], step[None], cu[:-1], initial.transpose(-1, -2))


def test_ragged_step_ignores_padding_rows():
    """A CUDA ragged step pads its tokens to a bucket (rows of no sequence): the fast path computes the sequences'
    rows as without the padding, gives the padding zeros and leaves the states as without it."""
    module = next(m for m in model("bamba").modules() if mamba2.Mamba2Path.supports(m))
    path = mamba2.Mamba2Path(module)
    g = torch.Generator().manual_seed(0)
    layer = module.layer_idx
    conv = torch.randn(4, module.conv_dim, module.conv_kernel_size, generator=g)
    state = torch.randn(4, module.num_heads, module.head_dim, module.ssm_state_size, generator=g)

    class Pool:
        def __init__(self):
            self.tensors = {(layer, "conv", 0): conv.clone(), (layer, "recurrent", 0): state.clone()}

    hidden = torch.randn(9, module.in_proj.in_features, generator=g)
    rows = [(0, 5, False), (5, 1, True), (6, 3, True)]  # a fresh prompt, a decoding row, a resumed chunk
    slots = torch.tensor([2, 0, 3])
    pool, padded_pool = Pool(), Pool()
    with torch.no_grad():
        out = path.ragged(module, hidden, rows, slots, pool)
        padded = path.ragged(module, torch.cat([hidden, torch.randn(4, hidden.shape[1], generator=g)]), rows, slots,
                             padded_pool)
    torch.testing.assert_close(padded[:9], out)
    assert not padded[9:].any()
    for key, t in pool.tensors.items():
        torch.testing.assert_close(padded_pool.tensors[key], t)
    assert not torch.equal(pool.tensors[(layer, "recurrent", 0)][[0, 2, 3]], state[[0, 2, 3]])
    torch.testing.assert_close(pool.tensors[(layer, "recurrent", 0)][1], state[1])  # slot 1: no sequence's


def test_only_verified_layouts_get_the_fast_path():
    """The four mixers of transformers get it; another class with the same attributes (a subclass defined elsewhere,
    the pure Mamba 2 model's mixer) and a layout that does not fit (a convolution that is not depthwise) do not."""
    module = next(m for m in model("granitemoehybrid").modules() if type(m).__name__ == "GraniteMoeHybridMambaLayer")
    assert mamba2.Mamba2Path.supports(module)
    other = type("GraniteMoeHybridMambaLayer", (type(module),), {"__module__": __name__})
    module.__class__ = other
    try:
        assert not mamba2.Mamba2Path.supports(module)
    finally:
        module.__class__ = other.__mro__[1]
    pure = generating_model("mamba2")
    assert not any(mamba2.Mamba2Path.supports(m) for m in pure.modules())
    conv = module.conv1d
    module.conv1d = torch.nn.Conv1d(conv.in_channels, conv.in_channels, conv.kernel_size[0], groups=2)
    try:
        assert not mamba2.Mamba2Path.supports(module)
    finally:
        module.conv1d = conv


def test_warm_up_runs_the_scan_per_layer_shape(monkeypatch):
    """`mamba2.warm_up` calls fla's variable-length scan a few times per layer shape, each call consistent
    (cu_seqlens from 0 to the tokens, one initial state `[heads, state, head_dim]` a sequence, float32 log decays);
    without CUDA (or fla) it does nothing."""
    assert mamba2.warm_up(model("bamba"), 512) == 0  # on the CPU: nothing to warm
    calls = []

    def fake_fla(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu):
        tokens = q.shape[1]
        assert q.shape == k.shape == (1, tokens, 4, 16) and v.shape == (1, tokens, 4, 32) and scale == 1.0
        assert g.shape == (1, tokens, 4) and g.dtype == torch.float32 and (g <= 0).all()
        assert cu_seqlens_cpu[0] == 0 and cu_seqlens_cpu[-1] == tokens and (cu_seqlens_cpu.diff() > 0).all()
        assert initial_state.shape == (len(cu_seqlens_cpu) - 1, 4, 16, 32) and output_final_state
        calls.append((tokens, len(cu_seqlens_cpu) - 1))

    monkeypatch.setattr(mamba2, "_fla_simple_gla", lambda: fake_fla)
    monkeypatch.setattr(mamba2, "_fast_shapes", lambda m: {(4, 16, 32, torch.float32, torch.device("cpu"))})
    assert mamba2.warm_up(model("bamba"), 512) == len(calls) >= 3
    assert max(t for t, _ in calls) == 512 and min(t for t, _ in calls) == 1 and max(n for _, n in calls) == 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                    reason="needs CUDA and flash-linear-attention")
@pytest.mark.parametrize("variant", ["granitemoehybrid", "falcon_h1_norm", "nemotron_h"])
def test_fla_scan_and_tokens_on_cuda(variant, monkeypatch):
    """On the GPU: fla's `chunk_simple_gla` equals the torch reference (packed sequences, initial states), and the
    engine (fast path with fla, chunked prefill, CUDA graphs) gives transformers' greedy tokens in float32."""
    fla = mamba2._fla_simple_gla()
    g = torch.Generator().manual_seed(1)
    lens = [3, 130, 1, 64, 17]
    tokens, heads, size, dim = sum(lens), 4, 16, 32
    q, k = (torch.randn(1, tokens, heads, size, generator=g).cuda() for _ in range(2))
    v = torch.randn(1, tokens, heads, dim, generator=g).cuda()
    decay = -torch.rand(1, tokens, heads, generator=g).cuda()
    initial = torch.randn(len(lens), heads, size, dim, generator=g).cuda()
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]))
    out, final = fla(q, k, v, decay, scale=1.0, initial_state=initial, output_final_state=True, cu_seqlens=cu.cuda(),
                     cu_seqlens_cpu=cu)
    ref_out, ref_final = chunk_simple_gla_reference(q, k, v, decay, cu, initial)
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(final, ref_final, rtol=2e-2, atol=2e-2)

    m = model(variant).cuda()
    try:
        prompts = random_prompts((5, 37, 70, 2, 19), seed=3, vocab=200)
        refs = _transformers_tokens(m, prompts)
        used = []
        monkeypatch.setattr(mamba2, "_fla_simple_gla", lambda: (lambda *a, **kw: used.append(1) or fla(*a, **kw)))
        engine = hf_paged.Engine(m, num_blocks=64, block_size=16, max_num_batched_tokens=48)
        used.clear()  # (the engine's warm-up may have called it)
        assert engine_greedy(engine, prompts) == refs
        assert used and engine.runner.graph_steps > 0
        assert_all_returned(engine)
        engine.close()
    finally:
        m.cpu()

