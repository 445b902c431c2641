"""CUDA-only end-to-end checks (skipped without a GPU): the Triton path gives transformers' tokens."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.testing import tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 60, (n,), generator=gen).tolist()
    return [torch.randint(3, 300, (length,), generator=gen).tolist() for length in lengths]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_engine_greedy_matches_dynamic_cache_on_cuda(family):
    model = tiny_model(family).cuda()
    prompts = _prompts(16)
    refs = [
        model.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    hf_paged.enable(model)
    engine = hf_paged.Engine(model, num_blocks=40, block_size=16, max_num_batched_tokens=128)
    outs = engine.generate(prompts, max_new_tokens=24)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert engine.scheduler.num_preemptions["recompute"] > 0
    assert engine.kv_stats().used_blocks == 0


@pytest.mark.parametrize("family,overrides", [
    ("phi3", dict(hidden_size=192, num_attention_heads=2, num_key_value_heads=2)),  # head dim 96, as Phi-3-mini's
    ("llama", dict(head_dim=80)),
])
@pytest.mark.parametrize("compile_decode", [False, True])
def test_head_dims_that_are_no_power_of_two_on_cuda(family, overrides, compile_decode):
    """The Triton kernels compute a head dim of 80 or 96 in a padded tile: transformers' greedy tokens, through the
    eager / graphed and the compiled decode step alike."""
    model = tiny_model(family, **overrides).cuda()
    prompts = _prompts(8, seed=3)
    refs = [
        model.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    engine = hf_paged.Engine(model, num_blocks=64, block_size=16, compile_decode=compile_decode)
    outs = engine.generate(prompts, max_new_tokens=16)
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_drop_in_cache_beam_search_on_cuda():
    model = tiny_model("llama").cuda()
    ids = torch.randint(3, 300, (3, 20), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=16, num_beams=4, do_sample=False)
    hf_paged.enable(model)
    cache = hf_paged.PagedCache(config=model.config, num_blocks=256, block_size=16)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=16, num_beams=4, do_sample=False,
                         past_key_values=cache)
    assert torch.equal(ref, out)
    assert cache.stats().logical_blocks > cache.stats().used_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_equals_eager(dtype):
    model = tiny_model("llama", dtype=dtype).cuda()
    hf_paged.enable(model)
    prompts = _prompts(20, seed=1)
    results = []
    # compiled (Inductor-fused) steps round bf16 differently from eager ones: compared in float32 only
    variants = [(False, False), (True, False)] + ([(True, True)] if dtype == torch.float32 else [])
    for graphs, compiled in variants:
        engine = hf_paged.Engine(model, num_blocks=128, block_size=16, max_num_seqs=32, use_cuda_graph=graphs,
                                 compile_decode=compiled)
        outs = engine.generate(prompts, max_new_tokens=32)
        results.append([o.outputs[0].token_ids for o in outs])
        if graphs:
            assert engine.runner.graph_steps > 0
        assert engine.kv_stats().used_blocks == 0
        engine.close()
    assert all(r == results[0] for r in results[1:])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_cuda_graphs_equal_eager_under_pressure_with_forks_and_prefix_hits(mode):
    """The graph path's table store and buffers through preemption (recompute / swap: tables rebuilt or moved),
    beam forks and parallel samples (copy-on-write), prefix-cache hits and rows swept for reuse: every token equal to
    the eager path's on the same GPU, with and without the compiled decode step."""
    model = tiny_model("llama", dtype=torch.float32).cuda()
    hf_paged.enable(model)
    prompts = _prompts(24, seed=2)
    shared = prompts[0][:32]
    requests = []
    for i, p in enumerate(prompts):
        if i % 6 == 1:
            requests.append((shared + p[:6], dict(max_new_tokens=14, num_beams=3, num_return_sequences=2)))
        elif i % 6 == 2:
            requests.append((shared + p[:4], dict(max_new_tokens=12, do_sample=True, num_return_sequences=2, seed=i)))
        else:
            requests.append((p, dict(max_new_tokens=20)))
    results = []
    for graphs, compiled in ((False, False), (True, False), (True, True)):
        engine = hf_paged.Engine(model, num_blocks=24, block_size=16, max_num_seqs=12, use_cuda_graph=graphs,
                                 preemption_mode=mode, swap_space=0.05 if mode == "swap" else 0.0,
                                 compile_decode=compiled)
        outs = engine.generate([p for p, _ in requests], [hf_paged.SamplingParams(**kw) for _, kw in requests])
        results.append([[o.token_ids for o in r.outputs] for r in outs])
        assert sum(engine.scheduler.num_preemptions.values()) > 0
        assert engine.prefix_cache_stats().hit_tokens > 0
        if graphs:
            assert engine.runner.graph_steps > 0
        assert engine.kv_stats().used_blocks == 0
        engine.close()
    assert all(r == results[0] for r in results[1:])


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("budget", [4096, 24])
def test_prompt_logprobs_on_cuda(caching, budget):
    """Prompt scores (lm-eval's loglikelihood path) on the Triton prefill next to CUDA-graph decode steps: equal to
    transformers' full forward; scoring-only and generating requests mixed, chunked prefill at a small budget."""
    model = tiny_model("llama", seed=4).cuda()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 40, 77, 130, 33, 64)]
    starts = [1, 20, 70, 2, 32, 63]
    new_tokens = (0, 12, 0, 12, 0, 12)
    refs = []
    with torch.no_grad():
        for p in prompts:
            lp = model(input_ids=torch.tensor([p], device="cuda")).logits[0, :-1].float().log_softmax(-1)
            t = torch.tensor(p[1:], device="cuda")
            refs.append((lp.gather(1, t[:, None])[:, 0].cpu(), (lp.argmax(-1) == t).cpu()))
    gen_refs = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=12, do_sample=False)[0, len(p):]
                .tolist() for p in prompts]
    hf_paged.enable(model)
    engine = hf_paged.Engine(model, num_blocks=80, block_size=16, max_num_batched_tokens=budget,
                             enable_prefix_caching=caching)
    params = [hf_paged.SamplingParams(max_new_tokens=m, prompt_logprobs_start=s) for s, m in zip(starts, new_tokens)]
    outs = engine.generate(prompts + prompts[:3], params + [hf_paged.SamplingParams(max_new_tokens=12)] * 3)
    for s, (values, greedy), out in zip(starts, refs, outs):
        got = torch.tensor([x for x, _ in out.prompt_logprobs])
        assert (got - values[s - 1:]).abs().max().item() < 1e-4
        assert [y for _, y in out.prompt_logprobs] == greedy[s - 1:].tolist()
    for out, ref, m in zip(outs, gen_refs, new_tokens):
        assert out.outputs[0].token_ids == (ref if m else [])
    for out, ref in zip(outs[len(prompts):], gen_refs):
        assert out.outputs[0].token_ids == ref
    assert engine.kv_stats().used_blocks == 0


