"""KV blocks that fell out of every layer's sliding window go back to the pool (issue 15, item 2, memory part).

Tiny seeded float32 models with a window of 8 tokens and blocks of 4, generations several windows long: the tokens
must equal transformers' `generate()` (DynamicCache) and the engine without releasing, while a sequence holds at most
`ceil(W / block_size) + 1` blocks (without releasing it holds its whole context). Beam search, parallel sampling,
prefix caching and both preemption modes run with released entries; nothing leaks.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_paged.cache import PagedCache
from hf_paged.core import NULL_BLOCK, BlockManager
from hf_paged.engine import Engine, SamplingParams
from hf_paged.testing import tiny_model

WINDOW = 8
BLOCK = 4
NEW = 24  # three windows
BOUND = math.ceil(WINDOW / BLOCK) + 1
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def model():
    return tiny_model("mistral", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens of transformers' own generate (DynamicCache), eos suppressed as in the engine runs."""
    out = []
    for prompt in PROMPTS:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        out.append(ids[0, len(prompt):].tolist())
    return out


def _engine(model, **kwargs) -> Engine:
    return Engine(model, **{"num_blocks": 64, "block_size": BLOCK, **kwargs})


def _watch_peak(engine: Engine) -> dict:
    """Record the most blocks any one table holds right after each schedule (its appends done, before the forward)."""
    peak = {"held": 0}
    schedule = engine.scheduler.schedule
    bm = engine.block_manager

    def watched():
        out = schedule()
        for seq_id in bm.seq_ids():
            if not bm.is_swapped(seq_id):
                table = bm.table_view(seq_id)
                peak["held"] = max(peak["held"], sum(block != NULL_BLOCK for block in table))
        return out

    engine.scheduler.schedule = watched
    return peak


def _tokens(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in out.outputs] for out in outputs]


def _assert_no_leaks(engine: Engine) -> None:
    stats = engine.kv_stats()
    assert stats.used_blocks == 0 and stats.cpu_used_blocks == 0, stats
    assert stats.released_blocks == 0 and engine.block_manager.seq_ids() == []


GREEDY = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW)


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_equals_transformers_and_memory_is_bounded(model, reference, caching):
    engine = _engine(model, enable_prefix_caching=caching)
    peak = _watch_peak(engine)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o[0] for o in _tokens(outs)] == reference
    assert engine.scheduler.release_window == WINDOW
    assert peak["held"] <= BOUND
    assert engine.kv_stats().window_released > 0
    _assert_no_leaks(engine)

    off = _engine(model, enable_prefix_caching=caching, release_window_blocks=False)
    peak_off = _watch_peak(off)
    assert [o[0] for o in _tokens(off.generate(PROMPTS, GREEDY))] == reference
    assert off.scheduler.release_window is None and off.kv_stats().window_released == 0
    assert peak_off["held"] == math.ceil((len(PROMPTS[2]) + NEW) / BLOCK)  # the whole context
    _assert_no_leaks(off)


def test_static_decode_path_reads_released_entries_as_valid_ids(model, reference):
    """The CUDA-graph path's buffers (run eagerly on the CPU): released entries are never uploaded as -1."""
    engine = _engine(model)
    engine.runner.decode_mode = "static"
    assert [o[0] for o in _tokens(engine.generate(PROMPTS, GREEDY))] == reference
    assert engine.runner.graph_steps > 0 and engine.kv_stats().window_released > 0
    store = engine.runner._buffers["store"]
    assert int(store.min()) >= 0
    _assert_no_leaks(engine)


