"""Mixed sliding / full stacks release their local layers' blocks through layer groups (issue 54, item 2).

Tiny seeded float32 models of the mixed families (Gemma 3 with 2 global and 5 local layers, so groups of two layers
and a padded last group; Gemma 2, gpt-oss, Cohere 2, Qwen2 with `max_window_layers`), a window of 8 tokens and
blocks of 4, generations three windows long: the engine's tokens equal transformers' greedy `generate()`
(DynamicCache) under preemption by recompute and by swap, beam search and parallel sampling equal the engine without
groups, prefix-cache hits stay exact, and a grouped sequence holds fewer bytes of KV than an ungrouped one.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_paged.engine.engine as engine_module
from hf_paged.cache import GroupedPagedCache, PagedCache
from hf_paged.core import NULL_BLOCK
from hf_paged.engine import Engine, SamplingParams
from hf_paged.model_zoo import tiny_model

# the file on one worker: its module-scoped models and references are built once per family, not once per worker
# (under xdist's load distribution each worker built them again: 20 fixture set-ups instead of 10)
pytestmark = pytest.mark.xdist_group("window_groups")

WINDOW = 8
BLOCK = 4
NEW = 24
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36]]
GREEDY = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW)
GEMMA3_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                "sliding_attention", "full_attention", "sliding_attention"]
FAMILIES = {
    "gemma3_text": dict(num_hidden_layers=7, layer_types=GEMMA3_TYPES),
    "gemma2": {},
    "gpt_oss": {},
    "cohere2": {},
    "qwen2": dict(use_sliding_window=True, max_window_layers=1, num_hidden_layers=3,
                  layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """(name, model, transformers' greedy tokens of every prompt)."""
    model = tiny_model(request.param, sliding_window=WINDOW, **FAMILIES[request.param])
    reference = []
    for prompt in PROMPTS:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        reference.append(ids[0, len(prompt):].tolist())
    return request.param, model, reference


@pytest.fixture(scope="module")
def eos_free_reference(family):
    """transformers' greedy tokens with no eos at all (what `ignore_eos` requests, which pipeline, get)."""
    _, model, _ = family
    return [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None
                           )[0, len(p):].tolist() for p in PROMPTS]


def _engine(model, **kwargs) -> Engine:
    return Engine(model, **{"num_blocks": 64, "block_size": BLOCK, **kwargs})


def _tokens(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in out.outputs] for out in outputs]


def _assert_no_leaks(engine: Engine) -> None:
    stats = engine.kv_stats()
    assert stats.used_blocks == 0 and stats.cpu_used_blocks == 0 and engine.block_manager.seq_ids() == [], stats


def _peak_bytes(engine: Engine) -> dict:
    """Record the most KV bytes one sequence holds right after each schedule (its appends done)."""
    peak = {"bytes": 0}
    schedule = engine.scheduler.schedule
    bm, per_block = engine.block_manager, engine.cache.bytes_per_block()

    def watched():
        out = schedule()
        for seq_id in bm.seq_ids():
            if not bm.is_swapped(seq_id):
                tables = bm.group_tables(seq_id) if hasattr(bm, "group_tables") else [bm.table_view(seq_id)]
                held = sum(block != NULL_BLOCK for table in tables for block in table)
                peak["bytes"] = max(peak["bytes"], held * per_block)
        return out

    engine.scheduler.schedule = watched
    return peak


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_equals_transformers_and_holds_less(family, caching):
    name, model, reference = family
    engine = _engine(model, enable_prefix_caching=caching)
    assert isinstance(engine.cache, GroupedPagedCache)
    peak = _peak_bytes(engine)
    assert [o[0] for o in _tokens(engine.generate(PROMPTS, GREEDY))] == reference
    assert engine.kv_stats().window_released > 0
    _assert_no_leaks(engine)

    off = _engine(model, enable_prefix_caching=caching, release_window_blocks=False)
    assert type(off.cache) is PagedCache
    peak_off = _peak_bytes(off)
    assert [o[0] for o in _tokens(off.generate(PROMPTS, GREEDY))] == reference
    assert peak["bytes"] < peak_off["bytes"], (name, peak, peak_off)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_small_pool_preempts_and_the_tokens_stay_exact(family, mode):
    name, model, reference = family
    engine = _engine(model, num_blocks=_small_pool(model), preemption_mode=mode, swap_space=0.01 if mode == "swap" else 0.0)
    assert [o[0] for o in _tokens(engine.generate(PROMPTS, GREEDY))] == reference
    assert engine.scheduler.num_preemptions[mode] > 0
    _assert_no_leaks(engine)


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=NEW, num_beams=3, num_return_sequences=2),
    SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, num_return_sequences=3, do_sample=True, seed=7),
], ids=["beam", "parallel-sampling"])
def test_forks_equal_the_engine_without_groups(family, params):
    _, model, _ = family
    results = []
    for release in (True, False):
        engine = _engine(model, release_window_blocks=release, num_blocks=160)
        results.append(_tokens(engine.generate(PROMPTS, params)))
        if release:
            assert engine.kv_stats().window_released > 0
        _assert_no_leaks(engine)
    assert results[0] == results[1]