@pytest.mark.parametrize("family", ["gemma3n_text", "mixtral"])
def test_model_that_cannot_be_captured_decodes_without_graphs(family):
    """Gemma3n's decoder copies a CPU tensor in its forward, and float32 mixture-of-experts layers on transformers'
    `grouped_mm` experts copy their expert offsets through the host: both run eagerly but fail a CUDA graph capture.
    The engine must warn, decode on the static path without graphs (pipelined), and give the tokens of an engine
    without graphs; it used to fail every request with the capture's error. (Compiled, Gemma3n's step can be
    recorded: Inductor keeps no host copy. hf_paged's own experts, the default, sync nothing: see
    `test_moe_model_on_hf_paged_experts_is_captured`.)"""
    import warnings

    from hf_paged import model_zoo

    model = model_zoo.tiny_model(family, seed=0).cuda().eval()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (int(n),), generator=gen).tolist() for n in torch.randint(3, 40, (6,), generator=gen)]
    results = []
    for graphs, compiled in ((False, False), (True, False), (True, True)):
        engine = hf_paged.Engine(model, num_blocks=64, block_size=16, max_num_seqs=8, use_cuda_graph=graphs,
                                 compile_decode=compiled, experts_implementation="grouped_mm")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.warm_up()
        fell_back = any("cannot be recorded in a CUDA graph" in str(w.message) for w in caught)
        if graphs and not compiled:
            assert fell_back
        assert fell_back == (engine.runner.graph_failure is not None)
        assert engine.runner.decode_mode == ("graph" if graphs and not fell_back else "static" if graphs or compiled
                                             else "eager")
        outs = engine.generate(prompts, max_new_tokens=10, ignore_eos=True)
        assert all(o.error is None and o.finished for o in outs)
        results.append([o.outputs[0].token_ids for o in outs])
        if graphs:
            assert engine.pipelined_steps > 0 and engine.runner.graph_steps > 0
        engine.close()
    assert all(r == results[0] for r in results[1:])


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_moe_model_on_hf_paged_experts_is_captured(family):
    """With hf_paged's experts (the default) a float32 MoE model records its decode steps in CUDA graphs, eager and
    compiled, and decodes the greedy tokens of transformers' `eager` experts."""
    from hf_paged import model_zoo

    model = model_zoo.tiny_model(family, seed=0).cuda().eval()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (int(n),), generator=gen).tolist() for n in torch.randint(3, 40, (6,), generator=gen)]
    results = []
    for experts, compiled in (("eager", False), ("hf_paged", False), ("hf_paged", True)):
        engine = hf_paged.Engine(model, num_blocks=64, block_size=16, max_num_seqs=8, use_cuda_graph=True,
                                 compile_decode=compiled, experts_implementation=experts)
        engine.warm_up()
        if experts == "hf_paged":
            assert engine.runner.graph_failure is None and model.get_experts_implementation()[""] == "hf_paged"
        outs = engine.generate(prompts, max_new_tokens=10, ignore_eos=True)
        assert all(o.error is None and o.finished for o in outs)
        results.append([o.outputs[0].token_ids for o in outs])
        if experts == "hf_paged":
            assert engine.runner.graph_steps > 0
        engine.close()
        hf_paged.disable(model)
    assert all(r == results[0] for r in results[1:])


