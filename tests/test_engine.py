"""`hf_paged.Engine` (continuous batching) driven directly.

Greedy outputs must equal transformers' generate() (DynamicCache) for each prompt alone, whatever the engine did in
between: preemption by recompute or swap, chunked prefill, aborts and failures of other requests. Every run must give
every KV block back (GPU pool and CPU swap pool).
"""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged import kernels
from hf_paged.testing import tiny_model

try:
    from tests.helpers import dense, greedy_reference, random_prompts, restore_generation_config, tiny_word_tokenizer
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import dense, greedy_reference, random_prompts, restore_generation_config, tiny_word_tokenizer

FAMILY = "llama"
MAX_NEW = 16
LENGTHS = (1, 39, 7, 22, 3, 31, 12, 5, 17, 26, 2, 9, 35, 14, 4, 20, 11)  # 17 prompts, longest 39


@pytest.fixture(scope="module")
def model():
    return tiny_model(FAMILY, seed=1)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS, seed=3)


@pytest.fixture(scope="module")
def references(model, prompts):
    """transformers greedy (DynamicCache, plain model) per prompt; stops at the model's eos like the engine."""
    return [greedy_reference(model, p, MAX_NEW) for p in prompts]


def assert_no_leaks(engine):
    stats = engine.kv_stats()
    assert stats.used_blocks == 0, stats
    assert stats.free_blocks == stats.num_blocks
    assert stats.cpu_used_blocks == 0, stats
    assert stats.cpu_free_blocks == stats.cpu_blocks
    assert not engine.has_unfinished()
    assert engine.block_manager.seq_ids() == []


def tokens(results):
    return [r.outputs[0].token_ids for r in results]


def make_engine(model, **kwargs):
    kwargs.setdefault("block_size", 8)
    return hf_paged.Engine(model, **kwargs)


class ScheduleSpy:
    """Wraps engine.scheduler.schedule to record every scheduled chunk (start, num_tokens, prompt_len)."""

    def __init__(self, engine):
        self.chunks = []
        original = engine.scheduler.schedule

        def schedule():
            out = original()
            self.chunks.extend((s.start, s.num_tokens, s.seq.prompt_len) for s in out.scheduled)
            return out

        engine.scheduler.schedule = schedule

    @property
    def partial_prefills(self):
        return [c for c in self.chunks if c[0] + c[1] < c[2]]


# ----------------------------------------------------------------------------------------------- greedy == transformers


