"""Pure recurrent models (issue 53): Mamba and FalconMamba, whose every layer is a Mamba 1 mixer and none keeps K/V.

Their cache is a pool of zero K/V layers (blocks only count tokens, for scheduling and prefix-cache keys, and cost
no memory) and a state slot per sequence for every layer; the model takes the cache as ``cache_params``. Tiny
seeded models, float32 on the CPU, every check against transformers' own greedy / beam generate:

* the engine's greedy tokens on the eager, static-decode, chunked-prefill and compiled paths, and after prefix-cache
  hits resumed from state checkpoints (Mamba 1 chunks that resume from a state run one token at a time: Jamba too);
* parallel samples scored as transformers scores them;
* ``generate(cache_implementation="paged")`` and the drop-in ``PagedCache`` (as ``cache_params``) on a left-padded
  batch, and beam search on both;
* the gate accepts them (no attention module, no positions) and still refuses decoders that count positions from the
  cache (BART, Whisper).
"""

from __future__ import annotations

import functools

import pytest
import torch

import hf_paged
from hf_paged.attention.support import check_supported, model_features
from hf_paged.capabilities import inspect_model
from hf_paged.model_zoo import tiny_model

try:
    from tests.helpers import (
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
        dense_generate,
        engine_greedy,
        generating_model,
        greedy_references,
        left_padded_batch,
        paged,
        random_prompts,
    )

FAMILIES = ("mamba", "falcon_mamba")
LENGTHS = (1, 23, 7, 40, 3, 16)


@functools.cache
def recurrent(family: str):
    return generating_model(family)


