"""Ragged steps on the runner's static buffers (`hf_paged.runner.ragged_graphs`): what a CUDA graph of a prefill or
mixed step records, run here without the graph (CPU).

What must hold: the prompts cut into virtual sequences of one query tile each, the padding to the token bucket and
the store's block tables give transformers' greedy tokens, for prompts prefilled alone, in chunks and beside running
decodes, with a sliding window shorter than the prompts; and the buffers describe each step exactly (no virtual
sequence past a sequence's queries, padding that writes nowhere).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import hf_paged
from hf_paged.runner.ragged_graphs import graph_tokens
from hf_paged.testing import tiny_model

try:
    from tests.helpers import greedy_reference, random_prompts
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import greedy_reference, random_prompts


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _compiled_engine(model, ragged: bool, **kwargs):
    """A compiled engine, warmed up, whose ragged steps run on the ragged buffers (`ragged`: every bucket recorded
    at its first step on CUDA) or eagerly."""
    engine = hf_paged.Engine(model, block_size=16, compile_decode=True, **kwargs)
    engine.runner.ragged_graphs = ragged
    engine.runner.ragged_capture_after = 0
    engine.warm_up(freeze_gc=False)
    return engine


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_buckets_pad_by_at_most_an_eighth_above_256_tokens_and_respect_the_budget():
    assert [graph_tokens(n) for n in (1, 16, 17, 250, 257, 1000, 1025, 2049, 4000)] == \
        [16, 16, 32, 256, 288, 1024, 1152, 2304, 4096]
    for n in range(257, 5000, 37):
        assert n <= graph_tokens(n) < n * 1.125
    assert graph_tokens(1000, limit=1010) == 1010 and graph_tokens(1020, limit=1010) == 1020
    assert len({graph_tokens(n) for n in range(1, 4097)}) == 48


@pytest.mark.parametrize("family, config, tile", [("llama", {}, 5), ("mistral", {"sliding_window": 12}, 8)])
@pytest.mark.slow
def test_ragged_steps_on_the_static_buffers_match_transformers(family, config, tile):
    """Prompts prefilled in chunks beside running decodes, each step through the ragged buffers: transformers'
    tokens. A tile of 5 queries cuts most chunks into several virtual sequences."""
    model = tiny_model(family, seed=3, num_hidden_layers=3, **config)
    prompts = random_prompts((45, 9, 30, 17, 38, 4, 26, 12), seed=6)
    new = [6 + (5 * i) % 9 for i in range(len(prompts))]
    references = [greedy_reference(model, p, n) for p, n in zip(prompts, new)]
    engine = hf_paged.Engine(model, block_size=8, max_num_seqs=3, max_num_batched_tokens=24, compile_decode=True)
    runner = engine.runner
    runner.ragged_graphs = True  # the recorded path, without the recording (no CUDA here)
    runner._ragged_tile = tile
    runner.ragged_graph_tokens = 64
    engine.warm_up(freeze_gc=False)
    graphs = counters["stats"]["unique_graphs"]
    filled = []
    fill = runner._fill_ragged

    def checked_fill(view, scheduled, rows, bucket):
        samplers = fill(view, scheduled, rows, bucket)
        filled.append(_check_buffers(runner, view, scheduled, rows, bucket, samplers))
        return samplers

    runner._fill_ragged = checked_fill
    results = engine.generate(prompts, [hf_paged.SamplingParams(max_new_tokens=n) for n in new])
    assert [r.outputs[0].token_ids for r in results] == references
    assert runner.ragged_graph_steps == len(filled) >= len(prompts) - 3
    assert any(pieces > len(step) for step, pieces in filled)  # some sequence was cut into pieces
    assert counters["stats"]["unique_graphs"] == graphs  # the compiled layers served every bucket
    engine.close()


def _check_buffers(runner, view, scheduled, rows, bucket, samplers):
    """The host buffers of one step against its scheduled items; returns (items, virtual sequences used)."""
    assert view["cu"].dtype == view["lens"].dtype == view["slots"].dtype == np.int32  # the eager steps' dtypes
    nv, kept = runner._ragged_sizes(bucket)
    tile = runner._ragged_tile
    tokens = sum(item.num_tokens for item in scheduled)
    assert tokens <= bucket and kept >= len(samplers)
    assert (view["slots"][tokens:bucket] == -1).all()
    cu, lens, vrows = view["cu"][: nv + 1], view["lens"][:nv], view["vrows"][:nv]
    assert (np.diff(cu) >= 0).all() and cu[0] == 0 and cu[nv] == tokens
    at, v = 0, 0
    for item, row in zip(scheduled, rows):
        assert list(view["ids"][at : at + item.num_tokens]) == list(item.seq.token_ids[item.start : item.start
                                                                                      + item.num_tokens])
        assert list(view["slots"][at : at + item.num_tokens]) == list(item.slots)
        done = 0
        while done < item.num_tokens:
            size = cu[v + 1] - cu[v]
            assert cu[v] == at + done and 0 < size <= tile and vrows[v] == row
            assert lens[v] == item.start + done + size  # keys up to the piece's last query
            done += size
            v += 1
        at += item.num_tokens
    assert (np.diff(cu[v:]) == 0).all() and (lens[v:] == 0).all()  # the unused ones have no queries
    return scheduled, v


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize("family, config", [("llama", {}), ("mistral", {"sliding_window": 24})])
def test_recorded_ragged_steps_give_transformers_tokens_on_cuda(family, config):
    """Every bucket recorded at its first step (float32): prompts prefilled beside running decodes, in chunks, under
    preemption (llama) and with prefix hits, replayed from CUDA graphs, give the tokens of transformers, as the eager
    ragged steps do; the graphs share one logits buffer."""
    model = tiny_model(family, dtype=torch.float32, **config).cuda()
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 300, (40,), generator=gen).tolist()
    prompts = [(shared if i % 4 == 0 else []) + torch.randint(3, 300, (int(n),), generator=gen).tolist()
               for i, n in enumerate(torch.randint(3, 90, (24,), generator=gen))]
    refs = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=20, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    hf_paged.enable(model)
    results = []
    for ragged in (False, True):
        engine = _compiled_engine(model, ragged, num_blocks=24, max_num_seqs=8, max_num_batched_tokens=96)
        outs = engine.generate(prompts, max_new_tokens=20)
        results.append([o.outputs[0].token_ids for o in outs])
        runner = engine.runner
        recorded = [key for key in runner._graphs if isinstance(key, tuple)]
        assert (runner.ragged_graph_steps >= len(recorded) > 0) == ragged, (runner.ragged_graph_steps, recorded)
        assert set(runner.ragged_capture_seconds) == {key[1] for key in recorded}
        assert runner.ragged_graph_failure is None
        if ragged:  # each bucket ran once uncaptured, recorded right after (the largest first, on dummy rows,
            # before the first of them); every later step of a bucket replayed
            dummies = runner.ragged_dummy_recorded
            assert dummies <= {96} and 96 in runner.ragged_capture_seconds  # the budget's bucket
            assert runner.ragged_graph_steps - runner.ragged_graph_replays == len(recorded) - len(dummies)
        if not config:  # the sliding window frees blocks as prompts pass it: no preemption there
            assert sum(engine.scheduler.num_preemptions.values()) > 0
        assert engine.prefix_cache_stats().hit_tokens > 0 and engine.kv_stats().used_blocks == 0
        assert len(runner._ragged_out) <= 1
        engine.close()
    assert results[0] == refs and results[1] == refs


@pytest.mark.gpu
@_CUDA
def test_a_bucket_is_recorded_right_after_its_second_step_and_replayed_from_its_third():
    """The default engine: a bucket's first two steps run uncaptured (the second one also warms up its recording,
    made right after it), every later one is replayed; the tokens are transformers' (float32)."""
    model = tiny_model("llama", dtype=torch.float32).cuda()
    prompts = random_prompts((37, 5, 60, 22, 11, 48, 30), seed=4)
    refs = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=9, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    hf_paged.enable(model)
    engine = hf_paged.Engine(model, block_size=16, compile_decode=True, max_num_seqs=3, enable_prefix_caching=False)
    engine.warm_up(freeze_gc=False)
    runner = engine.runner
    buckets = []
    execute = runner._execute_ragged

    def noted(sched, bucket):
        buckets.append(bucket)
        return execute(sched, bucket)

    runner._execute_ragged = noted
    for _ in range(3):
        outs = engine.generate(prompts, max_new_tokens=9)
        assert [o.outputs[0].token_ids for o in outs] == refs
    counts = {bucket: buckets.count(bucket) for bucket in buckets}
    assert runner.ragged_graph_steps == len(buckets) and runner.ragged_graph_failure is None
    assert runner.ragged_graph_replays == sum(max(0, n - 2) for n in counts.values())
    # the largest bucket (the ragged buffers' 4,096 tokens) is recorded first, on dummy rows, before the first
    # recording a step earns: later recordings carve their memory out of its blocks
    assert runner.ragged_dummy_recorded == {4096} and 4096 not in counts
    assert set(runner.ragged_capture_seconds) == {bucket for bucket, n in counts.items() if n >= 2} | {4096}
    assert next(iter(runner.ragged_capture_seconds)) == 4096
    assert len(runner.ragged_capture_seconds) > 2
    engine.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _CUDA])])