def test_roomy_pool_greedy_matches_transformers(model, prompts, references):
    engine = make_engine(model, num_blocks=256)
    results = engine.generate(prompts, max_new_tokens=MAX_NEW)
    assert tokens(results) == references
    assert [r.prompt_token_ids for r in results] == prompts
    assert all(r.finished and r.error is None and r.num_preemptions == 0 for r in results)
    assert sum(engine.scheduler.num_preemptions.values()) == 0
    assert engine.stats["max_running"] == len(prompts)  # really batched
    for r, ref in zip(results, references):
        assert r.outputs[0].finish_reason == ("eos" if ref[-1] == 2 and len(ref) <= MAX_NEW else "length")
    assert_no_leaks(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_pool_preempts_many_times_and_stays_exact(model, prompts, references, mode):
    kwargs = dict(num_blocks=12, preemption_mode=mode)
    if mode == "swap":
        kwargs["swap_space"] = 0.01  # GiB
    engine = make_engine(model, **kwargs)
    assert (engine.kv_stats().cpu_blocks > 0) == (mode == "swap")
    results = engine.generate(prompts, max_new_tokens=MAX_NEW)
    assert tokens(results) == references
    assert engine.scheduler.num_preemptions[mode] >= 3, engine.scheduler.num_preemptions
    other = "swap" if mode == "recompute" else "recompute"
    assert engine.scheduler.num_preemptions[other] == 0
    assert sum(r.num_preemptions for r in results) == engine.scheduler.num_preemptions[mode]
    assert_no_leaks(engine)
    # the engine is reusable after a run
    again = engine.generate(prompts[:5], max_new_tokens=MAX_NEW)
    assert tokens(again) == references[:5]
    assert_no_leaks(engine)


@pytest.mark.parametrize(
    "pool", [dict(num_blocks=256), dict(num_blocks=12), dict(num_blocks=12, preemption_mode="swap", swap_space=0.01)],
    ids=["roomy", "tiny_recompute", "tiny_swap"],
)
def test_chunked_prefill_stays_exact(model, prompts, references, pool):
    engine = make_engine(model, max_num_batched_tokens=16, **pool)  # < the longest prompt (39)
    spy = ScheduleSpy(engine)
    results = engine.generate(prompts, max_new_tokens=MAX_NEW)
    assert tokens(results) == references
    assert spy.partial_prefills, "no prompt was prefilled in chunks"
    assert max(n for _, n, _ in spy.chunks) <= 16
    assert_no_leaks(engine)


def test_other_block_size_and_max_num_seqs(model, prompts, references):
    engine = make_engine(model, block_size=32, num_blocks=6, max_num_seqs=3)
    results = engine.generate(prompts, max_new_tokens=MAX_NEW)
    assert tokens(results) == references
    assert engine.stats["max_running"] <= 3
    assert_no_leaks(engine)


def test_swap_pool_too_small_falls_back_to_recompute(model, prompts, references):
    """A group that does not fit the CPU pool is preempted by recompute instead; both kinds stay exact."""
    per_block = hf_paged.PagedCache(config=model.config, num_blocks=1, block_size=8).bytes_per_block(torch.float32)
    engine = make_engine(model, num_blocks=12, preemption_mode="swap", swap_space=3 * per_block / 2**30 + 1e-12)
    assert engine.kv_stats().cpu_blocks == 3
    results = engine.generate(prompts, max_new_tokens=MAX_NEW)
    assert tokens(results) == references
    assert engine.scheduler.num_preemptions["swap"] > 0 and engine.scheduler.num_preemptions["recompute"] > 0
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------------------------- aborts


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_abort_mid_run_from_the_stream_loop(model, prompts, references, mode):
    kwargs = dict(num_blocks=12, preemption_mode=mode, swap_space=0.01 if mode == "swap" else 0.0)
    engine = make_engine(model, **kwargs)
    ids = [engine.add_request(p, request_id=f"r{i}", max_new_tokens=MAX_NEW) for i, p in enumerate(prompts)]
    to_abort = {ids[1], ids[4], ids[9], ids[16]}  # running, waiting or swapped when aborted
    aborted, finished = set(), {}
    waiting_abort_done = False
    for out in engine.stream():
        assert out.request_id not in finished, "output after the request finished"
        if out.finished:
            finished[out.request_id] = out
            continue
        if out.request_id in to_abort and len(out.outputs[0].token_ids) >= 3:
            before = engine.kv_stats()
            assert engine.abort(out.request_id) is True
            after = engine.kv_stats()
            assert after.used_blocks < before.used_blocks or after.cpu_used_blocks < before.cpu_used_blocks
            aborted.add(out.request_id)
        if not waiting_abort_done and engine.scheduler.waiting:
            victim = engine.scheduler.waiting[-1].request_id
            if victim not in to_abort and victim not in aborted:
                to_abort.add(victim)
                assert engine.abort(victim) is True  # never or no longer scheduled: nothing to free on the GPU
                aborted.add(victim)
                waiting_abort_done = True
        if mode == "swap" and engine.scheduler.swapped:
            victim = engine.scheduler.swapped[-1].request_id
            if victim not in aborted:
                before = engine.kv_stats().cpu_used_blocks
                assert engine.abort(victim) is True
                assert engine.kv_stats().cpu_used_blocks < before  # swapped blocks freed at once
                to_abort.add(victim)
                aborted.add(victim)
    assert set(finished) == set(ids)  # every request finished exactly once
    assert aborted, "nothing was aborted"
    for i, request_id in enumerate(ids):
        out = finished[request_id]
        if request_id in aborted:
            assert out.outputs[0].finish_reason == "abort"
            got = out.outputs[0].token_ids
            assert got == references[i][: len(got)]  # what it produced before the abort was right
        else:
            assert out.outputs[0].token_ids == references[i]
    assert engine.abort("r0") is False and engine.abort("no-such-request") is False
    assert_no_leaks(engine)


def test_abort_frees_blocks_at_once(model, prompts):
    engine = make_engine(model, num_blocks=64)
    ids = [engine.add_request(p, max_new_tokens=MAX_NEW, ignore_eos=True) for p in prompts[:4]]
    engine.step()
    engine.step()
    table_blocks = {b for s in engine.scheduler.find(ids[1]).seqs for b in engine.block_manager.block_table(s.seq_id)}
    before = engine.kv_stats().used_blocks
    assert engine.abort(ids[1])
    assert engine.kv_stats().used_blocks == before - len(table_blocks) and table_blocks
    outs = {o.request_id: o for o in engine.step()}
    assert outs[ids[1]].finished and outs[ids[1]].outputs[0].finish_reason == "abort"
    for out in engine.stream():
        assert out.request_id != ids[1]
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------------------------- injected failure


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_failing_forward_fails_only_its_step(model, prompts, references, mode):
    engine = make_engine(model, num_blocks=12, max_num_seqs=3, preemption_mode=mode,
                         swap_space=0.01 if mode == "swap" else 0.0)
    calls = {"n": 0}
    in_failed_step = []
    original_forward = model.forward

    def flaky_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:
            in_failed_step.extend(s.group.request_id for s in engine._last_sched.scheduled)
            raise RuntimeError("injected failure")
        return original_forward(*args, **kwargs)

    original_schedule = engine.scheduler.schedule

    def schedule():
        engine._last_sched = original_schedule()
        return engine._last_sched

    engine.scheduler.schedule = schedule
    model.forward = flaky_forward  # instance attribute: nn.Module.__call__ uses it
    try:
        results = engine.generate(prompts, max_new_tokens=MAX_NEW)
    finally:
        del model.forward
    assert calls["n"] > 6
    failed = set(in_failed_step)
    assert failed and len(failed) < len(prompts)
    for ref, result in zip(references, results):
        assert result.finished
        if result.request_id in failed:
            assert isinstance(result.error, RuntimeError) and "injected failure" in str(result.error)
            assert [o.finish_reason for o in result.outputs] == ["error"]
        else:
            assert result.error is None
            assert result.outputs[0].token_ids == ref
    assert_no_leaks(engine)
    assert tokens(engine.generate(prompts[:4], max_new_tokens=MAX_NEW)) == references[:4]
    assert_no_leaks(engine)


def test_failing_logits_processor_fails_only_its_request(model, prompts, references):
    def broken(input_ids, scores):
        raise ValueError("processor exploded")

    # max_num_seqs=1: the broken request is alone in its steps (a failing step fails every request scheduled in it)
    engine = make_engine(model, num_blocks=64, max_num_seqs=1)
    params = [hf_paged.SamplingParams(max_new_tokens=MAX_NEW) for _ in prompts[:5]]
    params[2] = hf_paged.SamplingParams(max_new_tokens=MAX_NEW, logits_processor=broken)
    results = engine.generate(prompts[:5], params)
    assert isinstance(results[2].error, ValueError) and results[2].outputs[0].finish_reason == "error"
    for i in (0, 1, 3, 4):
        assert results[i].error is None and results[i].outputs[0].token_ids == references[i]
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------------------------- per-request params


def test_per_request_params_in_one_run(model):
    tok = tiny_word_tokenizer()
    prompts = random_prompts((6, 11, 4, 9, 14, 8, 5), seed=21)
    with restore_generation_config(model) as config:
        config.eos_token_id = None  # full greedy streams, no stopping
        streams = [greedy_reference(model, p, 12) for p in prompts]
    assert all(len(s) == 12 for s in streams)
    # r2: stop at the first 3-digit token after the first one (its word "w123" appears only when it is produced)
    stop_at = next(j for j in range(1, 12) if streams[2][j] >= 100)
    stop_token = streams[2][stop_at]
    eos3 = streams[3][1]
    min_ref = greedy_reference(model, prompts[3], 12, min_new_tokens=6, eos_token_id=eos3)
    default_ref = greedy_reference(model, prompts[5], 12)  # model eos (2)
    params = [
        hf_paged.SamplingParams(max_new_tokens=5),
        hf_paged.SamplingParams(max_new_tokens=12, eos_token_id=streams[1][4]),
        hf_paged.SamplingParams(max_new_tokens=12, stop_strings=[f"w{stop_token}"]),
        hf_paged.SamplingParams(max_new_tokens=12, eos_token_id=eos3, min_new_tokens=6),
        hf_paged.SamplingParams(max_new_tokens=12, eos_token_id=streams[4][2], ignore_eos=True),
        hf_paged.SamplingParams(max_new_tokens=12),
        hf_paged.SamplingParams(max_new_tokens=12, eos_token_id=[streams[6][7], streams[6][9]]),
    ]
    engine = make_engine(model, num_blocks=10, tokenizer=tok)
    results = engine.generate(prompts, params)
    got = tokens(results)
    assert got[0] == streams[0][:5] and results[0].outputs[0].finish_reason == "length"
    cut = streams[1].index(streams[1][4]) + 1
    assert got[1] == streams[1][:cut] and results[1].outputs[0].finish_reason == "eos"
    cut = streams[2].index(stop_token) + 1
    assert got[2] == streams[2][:cut] and results[2].outputs[0].finish_reason == "stop_string"
    assert got[3] == min_ref and len(got[3]) >= 6
    assert got[4] == streams[4] and results[4].outputs[0].finish_reason == "length"
    assert got[5] == default_ref
    cut = min(i for i, t in enumerate(streams[6]) if t in (streams[6][7], streams[6][9])) + 1
    assert got[6] == streams[6][:cut]
    # text is decoded for finished requests when the engine has a tokenizer
    assert results[0].outputs[0].text == tok.decode(got[0], skip_special_tokens=True)
    assert_no_leaks(engine)


def test_stop_string_spanning_two_tokens(model):
    tok = tiny_word_tokenizer()
    prompt = random_prompts((7,), seed=22)[0]
    with restore_generation_config(model) as config:
        config.eos_token_id = None
        stream = greedy_reference(model, prompt, 10)
    stop = tok.decode(stream[3:5])  # "wA wB": needs two tokens
    engine = make_engine(model, num_blocks=16, tokenizer=tok)
    (result,) = engine.generate([prompt], max_new_tokens=10, stop_strings=stop, ignore_eos=True)
    produced = result.outputs[0].token_ids
    assert tok.decode(produced).find(stop) >= 0 and stop not in tok.decode(produced[:-1])
    assert produced == stream[: len(produced)] and result.outputs[0].finish_reason == "stop_string"
    assert_no_leaks(engine)


def test_seeds(model, prompts):
    engine = make_engine(model, num_blocks=64)
    prompt = prompts[3]
    seeds = [7, 7, 8, 9, 10]
    params = [hf_paged.SamplingParams(max_new_tokens=10, do_sample=True, seed=s, ignore_eos=True) for s in seeds]
    results = tokens(engine.generate([prompt] * len(seeds), params))
    assert results[0] == results[1]  # same seed, same sample (in one batch)
    assert len({tuple(r) for r in results[1:]}) > 1  # different seeds: different samples
    again = tokens(engine.generate([prompt], params[0]))[0]
    assert again == results[0]  # and across runs
    # a seeded request is not disturbed by unseeded neighbours nor by preemption
    small = make_engine(model, num_blocks=8)
    mixed = [hf_paged.SamplingParams(max_new_tokens=10, do_sample=True, ignore_eos=True)] * 6 + [params[0]]
    out = tokens(small.generate(prompts[:6] + [prompt], mixed))
    assert out[-1] == results[0]
    assert_no_leaks(engine)
    assert_no_leaks(small)


def test_temperature_top_k_top_p_sampling_runs_and_respects_top_k_1(model, prompts, references):
    """top_k=1 sampling is greedy whatever the seed."""
    engine = make_engine(model, num_blocks=64)
    params = hf_paged.SamplingParams(max_new_tokens=MAX_NEW, do_sample=True, top_k=1, temperature=0.7, seed=3)
    assert tokens(engine.generate(prompts[:6], params)) == references[:6]
    params = hf_paged.SamplingParams(max_new_tokens=8, do_sample=True, top_k=20, top_p=0.9, min_p=0.05,
                                     temperature=1.3, repetition_penalty=1.2)
    outs = engine.generate(prompts[:6], params)
    assert all(0 < len(o.outputs[0].token_ids) <= 8 for o in outs)
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------------------------- streaming


def test_stream_yields_growing_outputs_and_finishes_each_request_once(model, prompts, references):
    engine = make_engine(model, num_blocks=16)
    ids = [engine.add_request(p, max_new_tokens=MAX_NEW) for p in prompts[:8]]
    lengths = {i: 0 for i in ids}
    finished = []
    for out in engine.stream():
        assert out.request_id in lengths and out.request_id not in finished
        n = len(out.outputs[0].token_ids)
        assert n == lengths[out.request_id] + 1 or (n == lengths[out.request_id] and out.num_preemptions > 0)
        lengths[out.request_id] = n
        if out.finished:
            finished.append(out.request_id)
            assert out.outputs[0].token_ids == references[ids.index(out.request_id)]
        else:
            assert out.outputs[0].finish_reason is None
    assert sorted(finished) == sorted(ids)
    assert_no_leaks(engine)


def test_requests_join_while_running(model, prompts, references):
    engine = make_engine(model, num_blocks=24)
    first = [engine.add_request(p, max_new_tokens=MAX_NEW) for p in prompts[:3]]
    results = {}
    late = []
    for step in range(200):
        if step in (2, 5, 9):
            late.append(engine.add_request(prompts[3 + len(late)], max_new_tokens=MAX_NEW))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished() and step > 9:
            break
    for i, request_id in enumerate(first + late):
        assert results[request_id] == references[i]
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------------------------- parallel sampling


@pytest.mark.parametrize("pool", [dict(num_blocks=64), dict(num_blocks=16, preemption_mode="swap", swap_space=0.01),
                                  dict(num_blocks=16)], ids=["roomy", "tiny_swap", "tiny_recompute"])
def test_parallel_sampling_shares_prompt_blocks(model, prompts, pool):
    engine = make_engine(model, **pool)
    chosen = [p for p in prompts if 8 <= len(p) <= 20][:4]
    ids = [engine.add_request(p, max_new_tokens=10, do_sample=True, num_return_sequences=3, seed=i, ignore_eos=True)
           for i, p in enumerate(chosen)]
    max_shared, saving = 0, 0.0
    finished = {}
    for out in engine.stream():
        stats = engine.kv_stats()
        max_shared = max(max_shared, stats.shared_blocks)
        saving = max(saving, stats.sharing_saving)
        if out.finished:
            finished[out.request_id] = out
    assert max_shared > 0 and saving > 0  # the n=3 samples share the prompt's blocks after the fork
    for request_id in ids:
        out = finished[request_id]
        assert len(out.outputs) == 3 and [o.index for o in out.outputs] == [0, 1, 2]
        assert all(len(o.token_ids) == 10 and o.finish_reason == "length" for o in out.outputs)
        assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert_no_leaks(engine)
    if pool["num_blocks"] == 16:
        assert sum(engine.scheduler.num_preemptions.values()) > 0
    # preemption does not change seeded samples
    roomy = make_engine(model, num_blocks=128)
    same = roomy.generate(chosen, [hf_paged.SamplingParams(max_new_tokens=10, do_sample=True, num_return_sequences=3,
                                                           seed=i, ignore_eos=True) for i in range(len(chosen))])
    for request_id, ref in zip(ids, same):
        assert [o.token_ids for o in finished[request_id].outputs] == [o.token_ids for o in ref.outputs]


def _run_bounded(engine, max_steps):
    """Step at most max_steps times; return (finished outputs by id, whether the engine drained)."""
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return finished, True
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished, not engine.has_unfinished()


def test_parallel_sampling_with_token_budget_below_n_is_rejected_or_completes(model):
    engine = make_engine(model, num_blocks=32, max_num_batched_tokens=2)
    try:
        request_id = engine.add_request([5, 6, 7, 8, 9], max_new_tokens=4, do_sample=True, num_return_sequences=3,
                                        seed=0)
    except ValueError:
        assert_no_leaks(engine)
        return
    finished, drained = _run_bounded(engine, 60)
    assert drained and len(finished[request_id].outputs) == 3, "the engine stopped making progress"
    assert_no_leaks(engine)


def test_recompute_preemption_of_forked_group_with_chunked_prefill(model):
    engine = make_engine(model, num_blocks=10, max_num_batched_tokens=16)
    chosen = random_prompts((12, 12, 12), seed=5)
    ids = [engine.add_request(p, max_new_tokens=12, do_sample=True, num_return_sequences=3, seed=i, ignore_eos=True)
           for i, p in enumerate(chosen)]
    finished, drained = _run_bounded(engine, 400)
    assert engine.scheduler.num_preemptions["recompute"] > 0
    assert drained and set(finished) == set(ids)
    assert all(len(finished[i].outputs) == 3 and all(len(o.token_ids) == 12 for o in finished[i].outputs)
               for i in ids)
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------------------------- bad input


def _bad_requests(engine):
    return {
        "empty_prompt": (([],), {}, ValueError, "empty"),
        "token_ge_vocab": (([5, engine.vocab_size],), {}, ValueError, "vocab"),
        "negative_token": (([5, -1],), {}, ValueError, "vocab"),
        "bool_token": (([True, 5],), {}, TypeError, "int"),
        "max_new_tokens_0": (([5, 6],), dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        "max_new_tokens_negative": (([5, 6],), dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
        "max_new_tokens_float": (([5, 6],), dict(max_new_tokens=2.0), TypeError, "max_new_tokens"),
        "temperature_0_sampling": (([5, 6],), dict(do_sample=True, temperature=0.0), ValueError, "temperature"),
        "temperature_negative_sampling": (([5, 6],), dict(do_sample=True, temperature=-1.0), ValueError,
                                          "temperature"),
        "top_p_0": (([5, 6],), dict(do_sample=True, top_p=0.0), ValueError, "top_p"),
        "top_p_1.5": (([5, 6],), dict(do_sample=True, top_p=1.5), ValueError, "top_p"),
        "top_k_negative": (([5, 6],), dict(do_sample=True, top_k=-1), ValueError, "top_k"),
        "min_p_2": (([5, 6],), dict(do_sample=True, min_p=2.0), ValueError, "min_p"),
        "unknown_kwarg": (([5, 6],), dict(frobnicate=1), TypeError, "frobnicate"),
        "float_tensor": ((torch.tensor([5.0, 6.0]),), {}, TypeError, "dtype"),
        "2d_tensor": ((torch.tensor([[5, 6]]),), {}, ValueError, "1-D"),
        "string_without_tokenizer": (("hello",), {}, TypeError, "tokenizer"),
        "stop_strings_without_tokenizer": (([5, 6],), dict(stop_strings=["x"]), ValueError, "tokenizer"),
        "greedy_num_return_sequences": (([5, 6],), dict(num_return_sequences=2), ValueError, "num_return_sequences"),
        "beyond_max_position_embeddings": (([5] * 500,), dict(max_new_tokens=13), ValueError,
                                           "max_position_embeddings"),
        "never_fits_the_pool": (([5] * 100,), dict(max_new_tokens=100), ValueError, "num_blocks"),
        "params_and_kwargs": (([5, 6],), dict(params=hf_paged.SamplingParams(), max_new_tokens=3), TypeError,
                              "params"),
    }


BAD_NAMES = sorted(_bad_requests(type("E", (), {"vocab_size": 384})()))


@pytest.mark.parametrize("case", BAD_NAMES)
def test_bad_request_raises_and_leaves_nothing_behind(model, prompts, references, case):
    engine = make_engine(model, num_blocks=20)
    args, kwargs, error, match = _bad_requests(engine)[case]
    # a valid request is in flight while the bad one arrives
    good = engine.add_request(prompts[2], max_new_tokens=MAX_NEW)
    engine.step()
    used = engine.kv_stats().used_blocks
    with pytest.raises(error, match=match):
        engine.add_request(*args, **kwargs)
    assert engine.kv_stats().used_blocks == used
    assert [g.request_id for g in engine.scheduler.groups()] == [good]
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.outputs[0].token_ids == references[2]
    assert_no_leaks(engine)
    # and on an idle engine
    with pytest.raises(error, match=match):
        engine.add_request(*args, **kwargs)
    assert_no_leaks(engine)


def test_duplicate_request_id(model, prompts):
    engine = make_engine(model, num_blocks=20)
    engine.add_request(prompts[0], request_id="dup", max_new_tokens=3)
    with pytest.raises(ValueError, match="dup"):
        engine.add_request(prompts[1], request_id="dup", max_new_tokens=3)
    assert len(engine.scheduler.groups()) == 1
    (result,) = [o for o in engine.stream() if o.finished]
    assert result.request_id == "dup" and result.prompt_token_ids == prompts[0]
    assert_no_leaks(engine)
    engine.add_request(prompts[1], request_id="dup", max_new_tokens=3)  # free again once finished
    list(engine.stream())
    assert_no_leaks(engine)


def test_generate_with_one_bad_prompt_queues_nothing(model, prompts):
    engine = make_engine(model, num_blocks=20)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([prompts[0], prompts[1], []], max_new_tokens=4)
    assert_no_leaks(engine)
    with pytest.raises(ValueError, match="params"):
        engine.generate(prompts[:3], [hf_paged.SamplingParams()] * 2)
    assert_no_leaks(engine)


def test_a_block_size_below_the_triton_kernels_tiles_is_refused_up_front(model, monkeypatch):
    """Blocks of 4 tokens work on the torch path; on the Triton kernels' device (here their interpreter) the engine
    refuses them at construction, not by failing every request of every step."""
    if not kernels.triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    with pytest.raises(ValueError, match="block_size must be a power of two in \\[8, 256\\]"):
        make_engine(model, block_size=4, num_blocks=16)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_blocks=8, preemption_mode="swap"), ValueError, "swap_space"),
        (dict(num_blocks=8, preemption_mode="evict"), ValueError, "preemption_mode"),
        (dict(num_blocks=8, swap_space=-1), ValueError, "swap_space"),
        (dict(num_blocks=8, block_size=12), ValueError, "block_size"),
        (dict(num_blocks=0), ValueError, "num_blocks"),
        (dict(num_blocks=8, max_num_seqs=0), ValueError, "max_num_seqs"),
        (dict(num_blocks=8, max_num_batched_tokens=0), ValueError, "max_num_batched_tokens"),
    ],
)
def test_bad_engine_arguments(model, kwargs, error, match):
    with pytest.raises(error, match=match):
        hf_paged.Engine(model, **kwargs)