def test_prefix_cache_hits_are_exact(family):
    _, model, reference = family
    engine = _engine(model, num_blocks=160)
    first = _tokens(engine.generate(PROMPTS, GREEDY))
    again = _tokens(engine.generate(PROMPTS, GREEDY))  # the prompts' blocks are cached in every group
    assert [o[0] for o in first] == [o[0] for o in again] == reference
    stats = engine.prefix_cache_stats()
    assert stats.hit_tokens > 0 and stats.queries == 2 * len(PROMPTS)
    _assert_no_leaks(engine)


def _small_pool(model) -> int:
    """A `num_blocks` whose grouped pool holds one of the prompts' whole length, not three at once."""
    plan = _engine(model).cache.layer_groups
    grouped = plan.num_groups * -(-(max(map(len, PROMPTS)) + NEW) // BLOCK) + 2
    return -(-grouped * plan.group_size // len(plan.group_of))  # `num_blocks` counts one-table blocks


@pytest.mark.parametrize("mode", [None, "recompute", "swap"], ids=["roomy", "recompute", "swap"])
def test_static_decode_path_and_pipelining(family, eos_free_reference, mode):
    """The CUDA-graph path's buffers (run eagerly on the CPU) with a table store per layer group
    (`hf_paged.runner.group_static`), pipelined (`generate()` of plain requests): the same tokens."""
    _, model, _ = family
    reference = eos_free_reference
    pool = {} if mode is None else {"num_blocks": _small_pool(model), "preemption_mode": mode,
                                     "swap_space": 0.01 if mode == "swap" else 0.0}
    engine = _engine(model, **pool)
    engine.runner.decode_mode = "static"
    bm = engine.block_manager
    taken, appended = [], bm.append_decode_slots

    def append(*args, **kwargs):  # the other groups' slots of a batched decode append, as the runner will take them
        result = appended(*args, **kwargs)
        taken.append(bm.decode_group_slots is not None)
        return result

    bm.append_decode_slots = append
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o[0] for o in _tokens(outs)] == reference
    assert any(taken) and bm.decode_group_slots is None  # each one taken by its step's upload
    assert engine.runner.graph_steps > 0 and engine.pipelined_steps > 0
    assert engine.kv_stats().window_released > 0
    if mode is not None:
        assert engine.scheduler.num_preemptions[mode] > 0
    _assert_no_leaks(engine)


def test_windows_that_contradict_the_plan_release_nothing():
    """The plan comes from the config; the windows the attention calls pass are checked before any release."""
    model = tiny_model("gemma2", sliding_window=WINDOW)
    engine = _engine(model)
    groups = engine.cache.layer_groups
    engine.cache.layer_groups = dataclasses.replace(groups, windows=tuple(w and w // 2 for w in groups.windows))
    with pytest.warns(RuntimeWarning, match="no KV block is released"):
        outs = engine.generate(PROMPTS[:1], GREEDY)
    ids = model.generate(torch.tensor(PROMPTS[:1]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    assert _tokens(outs)[0][0] == ids[0, len(PROMPTS[0]):].tolist()
    assert engine.kv_stats().window_released == 0 and not engine.block_manager.releasing


def test_drop_in_use_is_refused():
    model = tiny_model("gemma2", sliding_window=WINDOW)
    engine = _engine(model)
    with pytest.raises(RuntimeError, match="engine only"):
        engine.cache._begin_forward(1, 1, torch.device("cpu"))


@pytest.mark.parametrize("caching", [True, False])
def test_a_pool_smaller_than_every_groups_whole_table_serves_a_long_request(caching):
    """A pool that holds the long request's full group whole but its local groups only over their window and a
    chunk (`GroupedBlockManager.blocks_to_hold`): admitted, prefilled in chunks, exact."""
    model = tiny_model("gemma3_text", sliding_window=WINDOW, **FAMILIES["gemma3_text"])
    prompt = list(range(3, 43))  # 40 tokens: five windows
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    reference = ids[0, len(prompt):].tolist()
    plan = _engine(model).cache.layer_groups
    chunk = 8
    probe = _engine(model, max_num_batched_tokens=chunk).block_manager
    hold = probe.blocks_to_hold(len(prompt) + NEW, chunk)
    assert hold < plan.num_groups * probe.inner.blocks_for(len(prompt) + NEW)
    engine = _engine(model, num_blocks=-(-hold * plan.group_size // len(plan.group_of)), max_num_batched_tokens=chunk,
                     enable_prefix_caching=caching)
    assert engine.block_manager.num_blocks < plan.num_groups * probe.inner.blocks_for(len(prompt) + NEW)
    for _ in range(2):  # (so small a pool evicts the local groups' first blocks: the second run hits nothing)
        assert _tokens(engine.generate([prompt], GREEDY))[0][0] == reference
    _assert_no_leaks(engine)
    if caching:  # a pool that keeps the first run cached: the second maps the local groups' window only
        roomy = _engine(model, num_blocks=64, max_num_batched_tokens=chunk)
        for _ in range(2):
            assert _tokens(roomy.generate([prompt], GREEDY))[0][0] == reference
        assert roomy.prefix_cache_stats().hit_tokens >= len(prompt) - BLOCK
        _assert_no_leaks(roomy)


@pytest.mark.slow
def test_compiled_decode_step_reads_each_layers_group():
    """`compile_decode` (about ten seconds of Inductor on the CPU): the fused op takes its layer's group step; the
    compiled layers run the prefill steps too."""
    model = tiny_model("gemma3_text", sliding_window=WINDOW, **FAMILIES["gemma3_text"])
    reference = [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None
                                )[0, len(p):].tolist() for p in PROMPTS]
    engine = _engine(model, max_num_seqs=2, compile_decode=True)
    engine.runner.decode_mode = "static"
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o[0] for o in _tokens(outs)] == reference
    assert engine.runner.graph_steps > 0 and engine.runner.compiled_prefill_steps > 0
    assert engine.pipelined_steps > 0 and engine.kv_stats().window_released > 0
    engine.close()


@pytest.mark.slow
def test_ragged_steps_on_the_static_buffers_read_each_layers_group():
    """Prefill chunks beside decodes through the ragged buffers (what a CUDA graph of a prefill step replays; run
    without the recording on the CPU), with every group's slots and tables: transformers' tokens; a bucket run on
    dummy rows writes nothing in any group."""
    model = tiny_model("gemma3_text", sliding_window=WINDOW, **FAMILIES["gemma3_text"])
    prompts = [list(range(3, 48)), list(range(50, 59)), list(range(60, 90)), list(range(100, 117))]
    reference = [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None
                                )[0, len(p):].tolist() for p in prompts]
    engine = _engine(model, max_num_seqs=3, max_num_batched_tokens=24, compile_decode=True)
    runner = engine.runner
    runner.ragged_graphs = True
    runner._ragged_tile = 5
    runner.ragged_graph_tokens = 64
    engine.warm_up(freeze_gc=False)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o[0] for o in _tokens(outs)] == reference
    assert runner.ragged_graph_steps > 0 and engine.kv_stats().window_released > 0
    held = engine.generate(prompts[:2], SamplingParams(max_new_tokens=4))  # cached K/V in every group
    pool = [t.clone() for t in engine.cache.kv.tensors]
    runner._capture_ragged = lambda bucket, logits: None
    runner._record_dummy(64)
    assert all(torch.equal(a, b) for a, b in zip(pool, engine.cache.kv.tensors)) and held
    engine.close()


class _Built(Exception):
    pass


@pytest.mark.parametrize("kwargs, grouped", [
    ({}, True),
    ({"release_window_blocks": False}, False),
    ({"compile_decode": True}, True),
    ({"use_cuda_graph": True}, True),
])
def test_which_engines_group_their_layers(monkeypatch, kwargs, grouped):
    seen = {}

    def build(*args, **options):
        seen.update(options)
        raise _Built

    monkeypatch.setattr(engine_module, "build_engine_cache", build)
    with pytest.raises(_Built):
        Engine(tiny_model("gemma2", sliding_window=WINDOW), **kwargs)
    assert seen["group_layers"] is grouped


def test_group_slots_of_a_step_equal_each_tables_slots():
    """`fill_group_slots` (the grouped steps' slots of every other group, one index per prefill chunk and group)
    gives each token the slot its group's table holds (`group_slots`), for decode rows and chunks across blocks."""
    from types import SimpleNamespace

    import numpy as np

    from hf_paged.cache import fill_group_slots
    from hf_paged.core import GroupedBlockManager

    bm = GroupedBlockManager(200, 4, (None, 8, 16))
    items = []
    for seq_id, (done, new) in enumerate([(9, 1), (0, 13), (5, 7), (3, 1), (12, 4)]):
        bm.allocate(seq_id, done)
        bm.append_slots(seq_id, new)
        bm.release_out_of_window([SimpleNamespace(seq_id=seq_id, num_computed=done, token_ids=[])])
        items.append(SimpleNamespace(seq=SimpleNamespace(seq_id=seq_id), start=done, num_tokens=new))
    tables = [bm.group_tables(item.seq.seq_id) for item in items]
    out = np.full((2, 30), -7, dtype=np.int64)
    written = fill_group_slots(out, items, tables, 2)
    assert written == 26 and (out[:, 26:] == -7).all()
    for g in (1, 2):
        want = [s for item in items
                for s in bm.group_slots(item.seq.seq_id, g, item.start, item.start + item.num_tokens)]
        assert out[g - 1, :written].tolist() == want