@pytest.mark.slow
def test_ragged_steps_keep_seeded_sampling_beams_and_parallel_samples(device):
    """Seeded sampled requests (top-p, parallel samples) and beam searches admitted beside running decodes: ragged
    steps on the static buffers (replayed from graphs on CUDA, every bucket recorded at once) give every token the
    eager ragged steps give (float32), and sampled rows read the shared logits buffer only for the step that wrote
    it."""
    model = tiny_model("qwen3", dtype=torch.float32).to(device)
    hf_paged.enable(model)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 300, (int(n),), generator=gen).tolist() for n in torch.randint(3, 70, (18,),
                                                                                             generator=gen)]
    params = []
    for i in range(len(prompts)):
        if i % 3 == 0:
            params.append(hf_paged.SamplingParams(max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.9,
                                                  seed=100 + i, num_return_sequences=2))
        elif i % 3 == 1:
            params.append(hf_paged.SamplingParams(max_new_tokens=12, num_beams=3))
        else:
            params.append(hf_paged.SamplingParams(max_new_tokens=20))
    results = []
    for ragged in (False, True):
        engine = _compiled_engine(model, ragged, num_blocks=64, max_num_seqs=10, max_num_batched_tokens=80)
        outs = engine.generate(prompts, params)
        results.append([[o.token_ids for o in r.outputs] for r in outs])
        assert (engine.runner.ragged_graph_steps > 0) == ragged and engine.runner.ragged_graph_failure is None
        assert engine.kv_stats().used_blocks == 0
        engine.close()
    assert results[0] == results[1]