def test_default_engine_compiles_the_decode_step_on_cuda():
    """`compile_decode=None` (the default) compiles on CUDA, and so does the engine behind `generate()`; its greedy
    tokens equal those of `compile_decode=False` (float32)."""
    model = tiny_model("qwen3", dtype=torch.float32).cuda()
    hf_paged.enable(model)
    prompts = _prompts(8, seed=4)
    engine = hf_paged.Engine(model, num_blocks=128, block_size=16, max_num_seqs=16)
    assert engine.runner.compile_decode and engine.runner.compile_auto
    compiled = [o.outputs[0].token_ids for o in engine.generate(prompts, max_new_tokens=16)]
    assert engine.runner.compile_failure is None and engine.runner.graph_steps > 0
    engine.close()
    eager = hf_paged.Engine(model, num_blocks=128, block_size=16, max_num_seqs=16, compile_decode=False)
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, max_new_tokens=16)] == compiled
    eager.close()
    ids = torch.tensor([prompts[0]], device="cuda")
    out = model.generate(ids, max_new_tokens=16, do_sample=False, cache_implementation="paged")
    assert out[0, ids.shape[1]:].tolist() == compiled[0]
    assert model._hf_paged_engine.runner.compile_decode


@pytest.mark.parametrize("family", ["qwen3_5_text", "granitemoehybrid", "falcon_h1"])
@pytest.mark.parametrize("compile_decode", [False, True])
def test_hybrid_models_on_cuda(family, compile_decode):
    """Hybrid models on the GPU (with flash-linear-attention's kernels where transformers finds them): the engine's
    eager or compiled step, recorded in CUDA graphs, with chunked prefill, preemption and a prefix hit, gives
    transformers' greedy tokens (float32); every block and state slot comes back."""
    from transformers import GenerationConfig

    from hf_paged.model_zoo import tiny_model as zoo_model

    model = zoo_model(family).cuda()
    model.generation_config = GenerationConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    prompts = [[t % 200 for t in p] for p in _prompts(12, seed=5)]  # (the zoo's vocabulary)
    prompts += [prompts[0][:20] + [t % 200 for t in p] for p in _prompts(3, seed=6)]  # prompts sharing a prefix
    refs = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, do_sample=False,
                           eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    engine = hf_paged.Engine(model, num_blocks=48, block_size=16, max_num_batched_tokens=64,
                             compile_decode=compile_decode)
    assert engine.runner.use_cuda_graph
    outs = engine.generate(prompts, max_new_tokens=16, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert engine.runner.graph_steps > 0 and engine.runner.graph_failure is None
    stats = engine.kv_stats()
    assert stats.used_blocks == 0 and stats.state_slots_used == 0


GEMMA3_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                "sliding_attention", "full_attention", "sliding_attention"]


