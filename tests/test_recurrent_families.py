"""Recurrent families whose state lives outside transformers' usual cache calls (`hf_paged.attention.recurrent_families`).

MiniMax (lightning attention: a K^T V state kept by `get_linear_cache` / `set_linear_cache`, beside ordinary attention
layers). Tiny seeded models, float32 on the CPU, every check against transformers' own generate:

* the gate accepts them and the run-time probe sees nothing unhandled;
* the engine's greedy tokens on the eager, static-decode and chunked-prefill paths (a chunk resumes from its slot);
* ``generate(cache_implementation="paged")`` and the drop-in ``PagedCache`` on a left-padded batch;
* parallel samples scored as transformers scores them (each fork with its own copy of the state);
* recompute and swap preemption: the same tokens, every block and slot back;
* prefix hits resumed from state checkpoints;
* beam search on the engine and the drop-in cache, and the compiled decode step (slow).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.utils import counters

import hf_paged
from hf_paged.attention.recurrent import mixer_modules
from hf_paged.attention.support import model_features, refusal
from hf_paged.capabilities import inspect_model

try:
    from tests.helpers import (
        assert_all_returned,
        dense_generate,
        engine_greedy,
        generating_model,
        greedy_references,
        left_padded_batch,
        paged,
        random_prompts,
    )
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import (
        assert_all_returned,
        dense_generate,
        engine_greedy,
        generating_model,
        greedy_references,
        left_padded_batch,
        paged,
        random_prompts,
    )

FAMILIES = ("minimax", "recurrent_gemma")
LENGTHS = (1, 23, 7, 40, 3, 16)


@functools.cache
def family_model(family: str):
    return generating_model(family)


@functools.cache
def references(family: str, new: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    return greedy_references(family_model(family), LENGTHS, seed=7, new=new)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_gate_accepts_them(family):
    model = family_model(family)
    features = model_features(model)
    assert "recurrent_state" in features and refusal(model, features) is None, features
    assert inspect_model(model).unhandled == {}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("path", ["eager", "static", "chunked"])
def test_engine_greedy_matches_transformers(family, path):
    model = family_model(family)
    prompts, refs = references(family)
    kwargs = dict(num_blocks=96, block_size=4)
    if path == "chunked":  # prompts cut into chunks of at most 6 tokens: states carried between chunks
        kwargs.update(max_num_batched_tokens=6, max_num_seqs=3)
    engine = hf_paged.Engine(model, **kwargs)
    if path != "eager":
        engine.runner.decode_mode = "static"  # the GPU's decode path (buffers, padded buckets), run eagerly
    assert engine_greedy(engine, prompts) == refs
    assert engine.kv_stats().state_slots == engine.scheduler.max_num_seqs
    # only the attention layers hold blocks (RecurrentGemma says which in `layers_block_type`)
    assert engine.cache.kv_layers == [i for i, m in enumerate(model.model.layers) if not mixer_modules(m)]
    assert_all_returned(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_generate_and_the_drop_in_cache_match_transformers_on_a_padded_batch(family):
    model = family_model(family)
    input_ids, mask = left_padded_batch((5, 11, 2, 8))
    kwargs = dict(input_ids=input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    ref = dense_generate(model, **kwargs)
    with paged(model, num_blocks=96, block_size=4):
        out = model.generate(**kwargs, cache_implementation="paged")
        cache = hf_paged.PagedCache(config=model.config, num_blocks=96, block_size=4)
        dropin = model.generate(**kwargs, past_key_values=cache)
        assert cache.has_states
    assert torch.equal(out, ref)
    assert torch.equal(dropin, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_parallel_samples_score_as_transformers_scores_them(family):
    model = family_model(family)
    prompts = random_prompts((9, 14), seed=2, vocab=200)
    engine = hf_paged.Engine(model, num_blocks=96, block_size=4)
    params = hf_paged.SamplingParams(max_new_tokens=6, do_sample=True, num_return_sequences=3, seed=11, logprobs=1,
                                     ignore_eos=True, temperature=2.0)
    outputs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # forks that went their own ways
        for completion in out.outputs:
            ids = torch.tensor([prompt + completion.token_ids])
            with torch.no_grad():
                logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
            expected = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
            got = torch.tensor([lp for lp, _ in completion.logprobs])
            torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    assert_all_returned(engine)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_tokens_and_gives_every_slot_back(family, mode):
    model = family_model(family)
    prompts = random_prompts((9, 14, 6, 11), seed=4, vocab=200)
    expected = [dense_generate(model, input_ids=torch.tensor([p]), max_new_tokens=10, do_sample=False,
                               eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    # (RecurrentGemma's one attention layer slides over 4 tokens: with its out-of-window blocks released, 14 blocks
    # never run out; kept, they do)
    engine = hf_paged.Engine(model, num_blocks=14, block_size=4, preemption_mode=mode,
                             swap_space=0.01 if mode == "swap" else 0.0, release_window_blocks=False)
    assert engine_greedy(engine, prompts, new=10) == expected
    assert engine.scheduler.num_preemptions[mode] > 0
    assert_all_returned(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_hits_resume_from_state_checkpoints_with_transformers_tokens(family):
    model = family_model(family)
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, 200, (22,), generator=g).tolist()
    prompts = [system + torch.randint(3, 200, (int(n),), generator=g).tolist()
               for n in torch.randint(2, 9, (5,), generator=g)]
    expected = [dense_generate(model, input_ids=torch.tensor([p]), max_new_tokens=6, do_sample=False,
                               eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    engine = hf_paged.Engine(model, num_blocks=96, block_size=4)
    got = engine_greedy(engine, prompts[:1], new=6) + engine_greedy(engine, prompts[1:], new=6)
    assert got == expected
    assert engine.prefix_cache_stats().hit_tokens >= 3 * 20
    assert engine.block_manager.state.checkpoint_hits >= 3
    assert_all_returned(engine)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_matches_transformers_on_the_engine_and_the_drop_in_cache(family):
    """Beams fork and drop their states every step, on the engine and in the drop-in cache's rows. The reference is
    transformers' beam search without a cache: with its cache, transformers itself keeps these two families' recurrent
    states in place when beams are reordered (`MiniMaxCache.reorder_cache` moves only the attention layers; the
    RecurrentGemma block's states are module attributes no cache reorders), so its cached beams differ from its
    uncached ones. Prompts of one length: RecurrentGemma's convolution reads left padding (transformers' padded batch
    is not what its prompts alone give, which is what the engine computes)."""
    model = family_model(family)
    input_ids, mask = left_padded_batch((7, 7, 7))
    kwargs = dict(input_ids=input_ids, attention_mask=mask, num_beams=3, num_return_sequences=2, max_new_tokens=8,
                  return_dict_in_generate=True, output_scores=True, eos_token_id=None)
    ref = dense_generate(model, use_cache=False, **kwargs)
    with paged(model, num_blocks=256, block_size=4):
        out = model.generate(**kwargs, cache_implementation="paged")
        dropin = model.generate(**kwargs, past_key_values=hf_paged.PagedCache(config=model.config, num_blocks=256,
                                                                             block_size=4))
    for got in (out, dropin):
        assert torch.equal(got.sequences, ref.sequences)
        torch.testing.assert_close(got.sequences_scores, ref.sequences_scores, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_decode_step_matches_transformers_without_graph_breaks(family):
    """The compiled decode step gathers and commits the states through the opaque ops; RecurrentGemma's binding
    sets its block's attributes inside the traced region."""
    torch._dynamo.reset()
    counters.clear()
    model = family_model(family)
    prompts, refs = references(family)
    engine = hf_paged.Engine(model, num_blocks=96, block_size=4, max_num_seqs=8, compile_decode=True)
    assert engine_greedy(engine, prompts) == refs
    assert engine.runner.graph_steps > 0 and engine.runner.compile_failure is None
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert_all_returned(engine)
    engine.close()
    torch._dynamo.reset()