@pytest.mark.gpu
@_CUDA
def test_an_engine_records_its_graphs_while_another_serves_in_another_thread():
    """Graphs are recorded while serving: ragged buckets at their first repeat, decode buckets at warm-up (and after a
    weight change). One compiled engine serves rounds of new prompts in a thread while a second one is built and warmed
    up in another, then serves too, both recording new ragged buckets while the other allocates, uploads and syncs. No
    request fails, neither engine gives up its graphs, and each gives the tokens an engine gives alone (float32)."""
    import threading

    model = tiny_model("llama", dtype=torch.float32).cuda()
    hf_paged.enable(model)
    gen = torch.Generator().manual_seed(9)
    rounds = [[torch.randint(3, 300, (int(n),), generator=gen).tolist() for n in torch.randint(3, 120, (12,),
                                                                                              generator=gen)]
              for _ in range(4)]  # new prompts each round: new buckets keep coming
    kwargs = {"num_blocks": 128, "max_num_seqs": 6, "max_num_batched_tokens": 256}
    alone = _compiled_engine(model, True, **kwargs)
    expected = [[o.outputs[0].token_ids for o in alone.generate(prompts, max_new_tokens=8)] for prompts in rounds]
    alone.close()
    engines: list = [_compiled_engine(model, True, **kwargs), None]
    warmed = threading.Event()
    results: list = [[], []]

    def run_round(i: int, k: int) -> None:
        outs = engines[i].generate(rounds[k], max_new_tokens=8)
        results[i].append((k, [repr(o.error) if o.error is not None else o.outputs[0].token_ids for o in outs]))

    def first() -> None:  # serves while the second engine records its decode graphs, then beside its serving
        k = 0
        while not warmed.is_set() or k < 4:
            run_round(0, k % 4)
            k += 1

    def second() -> None:
        try:
            engines[1] = _compiled_engine(model, True, **kwargs)
        finally:
            warmed.set()
        for k in (3, 2, 1, 0):
            run_round(1, k)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(results[1]) == 4 and len(results[0]) >= 4
    assert [tokens for _, tokens in results[0] + results[1]] == [expected[k] for k, _ in results[0] + results[1]]
    for engine in engines:
        runner = engine.runner
        assert runner.decode_mode == "graph" and runner.ragged_graph_failure is None
        assert runner.ragged_graph_replays > 0 and len(runner.ragged_capture_seconds) > 3
        engine.close()