def test_released_blocks_show_in_kv_stats_while_running(model):
    engine = _engine(model)
    engine.add_request(PROMPTS[0], params=SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW))
    for _ in range(NEW - 4):
        engine.step()
    stats = engine.kv_stats()
    table = engine.block_manager.table_view(engine.block_manager.seq_ids()[0])
    assert stats.released_blocks == sum(block == NULL_BLOCK for block in table) > 0
    assert stats.used_blocks <= BOUND
    while engine.has_unfinished():
        engine.step()
    _assert_no_leaks(engine)


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=NEW, num_beams=3, num_return_sequences=2),
    SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, num_return_sequences=3, do_sample=True, seed=7),
], ids=["beam", "parallel-sampling"])
def test_forks_equal_the_engine_without_releasing(model, params):
    results = []
    for release in (True, False):
        engine = _engine(model, release_window_blocks=release)
        peak = _watch_peak(engine)
        results.append(_tokens(engine.generate(PROMPTS, params)))
        if release:
            assert peak["held"] <= BOUND and engine.kv_stats().window_released > 0
        _assert_no_leaks(engine)
    assert results[0] == results[1]


def test_beam_search_equals_transformers(model):
    prompt = PROMPTS[2]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, num_beams=3, num_return_sequences=2,
                         do_sample=False, early_stopping=False)
    engine = _engine(model)
    out = engine.generate([prompt], SamplingParams(max_new_tokens=24, num_beams=3, num_return_sequences=2))
    assert engine.kv_stats().window_released > 0
    got = [prompt + list(c.token_ids) for c in out[0].outputs]
    expected = [[t for t in row.tolist() if t != model.config.pad_token_id] for row in ref]
    assert got == expected
    _assert_no_leaks(engine)


def test_prefix_caching_with_shared_prompts(model):
    """Prompts sharing a prefix longer than the window: the second wave hits blocks the first wave released."""
    shared = list(range(30, 50))
    prompts = [shared + [60, 61], shared + [70], shared + [80, 81, 82]]
    params = SamplingParams(max_new_tokens=12, min_new_tokens=12)
    plain = _engine(model, enable_prefix_caching=False, release_window_blocks=False)
    expected = _tokens(plain.generate(prompts, params))
    engine = _engine(model)
    assert _tokens(engine.generate(prompts[:1], params)) == expected[:1]
    assert engine.kv_stats().window_released > 0
    assert _tokens(engine.generate(prompts[1:], params)) == expected[1:]
    assert engine.prefix_cache_stats().hit_tokens >= 2 * 16  # both hit the first prompt's (released) blocks
    _assert_no_leaks(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_a_tiny_pool(model, reference, mode):
    """Six sequences of up to 3 held blocks each on a pool of 9: preempted, recomputed or swapped, same tokens."""
    prompts = PROMPTS * 2
    kwargs = dict(num_blocks=9, preemption_mode=mode)
    if mode == "swap":
        per_block = 2 * model.config.num_hidden_layers * 2 * BLOCK * 16 * 4  # layers x K,V x heads x slots x dim x 4
        kwargs["swap_space"] = 64 * per_block / 2**30
    engine = _engine(model, **kwargs)
    peak = _watch_peak(engine)
    outs = engine.generate(prompts, GREEDY)
    assert [o[0] for o in _tokens(outs)] == reference * 2
    assert engine.scheduler.num_preemptions[mode] > 0
    assert peak["held"] <= max(BOUND, math.ceil((len(PROMPTS[2]) + NEW) / BLOCK))  # a recompute re-prefills
    _assert_no_leaks(engine)


def test_mixed_stack_releases_only_through_layer_groups():
    """Qwen2 with a full-attention first layer (`max_window_layers=1`): the global layer reads every block, so one
    table keeps them all; with a table per layer group (the default) the local layer's group releases its own
    (`tests/test_window_groups.py`)."""
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    engine = _engine(model, release_window_blocks=False)
    engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=16))
    assert engine.cache.sliding_window_bound() == (True, None)
    assert engine.scheduler.release_window is None and engine.kv_stats().window_released == 0
    grouped = _engine(model)
    grouped.generate(PROMPTS[:1], SamplingParams(max_new_tokens=16))
    assert PagedCache.sliding_window_bound(grouped.cache) == (True, None)  # one table could release nothing
    assert grouped.scheduler.release_window == WINDOW and grouped.kv_stats().window_released > 0