@functools.cache
def references(family: str, new: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    return greedy_references(recurrent(family), LENGTHS, seed=7, new=new)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_gate_accepts_pure_recurrent_models(family):
    model = recurrent(family)
    assert set(model_features(model)) == {"recurrent_state"}
    assert set(inspect_model(model).unhandled) == set()


@pytest.mark.parametrize("family", ["bart", "whisper"])
def test_decoders_counting_positions_from_the_cache_stay_refused(family):
    model = tiny_model(family)
    assert "no_position_ids" in model_features(model)
    with pytest.raises(ValueError, match="no_position_ids"):
        check_supported(model)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("path", ["eager", "static", "chunked"])
def test_engine_greedy_matches_transformers(family, path):
    model = recurrent(family)
    prompts, refs = references(family)
    kwargs = dict(block_size=4)
    if path == "chunked":  # prompts cut into chunks of at most 6 tokens: states carried between chunks
        kwargs.update(max_num_batched_tokens=6, max_num_seqs=3)
    engine = hf_paged.Engine(model, **kwargs)
    cache = engine.cache
    assert cache.kv_layers == [] and cache.bytes_per_block() == 0 and cache.pool is None
    if path != "eager":
        engine.runner.decode_mode = "static"  # the GPU's decode path (buffers, padded buckets), run eagerly
    assert engine_greedy(engine, prompts, 8) == refs
    if path != "eager":
        assert engine.runner.graph_steps > 0
    stats = engine.kv_stats()
    assert stats.state_slots == engine.scheduler.max_num_seqs
    assert not engine.has_unfinished() and stats.used_blocks == 0 and stats.state_slots_used == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_generate_and_the_drop_in_cache_match_transformers_on_a_padded_batch(family):
    model = recurrent(family)
    input_ids, mask = left_padded_batch((5, 11, 2, 8))
    kwargs = dict(input_ids=input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    ref = dense_generate(model, **kwargs)
    with paged(model, block_size=4):
        out = model.generate(**kwargs, cache_implementation="paged")
        cache = hf_paged.PagedCache(config=model.config, block_size=4)
        dropin = model.generate(**kwargs, cache_params=cache)
        assert cache.has_states and cache.kv_layers == []
    assert torch.equal(out, ref)
    assert torch.equal(dropin, ref)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_matches_transformers(family):
    model = recurrent(family)
    input_ids, mask = left_padded_batch((5, 11, 2, 8))
    kwargs = dict(input_ids=input_ids, attention_mask=mask, num_beams=3, num_return_sequences=2, max_new_tokens=8,
                  return_dict_in_generate=True, output_scores=True, eos_token_id=None)
    ref = dense_generate(model, **kwargs)
    with paged(model, block_size=4):
        out = model.generate(**kwargs, cache_implementation="paged")
        dropin = model.generate(**kwargs, cache_params=hf_paged.PagedCache(config=model.config, block_size=4))
    for got in (out, dropin):
        assert torch.equal(got.sequences, ref.sequences)
        torch.testing.assert_close(got.sequences_scores, ref.sequences_scores, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_parallel_samples_score_as_transformers_scores_them(family):
    model = recurrent(family)
    prompts = random_prompts((9, 14), seed=2, vocab=200)
    engine = hf_paged.Engine(model, block_size=4)
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
    assert engine.kv_stats().state_slots_used == 0 and engine.kv_stats().used_blocks == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_hits_resume_from_state_checkpoints_with_transformers_tokens(family):
    """A shared system prompt: later prompts resume from a state checkpoint and run their rest (several tokens) from
    it, which a Mamba 1 mixer's own multi-token form cannot (`recurrent_profile._resumes_chunks`)."""
    model = recurrent(family)
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, 200, (22,), generator=g).tolist()
    prompts = [system + torch.randint(3, 200, (int(n),), generator=g).tolist()
               for n in torch.randint(2, 9, (6,), generator=g)]
    expected = [dense_generate(model, input_ids=torch.tensor([p]), max_new_tokens=6, do_sample=False,
                               eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    engine = hf_paged.Engine(model, block_size=4)
    params = hf_paged.SamplingParams(max_new_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for batch in (prompts[:1], prompts[1:]) for o in engine.generate(batch, params)]
    assert got == expected
    # (the burst's first prompt computes the state at the end of the shared blocks; the other 4 resume from it)
    assert engine.prefix_cache_stats().hit_tokens >= 4 * 20
    assert engine.block_manager.state.checkpoint_hits >= 4


def test_jamba_chunked_prefill_keeps_its_mamba_state():
    """Jamba's Mamba 1 layers beside attention: prompts cut into chunks resume each chunk from the state."""
    model = tiny_model("jamba")
    prompts = random_prompts((23, 9, 17), seed=4, vocab=200)
    expected = [dense_generate(model, input_ids=torch.tensor([p]), max_new_tokens=6, do_sample=False,
                               eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    engine = hf_paged.Engine(model, num_blocks=96, block_size=4, max_num_batched_tokens=6, max_num_seqs=2)
    assert engine_greedy(engine, prompts, 6) == expected


@pytest.mark.slow
def test_compiled_decode_step_matches_transformers():
    model = recurrent("mamba")
    prompts, refs = references("mamba")
    engine = hf_paged.Engine(model, block_size=4, max_num_seqs=8, compile_decode=True)
    assert engine_greedy(engine, prompts, 8) == refs
    assert engine.runner.graph_steps > 0 and engine.runner.compile_failure is None
    engine.close()
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_tokens_and_gives_every_slot_back(mode):
    """A pool of 14 bookkeeping blocks (``num_blocks`` given: they cost nothing, but still bound the tokens in flight)
    preempts; the states go with the blocks (swap) or are recomputed."""
    model = recurrent("falcon_mamba")
    prompts = random_prompts((9, 14, 6, 11), seed=4, vocab=200)
    expected = [dense_generate(model, input_ids=torch.tensor([p]), max_new_tokens=10, do_sample=False,
                               eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    engine = hf_paged.Engine(model, block_size=4, num_blocks=14, preemption_mode=mode, swap_space=0.01)
    assert engine_greedy(engine, prompts, 10) == expected
    assert engine.stats["peak_used_blocks"] == 14
    stats = engine.kv_stats()
    assert stats.used_blocks == stats.cpu_used_blocks == stats.state_slots_used == stats.state_cpu_slots_used == 0