def test_string_prompts_with_tokenizer(model):
    tok = tiny_word_tokenizer()
    prompts = random_prompts((5, 8), seed=30)
    texts = [tok.decode(p) for p in prompts]
    refs = [greedy_reference(model, p, 6) for p in prompts]
    engine = make_engine(model, num_blocks=16, tokenizer=tok)
    results = engine.generate(texts, max_new_tokens=6)
    assert [r.prompt_token_ids for r in results] == prompts
    assert tokens(results) == refs
    assert [r.outputs[0].text for r in results] == [tok.decode(r, skip_special_tokens=True) for r in refs]
    assert_no_leaks(engine)


def test_engine_leaves_the_model_usable_by_transformers(model, prompts, references):
    make_engine(model, num_blocks=16).generate(prompts[:2], max_new_tokens=4)  # enables the model
    with dense(model):
        assert greedy_reference(model, prompts[0], MAX_NEW) == references[0]


# ------------------------------------------------------------------------------- static decode path (CUDA graphs' host)


def _static(engine):
    """Run decode steps the way the CUDA-graph path does (persistent buffers, table store, bucketed batches), with
    the forward run eagerly: the CPU can then check the GPU's decode path token for token."""
    engine.runner.decode_mode = "static"
    return engine


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(num_blocks=200),
        dict(num_blocks=24, max_num_batched_tokens=32),  # tiny pool: recompute preemption, chunked prefill
        dict(num_blocks=24, preemption_mode="swap", swap_space=0.01, max_num_seqs=8),
        dict(num_blocks=200, enable_prefix_caching=False, max_num_seqs=5),  # rows swept and reused
    ],
    ids=["roomy", "recompute", "swap", "small_batches"],
)
def test_static_decode_path_equals_transformers(model, prompts, references, engine_kwargs):
    engine = _static(make_engine(model, **engine_kwargs))
    results = engine.generate(prompts, max_new_tokens=MAX_NEW)
    assert tokens(results) == references
    assert engine.runner.graph_steps > 0 and engine.runner.eager_steps > 0
    if engine_kwargs["num_blocks"] == 24:
        assert sum(engine.scheduler.num_preemptions.values()) > 0
    assert_no_leaks(engine)