def test_largest_window_of_the_layers_decides():
    """Different windows per layer: keys older than the largest window are read by no layer."""
    model = tiny_model("mistral", sliding_window=WINDOW)
    engine = _engine(model)
    engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4))
    engine.cache.layer_windows[0] = 3
    assert engine.cache.sliding_window_bound() == (True, WINDOW)
    engine.cache.layer_windows[1] = 20
    assert engine.cache.sliding_window_bound() == (True, 20)


# ---------------------------------------------------------------------------------------------- block manager


def _check_refs(bm: BlockManager) -> None:
    """Every GPU block's ref count equals the resident tables holding it; released entries hold nothing."""
    counts: dict[int, int] = {}
    for seq_id in bm.seq_ids():
        if not bm.is_swapped(seq_id):
            for block in bm.table_view(seq_id):
                if block != NULL_BLOCK:
                    counts[block] = counts.get(block, 0) + 1
    for block in range(bm.num_blocks):
        assert bm.gpu.ref_count(block) == counts.get(block, 0), block
    assert bm.usage()[1] == sum(counts.values())


def test_block_manager_release_fork_swap_truncate_free():
    bm = BlockManager(16, 4, num_cpu_blocks=16)
    bm.allocate("a", 14)  # 4 blocks, the last partial
    assert bm.release_before("a", 3) == 0  # block 0 ends at token 3: still needed
    assert bm.release_before("a", 9) == 2
    assert bm.block_table("a")[:2] == [NULL_BLOCK, NULL_BLOCK] and bm.gpu.num_free == 14
    assert bm.release_before("a", 100) == 1  # full blocks only: the partial last block is kept
    _check_refs(bm)
    bm.fork("a", "b")  # the child shares the held blocks and inherits the released prefix
    assert bm.stats().released_blocks == 6 and bm.gpu.num_shared == 1
    copy = bm.append_slots("b", 3)  # copy-on-write of the shared partial last block
    assert len(copy.copies) == 1
    _check_refs(bm)
    pairs = bm.swap_out(["a"])
    assert len(pairs) == 1 and bm.cpu.num_used == 1  # only the held block moves
    bm.swap_in(["a"])
    assert bm.block_table("a")[:3] == [NULL_BLOCK] * 3
    _check_refs(bm)
    with pytest.raises(ValueError, match="released"):
        bm.truncate("b", 11)  # into the released prefix: that K/V is gone
    bm.truncate("b", 12)  # down to it: the held blocks past it are dropped, the next append takes a fresh block
    assert bm.block_table("b") == [NULL_BLOCK] * 3
    assert bm.append_slots("b", 1).slots[0] // 4 not in (NULL_BLOCK, *bm.block_table("a"))
    _check_refs(bm)
    bm.free("a")
    bm.free("b")
    assert bm.gpu.num_used == 0 and bm.cpu.num_used == 0 and bm.usage() == (0, 0)


def test_block_manager_release_keeps_prefix_cache_entries():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    tokens = list(range(100, 113))
    bm.allocate_prefix("a", tokens)
    bm.append_slots("a", len(tokens))
    assert bm.release_before("a", 8) == 0  # nothing committed yet: a block never loses its key before it gets one
    bm.commit("a", tokens, len(tokens))
    assert bm.release_before("a", 8) == 2
    assert bm.gpu.num_evictable == 2  # released, cached, counted free
    match = bm.match_prefix(tokens)
    assert match.num_cached_tokens == 12 and NULL_BLOCK not in match.blocks
    bm.allocate_prefix("b", tokens, match)  # a new request maps the released blocks again
    _check_refs(bm)
    bm.free("a")
    bm.free("b")
    assert bm.gpu.num_used == 0
