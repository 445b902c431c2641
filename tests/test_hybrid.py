"""Hybrid models on the engine and the drop-in cache (issue 53): recurrent states in slots beside the KV blocks.

Qwen3.5 (gated DeltaNet, 3 : 1 with full attention), Granite 4 hybrid (Mamba 2, MoE) and Falcon-H1 (Mamba 2 and
attention in the same layer), tiny and seeded, float32 on the CPU. Every check is against transformers itself:

* greedy tokens on every engine path (eager, static decode buffers, chunked prefill, the compiled step), prompts of
  1 to 40 tokens, requests joining while others run;
* parallel samples: every returned sample's log-probabilities equal those of transformers' forward over that very
  sequence (a sample forked with a wrong state, or sharing its parent's, gives other numbers);
* beam search, on the engine and the drop-in cache (beams fork and drop states every step);
* recompute and swap preemption, aborts, and prefix hits, each giving the same tokens as a run without them, with
  every block and slot back at the end.
"""

from __future__ import annotations

import functools

import pytest
import torch

import hf_paged
from hf_paged.runner.regional import CompiledLayers

try:
    from tests.helpers import (
        assert_all_returned,
        dense_generate,
        engine_greedy,
        generating_model,
        greedy_references,
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
        paged,
        random_prompts,
    )

# the file on one worker: the cached models and transformers' references (`hybrid`, `references`) are built once
pytestmark = pytest.mark.xdist_group("hybrid")

FAMILIES = ("qwen3_5_text", "granitemoehybrid", "falcon_h1")
LENGTHS = (1, 23, 7, 40, 3, 16, 11)


@functools.cache
def hybrid(family: str):
    return generating_model(family)


@functools.cache
def references(family: str, new: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    return greedy_references(hybrid(family), LENGTHS, seed=5, new=new)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("path", ["eager", "static", "chunked"])
def test_engine_greedy_matches_transformers(family, path):
    model = hybrid(family)
    prompts, refs = references(family)
    kwargs = dict(num_blocks=96, block_size=4)
    if path == "chunked":  # prompts cut into chunks of at most 6 tokens: states carried between chunks
        kwargs.update(max_num_batched_tokens=6, max_num_seqs=3)
    engine = hf_paged.Engine(model, **kwargs)
    if path != "eager":
        engine.runner.decode_mode = "static"  # the GPU's decode path (buffers, padded buckets), run eagerly
    assert engine_greedy(engine, prompts) == refs
    if path != "eager":
        assert engine.runner.graph_steps > 0
    stats = engine.kv_stats()
    assert stats.state_slots == engine.scheduler.max_num_seqs
    assert_all_returned(engine)
    # only the attention layers hold blocks
    assert engine.cache.pool.shape[0] == len(engine.cache.kv_layers) < engine.cache.num_layers or family == "falcon_h1"


def test_requests_joining_a_running_batch_keep_their_states_apart():
    model = hybrid("qwen3_5_text")
    prompts, refs = references("qwen3_5_text")
    engine = hf_paged.Engine(model, num_blocks=96, block_size=4, max_num_batched_tokens=24)
    engine.runner.decode_mode = "static"
    ids = [engine.add_request(p, max_new_tokens=8, ignore_eos=True) for p in prompts[:3]]
    done = {}
    pending = list(enumerate(prompts[3:], start=3))
    while engine.has_unfinished() or pending:
        if pending and engine.stats["steps"] % 2 == 1:  # one new request every other step, mid-decode
            i, p = pending.pop(0)
            ids.append(engine.add_request(p, max_new_tokens=8, ignore_eos=True))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[i] for i in ids] == refs
    assert_all_returned(engine)


@pytest.mark.slow
def test_compiled_decode_step_matches_transformers_without_graph_breaks():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = hybrid("qwen3_5_text")
    prompts, refs = references("qwen3_5_text")
    engine = hf_paged.Engine(model, num_blocks=96, block_size=4, max_num_seqs=8, compile_decode=True)
    assert engine_greedy(engine, prompts) == refs
    assert engine.runner.graph_steps > 0 and engine.runner.compile_failure is None
    assert not counters["graph_break"], dict(counters["graph_break"])
    compiled = engine.runner._compiled
    assert isinstance(compiled, CompiledLayers)  # one compilation per kind of layer
    assert counters["stats"]["unique_graphs"] <= compiled.max_graphs
    assert engine.runner.compiled_prefill_steps == 0  # a hybrid's ragged steps run the model's own code
    assert_all_returned(engine)
    engine.close()
    torch._dynamo.reset()


