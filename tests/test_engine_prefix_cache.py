"""Prefix caching in `hf_paged.Engine` (on by default): same tokens as without it and as transformers' DynamicCache.

Prompts share a "system prompt" and differ in short suffixes; one repeats an earlier prompt exactly and one is a
whole number of blocks long and fully cached (its last block is recomputed, the cached copy is never written). Every
run must give every block back (`used_blocks == 0`: cached blocks stay in the evictable pool, counted as free).
"""

from __future__ import annotations

import functools

import pytest
import torch

import hf_paged
from hf_paged.testing import tiny_model

try:
    from tests.helpers import greedy_reference, random_prompts
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import greedy_reference, random_prompts

BLOCK = 8
MAX_NEW = 8


@functools.cache
def model_for(family: str):
    """This module's own tiny models (engines enable them; the session-wide plain ones stay plain)."""
    return tiny_model(family, seed=2)


def shared_prompts(seed: int = 11) -> list[list[int]]:
    system = random_prompts([29], seed=seed)[0]
    suffixes = random_prompts([1, 6, 13, 3], seed=seed + 1)
    prompts = [system + s for s in suffixes]
    prompts.append(list(prompts[1]))  # an exact repeat
    prompts.append(system[:24])  # 3 whole blocks, all cached once the first request is done
    return prompts


def run(engine, prompts, **params) -> list[list[int]]:
    """The first prompt alone (it fills the cache), then the others in one batch; the tokens of every output."""
    params.setdefault("max_new_tokens", MAX_NEW)
    first = engine.generate(prompts[:1], **params)
    rest = engine.generate(prompts[1:], **params)
    return [[o.token_ids for o in r.outputs] for r in first + rest]


def assert_no_leaks(engine) -> None:
    stats = engine.kv_stats()
    assert stats.used_blocks == 0 and stats.free_blocks == stats.num_blocks, stats
    assert stats.cpu_used_blocks == 0
    assert engine.block_manager.seq_ids() == [] and not engine.has_unfinished()


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt", "qwen3", "phi3"])
def test_greedy_with_and_without_caching_equals_dynamic_cache(family):
    model = model_for(family)
    prompts = shared_prompts()
    references = [[greedy_reference(model, p, MAX_NEW)] for p in prompts]
    on = hf_paged.Engine(model, block_size=BLOCK, num_blocks=96)
    off = hf_paged.Engine(model, block_size=BLOCK, num_blocks=96, enable_prefix_caching=False)
    assert run(on, prompts) == references
    assert run(off, prompts) == references
    # the system prompt's 3 whole blocks for 3 requests, 4 blocks for the repeat (it waits one step for the 4th
    # block, which its twin computes), 2 of the 3 blocks of the fully cached prompt (its last block is recomputed)
    stats = on.prefix_cache_stats()
    assert stats.hit_tokens == 3 * 24 + 32 + 16 and stats.query_tokens == sum(map(len, prompts))
    assert on.stats["prefix_hit_tokens"] == stats.hit_tokens and 0 < on.stats["prefix_hit_rate"] == stats.hit_rate
    assert on.stats["prefill_tokens"] < off.stats["prefill_tokens"]
    assert off.prefix_cache_stats().hit_tokens == 0 and off.kv_stats().cached_blocks == 0
    assert on.kv_stats().cached_blocks > 0
    assert_no_leaks(on)
    assert_no_leaks(off)


def test_fully_cached_prompt_never_writes_the_cached_blocks():
    model = model_for("llama")
    prompt = random_prompts([2 * BLOCK], seed=4)[0]
    engine = hf_paged.Engine(model, block_size=BLOCK, num_blocks=16)
    first = engine.generate([prompt], max_new_tokens=MAX_NEW)[0].outputs[0].token_ids
    bm = engine.block_manager
    cached = [b for b in range(bm.num_blocks) if bm.gpu.is_cached(b)]
    assert len(cached) == 2  # the prompt's blocks (the generated ones never fill a block: the last is not computed)
    before = engine.cache.pool[:, :, cached].clone()
    again = engine.generate([prompt], max_new_tokens=MAX_NEW)[0].outputs[0].token_ids
    assert again == first == greedy_reference(model, prompt, MAX_NEW)
    assert engine.prefix_cache_stats().hit_tokens == BLOCK  # the last prompt block is recomputed elsewhere
    assert torch.equal(engine.cache.pool[:, :, cached], before)
    assert_no_leaks(engine)


@pytest.mark.parametrize(
    "pool",
    [dict(num_blocks=10), dict(num_blocks=10, preemption_mode="swap", swap_space=0.01), dict(num_blocks=64)],
    ids=["tiny_recompute", "tiny_swap", "roomy"],
)
def test_chunked_prefill_and_preemption_stay_exact(pool):
    model = model_for("llama")
    prompts = shared_prompts(seed=21)
    references = [[greedy_reference(model, p, MAX_NEW)] for p in prompts]
    engine = hf_paged.Engine(model, block_size=BLOCK, max_num_batched_tokens=16, **pool)
    assert run(engine, prompts) == references
    assert engine.prefix_cache_stats().hit_tokens > 0
    if pool["num_blocks"] == 10:
        mode = pool.get("preemption_mode", "recompute")
        assert engine.scheduler.num_preemptions[mode] > 0, engine.scheduler.num_preemptions
    assert_no_leaks(engine)


def test_parallel_sampling_and_beam_search_match_caching_off():
    model = model_for("llama")
    prompts = shared_prompts(seed=31)[:4]
    sample = dict(max_new_tokens=6, do_sample=True, num_return_sequences=3, seed=5, ignore_eos=True)
    beams = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2)
    results = {}
    for caching in (True, False):
        engine = hf_paged.Engine(model, block_size=BLOCK, num_blocks=48, enable_prefix_caching=caching)
        results[caching] = (run(engine, prompts, **sample), run(engine, prompts, **beams))
        assert engine.prefix_cache_stats().hit_tokens > 0 or not caching
        assert_no_leaks(engine)
    assert results[True] == results[False]


def test_drop_in_cache_does_not_cache_prefixes():
    model = model_for("llama")
    cache = hf_paged.PagedCache(config=model.config, num_blocks=8, block_size=4, device="cpu", dtype=torch.float32)
    assert cache.block_manager.enable_prefix_caching is False
    with pytest.raises(ValueError, match="bool"):
        hf_paged.Engine(model, num_blocks=8, enable_prefix_caching="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_prefix_caching_on_cuda_matches_dynamic_cache(family):
    """Triton kernels (prefill over cached blocks) and CUDA-graph decode, with a roomy and a preempting pool."""
    model = tiny_model(family, seed=3).cuda()
    prompts = shared_prompts(seed=41) + [p[:17] + [5, 6, 7] for p in shared_prompts(seed=41)[:3]]
    refs = [
        model.generate(torch.tensor([p], device="cuda"), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    for pool in (dict(num_blocks=128), dict(num_blocks=12, max_num_batched_tokens=24)):
        engine = hf_paged.Engine(model, block_size=BLOCK, **pool)
        assert run(engine, prompts, max_new_tokens=12) == [[r] for r in refs]
        assert engine.prefix_cache_stats().hit_tokens > 0 and engine.runner.graph_steps > 0
        assert_no_leaks(engine)