@pytest.mark.gpu
@_CUDA
def test_a_warm_up_with_prefill_graphs_records_every_bucket_so_that_serving_only_replays():
    """`warm_up(prefill_graphs=True)` records every bucket up to the token budget before the first request, on rows
    that write and read nothing; serving then replays every ragged step and records none, with transformers' tokens
    (float32), prefix hits included."""
    model = tiny_model("llama", dtype=torch.float32).cuda()
    prompts = random_prompts((37, 5, 60, 22, 11, 48, 30, 90), seed=9)
    prompts += [prompts[2] + prompts[4]]  # a prefix hit on the second pass and within the first
    refs = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=9, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    hf_paged.enable(model)
    engine = hf_paged.Engine(model, block_size=16, compile_decode=True, max_num_seqs=4, max_num_batched_tokens=128)
    engine.warm_up(freeze_gc=False, prefill_graphs=True)
    runner = engine.runner
    buckets = {graph_tokens(n, 128) for n in range(2, 129)}
    assert set(runner.ragged_capture_seconds) == buckets == {key[1] for key in runner._graphs if isinstance(key, tuple)}
    assert engine.warm_up_seconds["prefill_buckets"] == len(buckets) and runner.ragged_graph_failure is None
    assert list(runner.ragged_capture_seconds) == sorted(buckets, reverse=True)  # the largest first
    assert runner.ragged_dummy_recorded == buckets
    recorded = dict(runner.ragged_capture_seconds)
    for _ in range(2):
        outs = engine.generate(prompts, max_new_tokens=9)
        assert [o.outputs[0].token_ids for o in outs] == refs
    assert runner.ragged_graph_steps == runner.ragged_graph_replays > 2
    assert runner.ragged_capture_seconds == recorded and runner.record_ragged_buckets() == 0
    assert engine.prefix_cache_stats().hit_tokens > 0
    engine.close()


