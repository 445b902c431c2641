"""CUDA-only end-to-end checks (skipped without a GPU): the Triton path gives transformers' tokens."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.testing import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


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
    for graphs in (False, True):
        engine = hf_paged.Engine(model, num_blocks=128, block_size=16, max_num_seqs=32, use_cuda_graph=graphs)
        outs = engine.generate(prompts, max_new_tokens=32)
        results.append([o.outputs[0].token_ids for o in outs])
        if graphs:
            assert engine.runner.graph_steps > 0
        assert engine.kv_stats().used_blocks == 0
    assert results[0] == results[1]