@pytest.mark.parametrize("family,overrides", [
    ("gemma3_text", dict(sliding_window=8, num_hidden_layers=7, layer_types=GEMMA3_TYPES)),  # block groups
    ("gpt_oss", dict(sliding_window=8)),  # block groups, sinks, the hf_paged experts
    ("deepseek_v2", {}),  # the latent in the pool
    ("glm4_moe_lite", {}),
    ("mamba", {}),  # a pure recurrent model
])
@pytest.mark.parametrize("compile_decode", [False, True])
def test_grouped_latent_and_recurrent_families_on_cuda(family, overrides, compile_decode):
    """Families whose pool differs from one table of K/V, on the GPU: block groups (local layers release what fell out
    of their window), multi-head latent attention (one latent head absorbed into the query) and Mamba's states in
    slots. The eager or compiled step, recorded in CUDA graphs, with chunked prefill, preemption and prefix hits,
    gives transformers' greedy tokens (float32), and every block and slot comes back."""
    from transformers import GenerationConfig

    from hf_paged.model_zoo import tiny_model as zoo_model

    model = zoo_model(family, **overrides).cuda()
    model.generation_config = GenerationConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    prompts = [[t % 200 for t in p] for p in _prompts(12, seed=7)]
    prompts += [prompts[0][:20] + [t % 200 for t in p] for p in _prompts(3, seed=8)]  # prompts sharing a prefix
    # the mask given: a prompt may hold token 0, which generate() would otherwise take for padding (pad_token_id 0)
    refs = [model.generate(torch.tensor([p], device="cuda"), attention_mask=torch.ones(1, len(p), device="cuda"),
                           max_new_tokens=24, do_sample=False, eos_token_id=None)[0, len(p):].tolist()
            for p in prompts]
    engine = hf_paged.Engine(model, num_blocks=32, block_size=16, max_num_batched_tokens=64,
                             compile_decode=compile_decode)
    assert engine.runner.use_cuda_graph
    assert engine.runner.grouped == (family in ("gemma3_text", "gpt_oss"))
    outs = engine.generate(prompts, max_new_tokens=24, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert engine.runner.graph_steps > 0 and engine.runner.graph_failure is None
    # a pool too small for every sequence at once preempts (Mamba holds no blocks; a grouped pool's local layers give
    # theirs back as they slide, and on an H200 the same pool held every sequence of the grouped families)
    assert family in ("mamba", "gemma3_text", "gpt_oss") or sum(engine.scheduler.num_preemptions.values()) > 0
    stats = engine.kv_stats()
    assert stats.used_blocks == 0 and stats.state_slots_used == 0
    engine.close()


@pytest.mark.parametrize("family", ["deepseek_v32", "qwen4_exp_text", "minimax", "recurrent_gemma", "zamba", "moshi",
                                    "mllama"])
def test_sparse_recurrent_and_adapted_families_on_cuda(family):
    """The families of learned sparse attention (DeepSeek Sparse Attention, Qwen4-Exp's block selection), slotted
    recurrent states (MiniMax, RecurrentGemma), a shared attention block (Zamba), a cache-applied window (Moshi) and
    text-only cross-attention (Mllama) on the GPU: the engine as it configures itself there (CUDA graphs and the
    compiled step where the family allows them), with chunked prefill, preemption and prefix hits, gives
    transformers' greedy tokens (float32), and every block and slot comes back."""
    from transformers import GenerationConfig

    from hf_paged.model_zoo import tiny_model as zoo_model

    model = zoo_model(family).cuda()
    model.generation_config = GenerationConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    prompts = [[t % 200 for t in p] for p in _prompts(10, seed=9)]
    prompts += [prompts[0][:20] + [t % 200 for t in p] for p in _prompts(3, seed=10)]  # prompts sharing a prefix
    refs = [model.generate(torch.tensor([p], device="cuda"), attention_mask=torch.ones(1, len(p), device="cuda"),
                           max_new_tokens=16, do_sample=False, eos_token_id=None)[0, len(p):].tolist()
            for p in prompts]
    engine = hf_paged.Engine(model, num_blocks=32, block_size=16, max_num_batched_tokens=64)
    outs = engine.generate(prompts, max_new_tokens=16, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in outs] == refs
    stats = engine.kv_stats()
    assert stats.used_blocks == 0 and stats.state_slots_used == 0
    engine.close()