def test_static_decode_uploads_only_changed_tables(model):
    """A finishing sequence shifts the batch rows but costs the others no re-upload: tables travel when they change
    (a new sequence, a new block), about once per block of decoding per sequence, not once per step."""
    engine = _static(make_engine(model, num_blocks=400, block_size=4, max_num_seqs=16))
    lengths = [3, 5, 9, 2, 7, 4, 6, 8]
    prompts = random_prompts(lengths, seed=5)
    results = engine.generate(prompts, [hf_paged.SamplingParams(max_new_tokens=8 + 6 * i, ignore_eos=True)
                                        for i in range(len(prompts))])
    assert [len(r.outputs[0].token_ids) for r in results] == [8 + 6 * i for i in range(len(prompts))]
    decode_tokens = engine.stats["decode_tokens"]
    assert engine.runner.table_rows_uploaded <= len(prompts) + decode_tokens // 4 + len(prompts)
    assert engine.runner.table_rows_uploaded < decode_tokens / 2


def test_static_decode_with_beams_parallel_samples_and_prefix_hits(model, prompts):
    """Forks (shared tables, copy-on-write of the last block) and prefix-cache hits through the static path give
    exactly what the eager path gives."""
    shared = prompts[1][:24]
    requests = [(shared + p[:5], dict(max_new_tokens=10, num_beams=3, num_return_sequences=2)) for p in prompts[:3]]
    requests += [(shared + p[:3], dict(max_new_tokens=9, do_sample=True, num_return_sequences=3, seed=i))
                 for i, p in enumerate(prompts[3:6])]
    requests += [(p, dict(max_new_tokens=12)) for p in prompts[6:10]]
    outputs = []
    for mode in ("eager", "static"):
        engine = make_engine(model, num_blocks=120)
        engine.runner.decode_mode = mode
        results = engine.generate([p for p, _ in requests],
                                  [hf_paged.SamplingParams(**kw) for _, kw in requests])
        outputs.append([[o.token_ids for o in r.outputs] for r in results])
        assert engine.prefix_cache_stats().hit_tokens > 0
        assert_no_leaks(engine)
        if mode == "static":
            assert engine.runner.graph_steps > 0
    assert outputs[0] == outputs[1]


def test_default_token_budget_follows_vllms_choice(monkeypatch):
    """16,384 tokens a step offline on an H100-class GPU (>= 70 GiB, not an A100), 8,192 on other GPUs and when
    serving, 2,048 on the CPU; an explicit budget always wins."""
    import types

    from hf_paged.engine import default_max_num_batched_tokens

    def props(name, gib):
        return lambda device: types.SimpleNamespace(name=name, total_memory=gib * 2**30)

    assert default_max_num_batched_tokens("cpu") == 2048 and default_max_num_batched_tokens("cpu", serving=True) == 2048
    for name, gib, offline in (("NVIDIA H100 80GB HBM3", 80, 16384), ("NVIDIA H200", 141, 16384),
                               ("NVIDIA A100-SXM4-80GB", 80, 8192), ("NVIDIA L4", 24, 8192)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", props(name, gib))
        assert default_max_num_batched_tokens("cuda:0") == offline
        assert default_max_num_batched_tokens("cuda:0", serving=True) == 8192
    model = tiny_model("llama")
    assert hf_paged.Engine(model, num_blocks=8).max_num_batched_tokens == 2048
    assert hf_paged.Engine(model, num_blocks=8, max_num_batched_tokens=96).max_num_batched_tokens == 96