@pytest.mark.parametrize("family", FAMILIES)
def test_parallel_samples_score_as_transformers_scores_them(family):
    model = hybrid(family)
    prompts = random_prompts((9, 14), seed=2, vocab=200)
    engine = hf_paged.Engine(model, num_blocks=96, block_size=4)
    params = hf_paged.SamplingParams(max_new_tokens=6, do_sample=True, num_return_sequences=3, seed=11, logprobs=1,
                                     ignore_eos=True)
    outputs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        samples = [c.token_ids for c in out.outputs]
        assert len(samples) == 3 and len({tuple(s) for s in samples}) > 1  # forks that went their own ways
        for completion in out.outputs:
            ids = torch.tensor([prompt + completion.token_ids])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            expected = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
            got = torch.tensor([lp for lp, _ in completion.logprobs])
            torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    assert_all_returned(engine)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_matches_transformers_on_the_engine_and_the_drop_in_cache(family):
    model = hybrid(family)
    g = torch.Generator().manual_seed(3)
    lengths = (5, 11, 2, 8)
    width = max(lengths)
    input_ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, n in enumerate(lengths):
        input_ids[row, width - n:] = torch.randint(3, 200, (n,), generator=g)
        mask[row, width - n:] = 1
    kwargs = dict(input_ids=input_ids, attention_mask=mask, num_beams=3, num_return_sequences=2, max_new_tokens=8,
                  return_dict_in_generate=True, output_scores=True, eos_token_id=None)
    ref = dense_generate(model, **kwargs)
    with paged(model, num_blocks=256, block_size=4):
        out = model.generate(**kwargs, cache_implementation="paged")
        engine = model._hf_paged_engine
        assert_all_returned(engine)
        dropin = model.generate(**kwargs, past_key_values=hf_paged.PagedCache(config=model.config, num_blocks=256,
                                                                             block_size=4))
    for got in (out, dropin):
        assert torch.equal(got.sequences, ref.sequences)
        torch.testing.assert_close(got.sequences_scores, ref.sequences_scores, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_tokens_and_gives_every_slot_back(mode):
    model = hybrid("granitemoehybrid")
    prompts, refs = references("granitemoehybrid")
    engine = hf_paged.Engine(model, num_blocks=14, block_size=4, preemption_mode=mode,
                             swap_space=0.01 if mode == "swap" else 0.0)
    engine.runner.decode_mode = "static"
    assert engine_greedy(engine, prompts) == refs
    assert engine.scheduler.num_preemptions[mode] > 0
    assert_all_returned(engine)


def test_aborts_free_their_slots_at_once():
    model = hybrid("qwen3_5_text")
    prompts, refs = references("qwen3_5_text")
    engine = hf_paged.Engine(model, num_blocks=96, block_size=4)
    ids = [engine.add_request(p, max_new_tokens=8, ignore_eos=True) for p in prompts]
    for _ in range(3):
        engine.step()
    assert engine.kv_stats().state_slots_used > 0
    for request_id in ids[::2]:
        engine.abort(request_id)
    done = {o.request_id: o for o in engine.stream() if o.finished}
    for i, request_id in enumerate(ids):
        if i % 2:
            assert done[request_id].outputs[0].token_ids == refs[i]
        else:
            assert done[request_id].outputs[0].finish_reason == "abort"
    assert_all_returned(engine)


def test_admission_never_runs_more_sequences_than_slots():
    model = hybrid("qwen3_5_text")
    prompts, refs = references("qwen3_5_text")
    engine = hf_paged.Engine(model, num_blocks=96, block_size=4, max_num_seqs=2)
    assert engine.kv_stats().state_slots == 2
    params = [hf_paged.SamplingParams(max_new_tokens=8, ignore_eos=True)] * 3 + [
        hf_paged.SamplingParams(max_new_tokens=4, do_sample=True, num_return_sequences=2, seed=1)]
    ids = [engine.add_request(p, params=q) for p, q in zip(prompts, params)]
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, engine.kv_stats().state_slots_used)
    assert most == 2
    assert_all_returned(engine)
    assert ids


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_prefix_hits_resume_from_state_checkpoints_with_the_same_tokens(family):
    model = hybrid(family)
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, 200, (22,), generator=g).tolist()
    prompts = [system + torch.randint(3, 200, (int(n),), generator=g).tolist()
               for n in torch.randint(2, 9, (10,), generator=g)]
    plain = hf_paged.Engine(model, num_blocks=160, block_size=4, enable_prefix_caching=False)
    expected = engine_greedy(plain, prompts)
    engine = hf_paged.Engine(model, num_blocks=160, block_size=4)
    engine.runner.decode_mode = "static"
    got = engine_greedy(engine, prompts[:1]) + engine_greedy(engine, prompts[1:])  # one turn first, then a burst
    assert got == expected
    hits = engine.prefix_cache_stats()
    # the 20 tokens of the system prompt's whole blocks (far below vLLM's 528): the first turn left them in the cache
    # with no state there, so the burst's first prompt computes that state once and the other 8 resume from it
    assert hits.hit_tokens >= 8 * 20, hits
    state = engine.block_manager.state
    assert state.checkpoint_hits >= 8 and state.num_checkpoints_used > 0
    # a burst from an idle engine: the first prompt checkpoints the shared blocks, the others resume there
    engine2 = hf_paged.Engine(model, num_blocks=160, block_size=4)
    assert engine_greedy(engine2, prompts) == expected
    assert engine2.prefix_cache_stats().hit_tokens >= 9 * 20
    assert_all_returned(engine)
    assert_all_returned(engine2)


