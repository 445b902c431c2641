"""Block groups for layers of several shapes and for KV-sharing layers: Gemma 4 (issue 54, item 2).

Gemma 4's local layers have ``head_dim`` heads, its global layers ``global_head_dim`` and their own KV heads
(`num_global_key_value_heads` with `attention_k_eq_v`), and its last `num_kv_shared_layers` layers read an earlier
layer's K/V. The grouped cache packs the layers by width into pages (`LayerGroups.layout`, `cache.kv_pages.KVPages`)
and hands each sharing layer its source's views, so it reads through the source's group tables.

A tiny seeded float32 `gemma4_text` of 9 layers (7 K/V layers: local ones 2 heads x 16, global ones 2 heads x 32,
so twice as wide; the last local and the last global layer read layers 5 and 6), a window of 8 tokens, blocks of 4
and prompts up to three windows long: the engine's tokens equal transformers' greedy and beam `generate()`
(DynamicCache) while the local groups release their blocks, under prefix hits and both preemption modes. The byte
figure at the end is a Gemma-4-31B-like text config's, computed from the config alone.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import Gemma4TextConfig

import hf_paged
from hf_paged import kernels
from hf_paged.cache import GroupedPagedCache, KVPool, KVShape, PagedCache, layer_kv_shapes, plan_for
from hf_paged.cache.kv_pages import KVPages
from hf_paged.core import NULL_BLOCK, GroupedBlockManager, plan_layer_groups
from hf_paged.model_zoo import tiny_config

try:
    from tests.helpers import assert_all_returned, dense_generate, engine_greedy, generating_model, random_prompts
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import assert_all_returned, dense_generate, engine_greedy, generating_model, random_prompts

pytestmark = pytest.mark.xdist_group("gemma4_groups")

S, F = "sliding_attention", "full_attention"
WINDOW, BLOCK, NEW = 8, 4, 20
CONFIG = dict(layer_types=[S, S, S, F, S, S, F, S, F], num_hidden_layers=9, num_kv_shared_layers=2,
              sliding_window=WINDOW, attention_k_eq_v=True, num_global_key_value_heads=2, global_head_dim=32,
              vocab_size_per_layer_input=256, hidden_size_per_layer_input=16)  # (small per-layer input embeddings)
LOCAL, GLOBAL = KVShape(2, 16, 16), KVShape(2, 32, 32)
LENGTHS = (23, 5, 17)


@functools.cache
def model():
    return generating_model("gemma4_text", **CONFIG)


@functools.cache
def references() -> tuple[list[list[int]], list[list[int]]]:
    prompts = random_prompts(LENGTHS, seed=7, vocab=200)
    refs = [dense_generate(model(), input_ids=torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                           eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    return prompts, refs


def _engine(**kwargs) -> hf_paged.Engine:
    return hf_paged.Engine(model(), **{"num_blocks": 96, "block_size": BLOCK, **kwargs})


def _held_bytes_peak(engine: hf_paged.Engine) -> dict:
    """Record the most KV bytes one sequence holds right after each schedule (its appends done)."""
    peak = {"bytes": 0}
    schedule, bm, per_block = engine.scheduler.schedule, engine.block_manager, engine.cache.bytes_per_block()

    def watched():
        out = schedule()
        for seq_id in bm.seq_ids():
            if not bm.is_swapped(seq_id):
                tables = bm.group_tables(seq_id) if hasattr(bm, "group_tables") else [bm.table_view(seq_id)]
                peak["bytes"] = max(peak["bytes"], per_block * sum(b != NULL_BLOCK for t in tables for b in t))
        return out

    engine.scheduler.schedule = watched
    return peak


# ------------------------------------------------------------------------------------------- the plan and the pages


def gemma4_31b_like() -> Gemma4TextConfig:
    """The published Gemma-4-31B text decoder's attention (60 layers, 5 local : 1 global, a window of 1024; local
    layers 16 KV heads x 256, global ones 4 x 512 with keys and values from one projection; no KV sharing), with
    small MLPs and vocabulary: only its K/V layout matters here and nothing is built."""
    return Gemma4TextConfig(num_hidden_layers=60, layer_types=([S] * 5 + [F]) * 10, sliding_window=1024,
                            num_attention_heads=32, num_key_value_heads=16, head_dim=256, global_head_dim=512,
                            num_global_key_value_heads=4, attention_k_eq_v=True, hidden_size=5376,
                            intermediate_size=64, vocab_size=256, vocab_size_per_layer_input=256,
                            hidden_size_per_layer_input=16)


def test_the_plan_packs_layers_of_two_widths_into_pages():
    config = gemma4_31b_like()
    shapes = layer_kv_shapes(config)
    assert set(shapes) == {KVShape(16, 256, 256), KVShape(4, 512, 512)}
    windows = [1024 if kind == S else None for kind in config.layer_types]
    widths = [shape.elements_per_token for shape in shapes]  # 8192 local, 4096 global
    plan = plan_layer_groups(windows, widths)
    assert plan.windows == (None,) + (1024,) * 10 and [len(m) for m in plan.members] == [10] + [5] * 10
    assert plan.members[0] == tuple(range(5, 60, 6)) and plan.group_size == 10
    offsets, page = plan.layout(widths)
    assert page == 10 * 4096 == 5 * 8192  # every group fills the page: nothing padded
    for members in plan.members:  # each group's layers side by side in the page, in order
        assert [offsets[i] for i in members] == [sum(widths[j] for j in members[:k]) for k in range(len(members))]
    # one width for every layer: the plan of layer counts (slot tensors), whatever the width
    gemma3 = [None if (i + 1) % 6 == 0 else 1024 for i in range(62)]
    assert plan_layer_groups(gemma3, [7] * 62).members == plan_layer_groups(gemma3).members
    assert plan_layer_groups(gemma3).layout([7] * 62)[1] == 7 * 10
    # a layer wider than the smallest kind: the page is that layer
    assert plan_layer_groups([None, 4, 4], [1, 3, 1]).members == ((0,), (1,), (2,))
    with pytest.raises(ValueError, match="widths"):
        plan_layer_groups([None, 4], [1, 0])
    with pytest.raises(ValueError, match="widths"):
        plan.layout(widths[:3])


def test_pages_hold_each_layer_apart_and_move_whole():
    """Layers of one page never overlap; copy-on-write, swapping and growth move every layer's part of a page."""
    shapes = [KVShape(2, 4, 4), KVShape(1, 8, 8), KVShape(1, 4, 4, values_are_keys=True)]
    pool = KVPages(shapes, (0, 16, 32), 36, num_blocks=5, block_size=2, device=torch.device("cpu"),
                   dtype=torch.float32, num_cpu_blocks=3)
    assert pool.uniform is None and pool.tensors[0].shape == (5, 1, 2, 36) and pool.nbytes == 5 * 2 * 36 * 4
    assert KVPool.bytes_per_block(shapes, 2, 4) == 2 * 36 * 4  # (these layers fill the page)
    views = [pool.layer_views(i) for i in range(3)]
    assert views[2][0] is views[2][1]
    for i, (keys, values) in enumerate(views):
        keys.copy_(torch.full_like(keys, 10 * i + 1))
        if values is not keys:
            values.copy_(torch.full_like(values, 10 * i + 2))
    for i, (keys, values) in enumerate(views):  # nothing of a layer was overwritten by another
        assert bool((keys == 10 * i + 1).all()) and (values is keys or bool((values == 10 * i + 2).all()))
        assert keys.shape == (5, shapes[i].kv_heads, 2, shapes[i].key_dim)
    assert bool((pool.tensors[0] != 0).all())  # and together they fill every page
    pool.tensors[0][3].normal_()
    before = pool.tensors[0][3].clone()
    pool.copy_blocks(torch.tensor([3]), torch.tensor([1]))
    assert torch.equal(pool.tensors[0][1], before)
    pool.swap_out(torch.tensor([1]), torch.tensor([2]))
    pool.tensors[0][1].zero_()
    pool.swap_in(torch.tensor([2]), torch.tensor([4]))
    assert torch.equal(pool.tensors[0][4], before)
    pool.grow(7)
    assert torch.equal(pool.tensors[0][4], before) and pool.layer_views(1)[0].shape[0] == 7
    with pytest.raises(ValueError, match="cannot hold"):
        KVPages(shapes, (0, 16, 33), 36, 1, 2, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="indexer"):
        KVPages([KVShape(1, 4, 4, index_dim=2)], (0,), 10, 1, 2, torch.device("cpu"), torch.float32)


@pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")
def test_triton_kernels_write_and_read_a_layers_place_in_the_pages(monkeypatch):
    """The Triton kernels (under the interpreter without CUDA) take a layer's page views by their strides: writes
    land at its offset only, decode and prefill read what the torch references read from contiguous copies, and
    copy-on-write copies whole pages."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes, block = [LOCAL, GLOBAL], 8
    pool = KVPages(shapes, (0, 64), 192, num_blocks=6, block_size=block, device=torch.device(device),
                   dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    table = torch.tensor([[4, 1, 3], [5, 2, 0]], dtype=torch.int32, device=device)
    lens = torch.tensor([19, 11], dtype=torch.int32, device=device)
    slots = torch.cat([table.cpu()[b, torch.arange(n) // block].long() * block + torch.arange(n) % block
                       for b, n in enumerate(lens.tolist())]).to(device)
    cu = torch.tensor([0, 19, 30], dtype=torch.int32, device=device)
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    for index, shape in enumerate(shapes):
        keys, values = pool.layer_views(index)
        new_k, new_v = (torch.randn(30, shape.kv_heads, shape.key_dim, generator=gen).to(device) for _ in range(2))
        other = pool.layer_views(1 - index)[0].clone()
        kernels.write_kv(new_k, new_v, keys, values, slots)
        assert torch.equal(pool.layer_views(1 - index)[0], other)  # the other layer's place is untouched
        dense_k, dense_v = keys.contiguous(), values.contiguous()
        query = torch.randn(30, 4, shape.key_dim, generator=gen).to(device)
        decode_q = query[cu[1:].long() - 1]
        got = [kernels.paged_decode(decode_q, keys, values, table, lens, 0.25, sliding_window=WINDOW),
               kernels.paged_prefill(query, keys, values, table, cu, lens, 0.25, 19)]
        monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
        expected = [kernels.paged_decode(decode_q, dense_k, dense_v, table, lens, 0.25, sliding_window=WINDOW),
                    kernels.paged_prefill(query, dense_k, dense_v, table, cu, lens, 0.25, 19)]
        monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    before = pool.tensors[0][4].clone()
    kernels.copy_blocks(pool.tensors[0], torch.tensor([4], device=device), torch.tensor([0], device=device))
    assert torch.equal(pool.tensors[0][0], before)


def test_the_engine_groups_gemma4_and_shares_views_with_the_source_layers():
    engine = _engine()
    cache = engine.cache
    assert isinstance(cache, GroupedPagedCache) and isinstance(cache.kv, KVPages)
    assert cache.kv_layers == list(range(7)) and cache._kv_sources == {7: 5, 8: 6}
    assert cache.kv_shapes == [LOCAL, LOCAL, LOCAL, GLOBAL, LOCAL, LOCAL, GLOBAL]
    plan = cache.layer_groups
    assert plan.windows == (None, WINDOW, WINDOW) and plan.members == ((3, 6), (0, 1, 2, 4), (5,))
    assert cache.page_layout() == ((0, 64, 128, 0, 192, 0, 128), 256)  # the last local group: 64 of 256 used
    one_table = PagedCache(config=model().config, num_blocks=1, block_size=BLOCK)
    assert cache.bytes_per_block(torch.float32) == 256 * BLOCK * 4
    assert one_table.bytes_per_block(torch.float32) == (5 * 64 + 2 * 128) * BLOCK * 4
    assert engine.block_manager.num_blocks == 96 * 576 // 256  # the same memory as 96 one-table blocks
    for layer, source in cache._kv_sources.items():  # a sharing layer reads its source's views, group and all
        keys, values = cache.layer_caches(layer)
        assert (keys, values) == cache.layer_caches(source)
        assert keys._hf_paged_group == plan.group_of[source] and values._hf_paged_layer == source
    with pytest.raises(ValueError, match="no K/V of its own"):
        cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 7)
    # a sharing layer of another window than its source's: one table
    probe = PagedCache(config=model().config, num_blocks=1, block_size=BLOCK)
    assert plan_for(model().config, probe) == plan
    probe._kv_sources = {7: 6, 8: 5}
    assert plan_for(model().config, probe) is None
    engine.close()


@pytest.mark.parametrize("family", ["gemma4", "gemma4_unified", "gemma4_unified_text"])
def test_the_multimodal_and_unified_configs_plan_as_the_text_model(family):
    config = tiny_config(family, **CONFIG) if family.endswith("_text") else tiny_config(family, text_config=CONFIG)
    probe = PagedCache(config=config, num_blocks=1, block_size=BLOCK)
    text = tiny_config("gemma4_text", **CONFIG)
    assert probe._kv_sources == {7: 5, 8: 6} and probe.kv_shapes == [LOCAL] * 3 + [GLOBAL] + [LOCAL] * 2 + [GLOBAL]
    assert plan_for(config, probe) == plan_for(text, PagedCache(config=text, num_blocks=1, block_size=BLOCK))


# ------------------------------------------------------------------------------------------------------- tokens


@pytest.mark.parametrize("path", ["eager", "static"])
def test_greedy_equals_transformers_while_local_groups_release(path):
    prompts, refs = references()
    engine = _engine(enable_prefix_caching=path == "static")
    if path == "static":  # the CUDA-graph path's buffers, a table store per group, pipelined
        engine.runner.decode_mode = "static"
    peak = _held_bytes_peak(engine)
    assert engine_greedy(engine, prompts, new=NEW) == refs
    assert engine.kv_stats().window_released > 0
    cache = engine.cache  # the sharing layers passed their sources' windows
    assert cache.sliding_window_bound() == (True, WINDOW) and cache.layer_windows[7] == WINDOW
    assert_all_returned(engine)
    if path == "eager":
        off = _engine(release_window_blocks=False)  # one table: a sequence holds more bytes
        assert type(off.cache) is PagedCache
        peak_off = _held_bytes_peak(off)
        assert engine_greedy(off, prompts, new=NEW) == refs
        assert peak["bytes"] < peak_off["bytes"], (peak, peak_off)
        off.close()
        cache.layer_windows[7] = None  # a layer whose window contradicts the plan turns the release off
        with pytest.warns(RuntimeWarning, match="no KV block is released"):
            assert cache.sliding_window_bound() == (True, None)
        assert not engine.block_manager.releasing
    engine.close()


def test_beam_search_equals_transformers():
    prompt = references()[0][0]
    m = model()
    ref = dense_generate(m, input_ids=torch.tensor([prompt]), max_new_tokens=NEW, num_beams=3,
                         num_return_sequences=2, do_sample=False, early_stopping=False, eos_token_id=None)
    engine = _engine()
    out = engine.generate([prompt], hf_paged.SamplingParams(max_new_tokens=NEW, num_beams=3, num_return_sequences=2,
                                                            ignore_eos=True))
    assert [prompt + list(c.token_ids) for c in out[0].outputs] == ref.tolist()
    assert engine.kv_stats().window_released > 0
    assert_all_returned(engine)
    engine.close()


def test_parallel_samples_equal_one_table_and_score_as_transformers():
    """Seeded samples (forked tables, copy-on-write of the shared partial block in every group) draw what the
    one-table engine draws, and each token's log-probability is the model's own (a full forward)."""
    prompts = references()[0][:2]
    params = hf_paged.SamplingParams(max_new_tokens=12, do_sample=True, num_return_sequences=3, seed=11,
                                     logprobs=1, ignore_eos=True, temperature=1.5)
    grouped = _engine(num_blocks=160)
    outputs = grouped.generate(prompts, params)
    assert grouped.kv_stats().window_released > 0
    assert_all_returned(grouped)
    one_table = _engine(num_blocks=160, release_window_blocks=False)
    tokens = [[c.token_ids for c in out.outputs] for out in one_table.generate(prompts, params)]
    assert [[c.token_ids for c in out.outputs] for out in outputs] == tokens
    for prompt, out in zip(prompts, outputs):
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1
        for completion in out.outputs:
            with torch.no_grad():
                logits = model()(input_ids=torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1:-1]
            expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion.token_ids)[:, None])
            torch.testing.assert_close(torch.tensor([lp for lp, _ in completion.logprobs]), expected[:, 0],
                                       atol=2e-4, rtol=1e-4)
    grouped.close()
    one_table.close()


def test_prefix_hits_are_exact():
    prompts, refs = (pair[::2] for pair in references())  # the two prompts longer than the window
    engine = _engine(num_blocks=160, enable_prefix_caching=True)
    assert engine_greedy(engine, prompts, new=NEW) == refs
    assert engine_greedy(engine, prompts, new=NEW) == refs  # the prompts' blocks are cached in every group
    assert engine.prefix_cache_stats().hit_tokens > 0
    assert_all_returned(engine)
    engine.close()


def _small_pool() -> int:
    """A `num_blocks` (one-table blocks) whose grouped pool holds the longest request whole, not all three."""
    engine = _engine()
    groups, grouped = engine.cache.layer_groups.num_groups, engine.cache.bytes_per_block()
    one_table = PagedCache(config=model().config, num_blocks=1, block_size=BLOCK).bytes_per_block(torch.float32)
    engine.close()
    blocks = groups * -(-(max(LENGTHS) + NEW) // BLOCK) + 2
    return -(-blocks * grouped // one_table)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_small_pool_preempts_and_the_tokens_stay_exact(mode):
    prompts, refs = references()
    engine = _engine(num_blocks=_small_pool(), preemption_mode=mode, swap_space=0.01 if mode == "swap" else 0.0)
    engine.runner.decode_mode = "static"
    assert engine_greedy(engine, prompts, new=NEW) == refs
    assert engine.scheduler.num_preemptions[mode] > 0 and engine.kv_stats().window_released > 0
    assert_all_returned(engine)
    engine.close()


@pytest.mark.slow
@pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU model through the interpreter, which runs without CUDA "
                                                      "only (test_gemma4_groups_on_cuda runs the kernels there)")
def test_the_engine_on_the_triton_kernels(monkeypatch):
    """The whole engine on the Triton kernels (the interpreter without CUDA; about 20 s): local layers through the
    standard kernels, global layers of 512 through the wide ones, each on its page views; transformers' tokens."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    assert kernels.get_backend(torch.device("cpu")) == "triton"
    m = generating_model("gemma4_text", **dict(CONFIG, global_head_dim=512))
    prompts = random_prompts((21, 9), seed=3, vocab=200)
    refs = [dense_generate(m, input_ids=torch.tensor([p]), max_new_tokens=6, do_sample=False,
                           eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    engine = hf_paged.Engine(m, num_blocks=40, block_size=8)
    engine.runner.decode_mode = "static"
    assert isinstance(engine.cache.kv, KVPages)
    assert engine_greedy(engine, prompts, new=6) == refs
    assert engine.kv_stats().window_released > 0
    assert_all_returned(engine)
    engine.close()


@pytest.mark.slow
def test_compiled_decode_step_reads_each_layers_group():
    """`compile_decode`: the fused op writes a layer's K/V at its offset of the page and reads through its group's
    tables; a sharing layer through its source's."""
    prompts, refs = references()
    torch._dynamo.reset()
    engine = _engine(max_num_seqs=2, compile_decode=True)
    engine.runner.decode_mode = "static"
    assert engine_greedy(engine, prompts, new=NEW) == refs
    assert engine.runner.graph_steps > 0 and engine.runner.compile_failure is None
    assert engine.kv_stats().window_released > 0
    assert_all_returned(engine)
    engine.close()
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------- a real shape's bytes


def gemma4_31b_bytes(context: int = 32768, block_size: int = 16, chunk: int = 2048) -> dict:
    """KV bytes one sequence of `context` tokens holds in bf16 on a Gemma-4-31B-like config, from the config alone
    (no weights, no pool): one table for every layer, and layer groups (at most, prefilled in chunks of `chunk`
    tokens, `GroupedBlockManager.blocks_to_hold`; and decoding, when a local group holds its window and a block)."""
    config = gemma4_31b_like()
    probe = PagedCache(config=config, num_blocks=1, block_size=block_size)
    plan = plan_for(config, probe)
    grouped = GroupedPagedCache(config=config, num_blocks=1, block_size=block_size, layer_groups=plan)
    manager = GroupedBlockManager(1, block_size, plan.windows)
    per_table = manager.inner.blocks_for(context)
    decoding = sum(per_table if w is None else manager.inner.blocks_for(w) + 1 for w in plan.windows)
    return {"one_table": per_table * probe.bytes_per_block(torch.bfloat16),
            "groups_prefill": manager.blocks_to_hold(context, chunk) * grouped.bytes_per_block(torch.bfloat16),
            "groups_decode": decoding * grouped.bytes_per_block(torch.bfloat16),
            "groups": plan.num_groups, "page_bytes": grouped.bytes_per_block(torch.bfloat16)}


def test_gemma4_31b_like_bytes_per_sequence_at_32k():
    got = gemma4_31b_bytes()
    per_token = 2 * (50 * 16 * 2 * 256 + 10 * 4 * 2 * 512)  # bf16, every layer's K and V
    assert got["one_table"] == 32768 * per_token  # 27.5 GiB
    assert got["groups"] == 11 and got["page_bytes"] == 16 * 2 * 10 * 4 * 2 * 512
    # the global layers whole (2048 blocks) and each local group its window and a chunk (193 blocks)
    assert got["groups_prefill"] == (2048 + 10 * 193) * got["page_bytes"]
    assert got["groups_decode"] == (2048 + 10 * 65) * got["page_bytes"]
    assert got["groups_prefill"] < got["one_table"] / 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("global_head_dim", [32, 512])  # 512: the wide kernels of Gemma 4's global layers
@pytest.mark.parametrize("compile_decode", [False, True])
def test_gemma4_groups_on_cuda(global_head_dim, compile_decode):
    """The Triton path with CUDA graphs (and the compiled step): pages, sharing layers, chunked prefill, prefix hits
    and a pool that makes the local groups release; transformers' greedy tokens in float32."""
    m = generating_model("gemma4_text", **dict(CONFIG, global_head_dim=global_head_dim)).cuda()
    prompts = random_prompts((60, 9, 41, 33, 17, 50), seed=3, vocab=200)
    prompts += [prompts[0][:40] + p for p in random_prompts((5, 12), seed=4, vocab=200)]
    refs = [dense_generate(m, input_ids=torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False,
                           eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    engine = hf_paged.Engine(m, num_blocks=40, block_size=16, max_num_batched_tokens=64, enable_prefix_caching=True,
                             compile_decode=compile_decode)
    assert isinstance(engine.cache.kv, KVPages) and engine.runner.use_cuda_graph and engine.runner.grouped
    assert engine_greedy(engine, prompts, new=24) == refs
    assert engine.runner.graph_steps > 0 and engine.runner.graph_failure is None
    assert engine.kv_stats().window_released > 0 and engine.prefix_cache_stats().hit_tokens > 0
    assert_all_returned(engine)
    engine.close()