@pytest.mark.slow
def test_prefill_graphs_need_cuda_graphs_and_a_bool():
    """Without CUDA graphs (the CPU) there is nothing to record: the warm-up says so (0 buckets); a non-bool is a
    TypeError naming the argument."""
    engine = hf_paged.Engine(tiny_model("llama", num_hidden_layers=2), block_size=16, compile_decode=True)
    engine.runner.ragged_graphs = True  # the recorded path's buffers exist on the CPU, its graphs do not
    engine.warm_up(freeze_gc=False, prefill_graphs=True)
    assert engine.warm_up_seconds["prefill_buckets"] == 0 and engine.runner.record_ragged_buckets() == 0
    with pytest.raises(TypeError, match="prefill_graphs"):
        engine.warm_up(freeze_gc=False, prefill_graphs="yes")
    engine.close()


@pytest.mark.slow
def test_a_bucket_run_on_dummy_rows_writes_nothing_and_is_handed_to_the_recording():
    """`_record_dummy` (the warm-up's recording of a bucket, and the largest bucket's before the first one recorded
    while serving): its forward over the ragged buffers leaves every cached K/V as it was, hands the recording logits
    of the bucket's kept rows, and the engine's later steps give transformers' tokens (CPU, the recording stood in
    for)."""
    model = tiny_model("llama", seed=3, num_hidden_layers=2)
    prompts = random_prompts((45, 9, 30, 17, 38, 4), seed=2)
    refs = [greedy_reference(model, p, 7) for p in prompts]
    engine = hf_paged.Engine(model, block_size=8, max_num_seqs=3, max_num_batched_tokens=64, compile_decode=True)
    runner = engine.runner
    runner.ragged_graphs = True
    runner.ragged_graph_tokens = 64
    engine.warm_up(freeze_gc=False)
    held = engine.generate(prompts[:3], max_new_tokens=7)  # cached K/V (prefix caching keeps the blocks)
    assert [o.outputs[0].token_ids for o in held] == refs[:3]
    caches = [t.clone() for i in range(2) for t in engine.cache.layer_caches(i)]
    handed = []
    runner._capture_ragged = lambda bucket, logits: handed.append((bucket, tuple(logits.shape)))
    assert runner._record_dummy(64) is False  # nothing recorded (no CUDA): reported as such
    assert handed == [(64, (runner._ragged_sizes(64)[1], model.config.vocab_size))]
    view, (nv, _) = runner._host_sets[0]["ragged_views"], runner._ragged_sizes(64)
    assert (view["slots"][:64] == -1).all() and not view["cu"][: nv + 1].any() and not view["lens"][:nv].any()
    assert all(torch.equal(a, b) for a, b in zip(caches, [t for i in range(2) for t in engine.cache.layer_caches(i)]))
    outs = engine.generate(prompts, max_new_tokens=7)
    assert [o.outputs[0].token_ids for o in outs] == refs
    engine.close()


def _pool_bytes(runner) -> int:
    """Bytes the allocator holds in the runner's graph pool."""
    pool = tuple(runner._pool)
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", ())) == pool)


@pytest.mark.gpu
@_CUDA
def test_every_bucket_recorded_takes_about_the_memory_of_the_largest_one():
    """The recordings share the pool's memory: with the largest bucket recorded, the 47 others add at most a quarter
    of what it took (each recording on a stream of its own took memory of its own: about their sum)."""
    model = tiny_model("llama", dtype=torch.float32, hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                       vocab_size=512).cuda()
    hf_paged.enable(model)
    engine = hf_paged.Engine(model, block_size=16, compile_decode=True, max_num_seqs=8, num_blocks=256,
                             max_num_batched_tokens=4096)
    engine.warm_up(freeze_gc=False)
    runner = engine.runner
    before = _pool_bytes(runner)
    assert runner._record_dummy(4096)
    largest = _pool_bytes(runner) - before
    assert runner.record_ragged_buckets() == 47
    assert _pool_bytes(runner) - before <= 1.25 * largest, (largest, _pool_bytes(runner) - before)
    prompts = random_prompts((300, 40, 450), seed=1)
    refs = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=4, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, max_new_tokens=4)] == refs
    assert runner.ragged_graph_replays == runner.ragged_graph_steps > 0
    engine.close()