@pytest.mark.slow
def test_state_checkpoints_can_be_turned_off_and_weights_changes_drop_them():
    model = hybrid("qwen3_5_text")
    prompts, refs = references("qwen3_5_text")
    engine = hf_paged.Engine(model, num_blocks=96, block_size=4, state_checkpoints=0)
    assert engine_greedy(engine, prompts[:2]) == refs[:2] and engine_greedy(engine, prompts[:2]) == refs[:2]
    assert engine.prefix_cache_stats().hit_tokens == 0  # K/V blocks are cached, but no state to resume from
    engine = hf_paged.Engine(model, num_blocks=96, block_size=4)
    engine_greedy(engine, prompts[3:4])
    assert engine.block_manager.state.num_checkpoints_used > 0
    engine.reset_prefix_cache()
    assert engine.block_manager.state.num_checkpoints_used == 0


def test_state_memory_is_counted_in_the_kv_budget():
    model = hybrid("qwen3_5_text")
    specs = hf_paged.attention.profile_state_specs(model)
    per_slot = sum(spec.nbytes for spec in specs.values())
    assert {key[0] for key in specs} == {0, 1, 2} and {key[1] for key in specs} == {"conv", "recurrent"}
    budget = 40 * per_slot
    engine = hf_paged.Engine(model, kv_cache_memory=budget, block_size=4, max_num_seqs=16, state_checkpoints=4)
    used = engine.cache.pool.numel() * engine.cache.pool.element_size() + (16 + 4 + 1) * per_slot
    assert used <= budget and budget - used < engine.cache.bytes_per_block(torch.float32)
    with pytest.raises(ValueError, match="max_num_seqs"):
        hf_paged.Engine(model, kv_cache_memory=budget, block_size=4, max_num_seqs=64)
    with pytest.raises(ValueError, match="state_checkpoints"):
        hf_paged.Engine(model, num_blocks=8, state_checkpoints=-1)


def test_the_drop_in_cache_cannot_be_cropped_for_a_hybrid_model():
    model = hybrid("qwen3_5_text")
    ids = torch.tensor([random_prompts((6,), seed=1, vocab=200)[0]])
    with paged(model):
        cache = hf_paged.PagedCache(config=model.config, num_blocks=32, block_size=4)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        assert cache.has_states and cache.stats().state_slots_used == 1
        with pytest.raises(ValueError, match="cannot be rolled back"):
            cache.crop(-2)
