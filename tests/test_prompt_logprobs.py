"""Prompt log-probabilities (`SamplingParams.prompt_logprobs_start`): the engine scores prompt tokens during the prefill.

Every score must equal the float32 `log_softmax` of transformers' own full forward (no cache) over the prompt, and
the argmax flag its argmax: without and with prefix caching (a later request sharing a long prefix takes it from the
cache, but never a position whose logits are wanted), with chunked prefill, beside decoding requests, on the static
decode path, and through recompute preemptions.
"""

from __future__ import annotations

import functools

import pytest
import torch

import hf_paged
from hf_paged import SamplingParams
from hf_paged.engine.prompt_logprobs import PROMPT_SCORING
from hf_paged.testing import tiny_model

try:
    from tests.helpers import dense, greedy_reference, random_prompts
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import dense, greedy_reference, random_prompts

BLOCK = 8
ATOL = 1e-5


@functools.cache
def model():
    """This module's own tiny model (engines enable it; references are computed with it disabled)."""
    return tiny_model("llama", seed=4)


@functools.cache
def reference(prompt: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each token 1..n-1 given the ones before, whether it is the argmax) from one full forward."""
    with dense(model()) as m, torch.no_grad():
        logprobs = m(input_ids=torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    targets = torch.tensor(prompt[1:])
    return logprobs.gather(1, targets[:, None])[:, 0], logprobs.argmax(-1) == targets


def assert_exact(result, prompt: list[int], start: int) -> None:
    values, greedy = reference(tuple(prompt))
    got = result.prompt_logprobs
    assert got is not None and len(got) == len(prompt) - start, (len(got or ()), len(prompt), start)
    torch.testing.assert_close(torch.tensor([v for v, _ in got]), values[start - 1 :], atol=ATOL, rtol=0)
    assert [g for _, g in got] == greedy[start - 1 :].tolist()
    assert result.prompt_token_ids == prompt


def assert_no_leaks(engine) -> None:
    stats = engine.kv_stats()
    assert stats.used_blocks == 0 and stats.cpu_used_blocks == 0, stats
    assert engine.block_manager.seq_ids() == [] and not engine.has_unfinished()


def engine_for(**kwargs) -> hf_paged.Engine:
    kwargs.setdefault("block_size", BLOCK)
    kwargs.setdefault("num_blocks", 128)
    return hf_paged.Engine(model(), **kwargs)


PROMPTS = random_prompts([2, 9, 23, 40, 17], seed=21)
STARTS = [1, 4, 1, 30, 16]  # the last scores only the final token (lm-eval's one-token continuations)


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("max_new_tokens", [0, 1, 3])
def test_prompt_logprobs_equal_full_forward(caching, max_new_tokens):
    engine = engine_for(enable_prefix_caching=caching)
    params = [SamplingParams(max_new_tokens=max_new_tokens, prompt_logprobs_start=s)
              for s in STARTS]
    results = engine.generate(PROMPTS, params)
    for prompt, start, result in zip(PROMPTS, STARTS, results):
        assert_exact(result, prompt, start)
        out = result.outputs[0]
        if max_new_tokens:  # generation is unaffected by the scoring
            assert out.token_ids == greedy_reference(model(), prompt, max_new_tokens)
        else:
            assert (out.token_ids, out.finish_reason) == ([], "length")
    assert_no_leaks(engine)


def test_requests_without_prompt_logprobs_report_none():
    engine = engine_for()
    result = engine.generate([PROMPTS[2]], max_new_tokens=2)[0]
    assert result.prompt_logprobs is None


def test_shared_context_comes_from_the_prefix_cache_and_scores_stay_exact():
    """lm-eval's multiple choice: one long context, several continuations. The context's whole blocks are computed
    once (the later requests hit them), the continuation positions never come from the cache."""
    context = random_prompts([45], seed=5)[0]
    continuations = random_prompts([1, 3, 1, 6], seed=6)
    prompts = [context + c for c in continuations]
    engine = engine_for(enable_prefix_caching=True)
    params = SamplingParams(max_new_tokens=0, prompt_logprobs_start=len(context))
    first = engine.generate(prompts[:1], params)
    hits_before = engine.prefix_cache_stats().hit_tokens
    rest = engine.generate(prompts[1:], params)
    for prompt, result in zip(prompts, first + rest):
        assert_exact(result, prompt, len(context))
    cached = (len(context) - 1) // BLOCK * BLOCK  # whole blocks before position len(context) - 1
    assert engine.prefix_cache_stats().hit_tokens - hits_before == cached * len(rest)
    # all at once: the scheduler holds the others back a step, then they hit the first one's blocks
    engine.reset_prefix_cache()
    together = engine.generate(prompts, params)
    for prompt, result in zip(prompts, together):
        assert_exact(result, prompt, len(context))
    assert engine.stats["prefix_hit_tokens"] >= cached * (len(prompts) - 1)
    assert_no_leaks(engine)


def test_prefix_cache_never_serves_a_scored_position():
    """A prompt fully cached by an earlier request, scored from early on: every scored position is recomputed."""
    prompt = random_prompts([41], seed=7)[0]
    engine = engine_for(enable_prefix_caching=True)
    engine.generate([prompt], max_new_tokens=1)  # caches its 5 whole blocks
    hits = engine.prefix_cache_stats().hit_tokens
    result = engine.generate([prompt], SamplingParams(max_new_tokens=0, prompt_logprobs_start=11))[0]
    assert engine.prefix_cache_stats().hit_tokens - hits == BLOCK  # position 10 lies in block 1: only block 0
    assert_exact(result, prompt, 11)
    assert_no_leaks(engine)


@pytest.mark.parametrize("caching", [False, True])
def test_chunked_prefill_beside_decoding_requests(caching):
    """A 7-token budget: long prompts are prefilled in chunks (scored rows collected across them) while other
    requests decode in the same steps."""
    engine = engine_for(enable_prefix_caching=caching, max_num_batched_tokens=7)
    generating = random_prompts([3, 5], seed=8)
    prompts = PROMPTS + generating
    params = [SamplingParams(max_new_tokens=m, prompt_logprobs_start=s)
              for s, m in zip(STARTS, (0, 2, 0, 1, 0))]
    params += [SamplingParams(max_new_tokens=6)] * len(generating)
    results = engine.generate(prompts, params)
    for prompt, start, result in zip(PROMPTS, STARTS, results):
        assert_exact(result, prompt, start)
    for prompt, result in zip(generating, results[len(PROMPTS):]):
        assert result.outputs[0].token_ids == greedy_reference(model(), prompt, 6)
    assert engine.stats["steps"] > sum(len(p) for p in prompts) // 7  # the budget did split the prompts
    assert_no_leaks(engine)


def test_static_decode_path_and_pipelining_keep_scores_exact():
    """On the static (CUDA-graph host logic) path with pipelined decode: scored steps go eager, the others
    pipeline, and a one-token chunk in the middle of a prompt never samples."""
    engine = engine_for(max_num_batched_tokens=3)
    engine.runner.decode_mode = "static"
    decoding = random_prompts([2, 2], seed=9)
    ids = [engine.add_request(p, max_new_tokens=40) for p in decoding]
    engine.step()  # both decode from now on; the next prompts get what is left of the 3-token budget
    scored = PROMPTS[1:3]
    for prompt, start in zip(scored, STARTS[1:3]):
        engine.add_request(prompt, request_id=tuple(prompt), max_new_tokens=2, prompt_logprobs_start=start)
    results = {}
    while engine.has_unfinished():
        for out in engine.step(finished_only=True):
            results[out.request_id] = out
    for prompt, start in zip(scored, STARTS[1:3]):
        assert_exact(results[tuple(prompt)], prompt, start)
        assert results[tuple(prompt)].outputs[0].token_ids == greedy_reference(model(), prompt, 2)
    for request_id, prompt in zip(ids, decoding):
        assert results[request_id].outputs[0].token_ids == greedy_reference(model(), prompt, 40)
    assert engine.runner.graph_steps > 0 and engine.pipelined_steps > 0
    assert_no_leaks(engine)


def test_static_path_never_samples_a_mid_prompt_chunk():
    """Regression: a one-token chunk in the middle of a prompt beside decodes took the static path, which sampled
    a token into the prompt."""
    engine = engine_for(max_num_batched_tokens=3, enable_prefix_caching=False)
    engine.runner.decode_mode = "static"
    prompts = [[5, 6], [7, 8], [9, 10, 11, 12, 13]]
    ids = [engine.add_request(p, max_new_tokens=4) for p in prompts[:2]]
    engine.step()
    ids.append(engine.add_request(prompts[2], max_new_tokens=4))
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    assert [outs[i] for i in ids] == [greedy_reference(model(), p, 4) for p in prompts]


@pytest.mark.parametrize("caching", [False, True])
def test_recompute_preemption_keeps_scores_exact(caching):
    """A pool too small for all requests: one is preempted in the middle of its scored prefill and recomputed; rows
    scored before the preemption are kept, the rest are scored when recomputed (the prefix cache capped again)."""
    engine = engine_for(num_blocks=12, max_num_batched_tokens=8, enable_prefix_caching=caching)
    at_preemption = []
    preempt = engine.scheduler._preempt

    def recording_preempt(group, out):
        scoring = group.data[PROMPT_SCORING]
        at_preemption.append((scoring.done, len(scoring.values)))
        preempt(group, out)

    engine.scheduler._preempt = recording_preempt
    prompts = random_prompts([30, 33, 28, 35], seed=10)
    starts = [3, 20, 27, 9]
    params = [SamplingParams(max_new_tokens=m, prompt_logprobs_start=s) for s, m in zip(starts, (12, 0, 10, 8))]
    results = engine.generate(prompts, params)
    assert any(not done and scored for done, scored in at_preemption), at_preemption
    for prompt, start, result in zip(prompts, starts, results):
        assert_exact(result, prompt, start)
    assert_no_leaks(engine)


BAD = {
    "start_0": (dict(prompt_logprobs_start=0), "prompt_logprobs_start"),
    "start_negative": (dict(prompt_logprobs_start=-2), "prompt_logprobs_start"),
    "start_bool": (dict(prompt_logprobs_start=True), "prompt_logprobs_start"),
    "start_float": (dict(prompt_logprobs_start=1.0), "prompt_logprobs_start"),
    "beams": (dict(prompt_logprobs_start=1, num_beams=2), "num_beams"),
    "max_new_tokens_0_without_start": (dict(max_new_tokens=0), "max_new_tokens"),
    "max_new_tokens_negative": (dict(max_new_tokens=-1, prompt_logprobs_start=1), "max_new_tokens"),
    "scoring_only_with_samples": (dict(max_new_tokens=0, prompt_logprobs_start=1, do_sample=True,
                                       num_return_sequences=2), "num_return_sequences"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_params_raise_naming_the_argument(case):
    kwargs, name = BAD[case]
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("start", [5, 6, 40])
def test_start_beyond_the_prompt_is_refused(start):
    engine = engine_for()
    with pytest.raises(ValueError, match=r"prompt_logprobs_start must be in \[1, len\(prompt\) - 1\] = \[1, 4\]"):
        engine.add_request([1, 2, 3, 4, 5], max_new_tokens=0, prompt_logprobs_start=start)
    with pytest.raises(ValueError, match="prompt_logprobs_start"):
        engine.add_request([1], max_new_tokens=1, prompt_logprobs_start=1)
    assert not engine.has_unfinished()


def test_scoring_only_fits_one_token_past_the_model_length():
    """A scoring-only request computes `prompt[:-1]`: max_position_embeddings + 1 tokens fit (lm-eval's full
    windows), one more does not."""
    limit = engine_for().max_model_len
    engine = engine_for(num_blocks=limit // BLOCK + 2)
    prompt = random_prompts([limit + 1], seed=12)[0]
    result = engine.generate([prompt], SamplingParams(max_new_tokens=0, prompt_logprobs_start=limit))[0]
    assert_exact(result, prompt, limit)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.add_request(prompt + [1], max_new_tokens=0, prompt_logprobs_start=3)
