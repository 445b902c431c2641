"""Learned sparse attention (DeepSeek Sparse Attention: `hf_paged.attention.adapters.dsa`) on the paged pool.

What must hold, on each family's tiny seeded model (float32, CPU) with a small `index_topk` (4), so prompts are longer
than the selection and it really drops keys:

* greedy tokens of the drop-in `PagedCache` on a left-padded batch, of the engine (a second run from the prefix
  cache, static decode, preemption by recompute and by swap) and of the sweep's `check_architecture` equal
  transformers' `DynamicCache` generate, and the sparse attention ran (`kernels.paged_sparse_attention`);
* the selection of an engine step (decode rows batched, prefill sequences one by one, against their own sequence
  only) equals the module's own indexer run on each sequence alone with transformers' cache;
* Qwen4-Exp's sparse attention (`adapters.qsa`: pooled token blocks) likewise, with a budget of 4 tokens;
* the torch reference of the sparse attention equals dense attention masked to the selected positions;
* the pool keeps the index keys beside the latent, counts their bytes, and refuses what it cannot store.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from transformers import DynamicCache, GenerationConfig

import hf_paged
from hf_paged import kernels
from hf_paged.attention import support
from hf_paged.attention.adapters import dsa
from hf_paged.cache import KVShape, PagedCache, kv_bytes_per_token, latent_kv_width
from hf_paged.cache.memory import indexer_key_dims
from hf_paged.cache.step import make_step
from hf_paged.kernels.reference import masked_attention
from hf_paged.model_zoo import check_architecture, tiny_inputs, tiny_model

try:
    from tests.helpers import dense_generate, greedy_reference, paged, random_prompts
    from tests.test_beam import compare_with_transformers
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import dense_generate, greedy_reference, paged, random_prompts
    from test_beam import compare_with_transformers

warnings.filterwarnings("ignore", module="transformers")
transformers.logging.set_verbosity_error()

FAMILIES = ["deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2"]
TOPK = 4
MAX_NEW = 8


def _model(family: str, seed: int = 0, **overrides):
    model = tiny_model(family, seed=seed, **{"index_topk": TOPK, **overrides})
    model.generation_config = GenerationConfig(pad_token_id=0, bos_token_id=1)  # no eos: every run is MAX_NEW long
    return model


class _SparseSpy:
    """Counts `kernels.paged_sparse_attention` calls and the widest selection it was given."""

    def __init__(self, monkeypatch):
        self.calls, self.width = 0, 0
        original = kernels.paged_sparse_attention

        def spy(query, key_cache, value_cache, block_tables, rows, positions, scale, **opts):
            self.calls += 1
            self.width = max(self.width, positions.shape[1])
            return original(query, key_cache, value_cache, block_tables, rows, positions, scale, **opts)

        monkeypatch.setattr(kernels, "paged_sparse_attention", spy)


# (family, overrides): each family, and GLM-5 / HY-V4 with a "shared" layer that reuses the previous layer's top-k
CASES = [(family, {}) for family in FAMILIES] + [
    (family, {"indexer_types": ["full", "shared"]}) for family in ("glm_moe_dsa", "hy_v4")]
IDS = [f + ("-shared" if overrides else "") for f, overrides in CASES]


@pytest.mark.parametrize("family,overrides", CASES, ids=IDS)
def test_sweep_passes_with_a_selection_smaller_than_the_context(family, overrides):
    record = check_architecture(family, timeout_s=120, index_topk=TOPK, **overrides)
    assert record["verdict"] == "pass", record["reason"]
    assert record["interface_routed"] and "attention_adapter" in record["features"]
    assert not {"sparse_attention", "latent_kv", "value_head_dim"} & set(record["features"]), record["features"]


# Qwen4-Exp's sparse attention (`adapters.qsa`): blocks of 2 tokens, 2 blocks kept (+ the unfinished one), so a
# query past 5 tokens drops keys
QSA_BUDGET = 4


@pytest.mark.parametrize("family", ["qwen4_exp_text", "qwen4_exp"])
def test_qwen_sparse_attention_passes_the_sweep(family):
    record = check_architecture(family, timeout_s=300, indexer_budget=QSA_BUDGET)
    assert record["verdict"] == "pass", record["reason"]
    assert "sparse_attention" not in record["features"] and "attention_adapter" in record["features"]


def _drop_in_generate(model, monkeypatch):
    """(the drop-in cache's greedy tokens, transformers' own, the sparse-attention spy, the cache) of a left-padded
    batch of 13, 5 and 9 tokens."""
    ids, mask = tiny_inputs((13, 5, 9), seed=2)
    options = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    want = dense_generate(model, **options)
    spy = _SparseSpy(monkeypatch)
    with paged(model), torch.no_grad():
        cache = PagedCache(config=model.config, num_blocks=32, block_size=4)
        got = model.generate(**options, past_key_values=cache)
    return got, want, spy, cache


def test_qwen_sparse_attention_drop_in_equals_transformers(monkeypatch):
    model = tiny_model("qwen4_exp_text", indexer_budget=QSA_BUDGET)
    model.generation_config = GenerationConfig(pad_token_id=0, bos_token_id=1)
    got, want, spy, cache = _drop_in_generate(model, monkeypatch)
    assert not hasattr(cache, "_bound_position_ids") or cache.position_ids.shape[-1] == 0  # no history kept
    assert torch.equal(got, want)
    assert spy.calls > 0 and spy.width == QSA_BUDGET + 1


@pytest.mark.slow
def test_qwen_sparse_attention_engine_equals_transformers():
    model = tiny_model("qwen4_exp_text", indexer_budget=QSA_BUDGET)
    model.generation_config = GenerationConfig(pad_token_id=0, bos_token_id=1)
    prompts = random_prompts((5, 13, 2, 9, 17), seed=4, vocab=model.config.vocab_size)
    want = [greedy_reference(model, p, MAX_NEW, eos_token_id=None) for p in prompts]
    engine = hf_paged.Engine(model, num_blocks=64, block_size=4, max_num_batched_tokens=12)  # (chunked prefill)
    results = engine.generate(prompts, max_new_tokens=MAX_NEW)
    assert [r.outputs[0].token_ids for r in results] == want


class _LatentCache(DynamicCache):
    holds_latent_kv = True  # (the run-time probe's kind: the adapter stores the latent in it)


@pytest.mark.parametrize("family", FAMILIES)
def test_latent_sparse_attention_equals_the_modules_own(family):
    """One layer: the adapter's latent path (absorbed query, the selection folded into the attention without a paged
    pool) against the module's own expanded sparse attention, same hidden states and positions; 9 tokens, top-4, so
    the first queries' selections hold masked picks (-1) and the later ones drop keys."""
    model = _model(family)
    module = model.model.layers[0].self_attn
    hidden = torch.randn(2, 9, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    rotary = model.model.rotary_emb(hidden, torch.arange(9)[None].expand(2, -1))
    causal = dsa.causal_index_mask(None, 2, 9, 9, torch.device("cpu"))[:, None]
    causal = torch.where(causal, 0.0, torch.finfo(torch.float32).min)  # additive: right for eager (HY-V4's) and SDPA
    hf_paged.enable(model)
    try:
        with torch.no_grad():
            got = module(hidden_states=hidden, position_embeddings=rotary, attention_mask=torch.ones(2, 9),
                         past_key_values=_LatentCache(config=model.config))[0]
    finally:
        hf_paged.disable(model)
    with torch.no_grad():  # transformers' own module (its implementation), a fresh cache for its indexer keys
        want = module(hidden_states=hidden, position_embeddings=rotary, attention_mask=causal,
                      past_key_values=DynamicCache(config=model.config))[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert want.abs().max() > 1e-3  # not vacuous


@pytest.mark.parametrize("family,overrides", CASES, ids=IDS)
def test_drop_in_cache_equals_transformers_on_a_left_padded_batch(family, overrides, monkeypatch):
    model = _model(family, **overrides)
    got, want, spy, cache = _drop_in_generate(model, monkeypatch)
    assert cache.head_dim == latent_kv_width(model.config) and cache.num_kv_heads == 1
    assert torch.equal(got, want)
    assert spy.calls > 0 and spy.width == TOPK  # the selection dropped keys (13 + 8 positions, 4 kept)


# (the engine runs take seconds each on the 2-core machine: DeepSeek-V3.2's in the quick suite, the others slow)
ENGINE_CASES = [pytest.param(f, o, id=i, marks=() if i == "deepseek_v32" else pytest.mark.slow)
                for (f, o), i in zip(CASES, IDS)]


@pytest.mark.parametrize("family,overrides", ENGINE_CASES)
def test_engine_greedy_equals_transformers(family, overrides, monkeypatch):
    model = _model(family, **overrides)
    prompts = random_prompts((5, 13, 2, 9, 17), seed=4, vocab=model.config.vocab_size)
    want = [greedy_reference(model, p, MAX_NEW, eos_token_id=None) for p in prompts]
    spy = _SparseSpy(monkeypatch)
    engine = hf_paged.Engine(model, num_blocks=64, block_size=4)
    results = engine.generate(prompts, max_new_tokens=MAX_NEW)
    assert [r.outputs[0].token_ids for r in results] == want
    assert spy.calls > 0 and spy.width == TOPK
    again = engine.generate(prompts, max_new_tokens=MAX_NEW)  # prompts' blocks (index keys too) from the cache
    assert [r.outputs[0].token_ids for r in again] == want
    assert engine.prefix_cache_stats().hit_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(decode="static"), dict(num_blocks=14, preemption_mode="recompute"),
                                     dict(num_blocks=14, preemption_mode="swap", swap_space=0.01),
                                     dict(max_num_batched_tokens=8)],
                         ids=["static_decode", "recompute", "swap", "chunked_prefill"])
def test_engine_paths_stay_exact_on_deepseek_v32(options):
    model = _model("deepseek_v32")
    prompts = random_prompts((11, 6, 14, 3, 9, 12), seed=5, vocab=model.config.vocab_size)
    want = [greedy_reference(model, p, MAX_NEW, eos_token_id=None) for p in prompts]
    options = dict(options)
    decode = options.pop("decode", None)
    engine = hf_paged.Engine(model, block_size=4, **{"num_blocks": 64, **options})
    if decode is not None:
        engine.runner.decode_mode = decode  # the CUDA-graph path's host logic (padded decode rows)
    results = engine.generate(prompts, max_new_tokens=MAX_NEW)
    assert [r.outputs[0].token_ids for r in results] == want
    if "preemption_mode" in options:
        assert engine.scheduler.num_preemptions[options["preemption_mode"]] > 0


@pytest.mark.slow
def test_beam_search_equals_transformers_on_glm_moe_dsa():
    """Beams fork and reorder block tables: the index keys (same blocks) follow, on the engine and the drop-in."""
    model = _model("glm_moe_dsa")
    ids, mask = tiny_inputs((11, 5, 8), seed=3)
    compare_with_transformers(model, dict(input_ids=ids, attention_mask=mask), dict(num_blocks=256, block_size=4),
                              num_beams=3, max_new_tokens=MAX_NEW, eos_token_id=None)
    options = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, num_beams=3,
                   eos_token_id=None)
    want = dense_generate(model, **options)
    with paged(model), torch.no_grad():
        got = model.generate(**options, past_key_values=PagedCache(config=model.config, num_blocks=64, block_size=4))
    assert torch.equal(got, want)


def test_engine_selection_equals_the_indexer_on_each_sequence_alone():
    """One engine-like ragged step (two decode rows and two prefills, one continuing a cached prefix) against the
    module's own indexer run on each whole sequence alone with transformers' DynamicCache (a dense reference)."""
    model = _model("deepseek_v32")
    module = model.model.layers[0].self_attn
    indexer = module.indexer
    config = model.config
    torch.manual_seed(0)
    # (cached tokens, new tokens) per sequence
    plan = [(9, 1), (0, 7), (5, 6), (12, 1)]
    block = 4
    cache = PagedCache(config=config, num_blocks=64, block_size=block, device="cpu", dtype=torch.float32)
    hidden = {s: torch.randn(1, c + n, config.hidden_size) for s, (c, n) in enumerate(plan)}
    resid = {s: torch.randn(1, c + n, config.q_lora_rank) for s, (c, n) in enumerate(plan)}
    rotary = {s: model.model.rotary_emb(hidden[s], torch.arange(c + n)[None]) for s, (c, n) in enumerate(plan)}
    tables = [list(range(s * 8, s * 8 + 8)) for s in range(len(plan))]

    def run(parts):  # one ragged step over (sequence, first position, count)
        slots = [tables[s][p // block] * block + p % block for s, first, count in parts
                 for p in range(first, first + count)]
        lens = [first + count for _, first, count in parts]
        step = make_step("ragged", slots, [tables[s] for s, _, _ in parts], lens, [c for _, _, c in parts],
                         torch.device("cpu"))
        cache.set_engine_step(step)
        latent = torch.zeros(1, 1, len(slots), latent_kv_width(config))
        cache.update(latent, latent, module.layer_idx)  # the layer's update() opens the step, as in a forward
        pick = lambda t: torch.cat([t[s][:, first:first + count] for s, first, count in parts], dim=1)  # noqa: E731
        cos = torch.cat([rotary[s][0][:, first:first + count] for s, first, count in parts], dim=1)
        sin = torch.cat([rotary[s][1][:, first:first + count] for s, first, count in parts], dim=1)
        with torch.no_grad():
            return dsa.select_positions(indexer, pick(hidden), pick(resid), (cos, sin), None, cache)[0]

    run([(s, 0, c) for s, (c, _) in enumerate(plan) if c])  # the cached prefixes
    got = run([(s, c, n) for s, (c, n) in enumerate(plan)])
    row = 0
    for s, (c, n) in enumerate(plan):
        total = c + n
        mask = dsa.causal_index_mask(None, 1, total, total, torch.device("cpu"))
        with torch.no_grad():
            want = indexer(hidden[s], resid[s], rotary[s], mask, None,
                           past_key_values=DynamicCache(config=config))[0, c:]  # [n, min(topk, total)]
        for i in range(n):
            visible = c + i + 1
            want_set = set(want[i].tolist()) if visible > TOPK else set(range(visible))
            got_set = {p for p in got[row + i].tolist() if p >= 0}
            assert got_set == want_set, (s, i, got_set, want_set)
        row += n


def test_sparse_attention_reference_equals_dense_masked_attention():
    torch.manual_seed(1)
    block, heads, kv_heads, dim, dim_v = 4, 4, 2, 8, 6
    key_cache = torch.randn(10, kv_heads, block, dim)
    value_cache = torch.randn(10, kv_heads, block, dim_v)
    tables = torch.tensor([[3, 1, 7], [0, 9, 2]], dtype=torch.int32)
    rows = torch.tensor([0, 0, 1], dtype=torch.int32)
    positions = torch.tensor([[0, 5, 9], [2, -1, -1], [-1, -1, -1]], dtype=torch.int32)
    query = torch.randn(3, heads, dim)
    sinks = torch.randn(heads)
    for opts in ({}, {"sinks": sinks}):
        got = kernels.paged_sparse_attention(query, key_cache, value_cache, tables, rows, positions, 0.3, **opts)
        for n in range(3):
            chosen = [p for p in positions[n].tolist() if p >= 0]
            if not chosen:
                assert torch.equal(got[n], torch.zeros_like(got[n]))
                continue
            table = tables[rows[n]]
            keys = torch.stack([key_cache[table[p // block], :, p % block] for p in chosen], dim=1)  # [Hkv, K, D]
            values = torch.stack([value_cache[table[p // block], :, p % block] for p in chosen], dim=1)
            keys = keys.repeat_interleave(heads // kv_heads, dim=0)
            values = values.repeat_interleave(heads // kv_heads, dim=0)
            mask = torch.ones(heads, 1, len(chosen), dtype=torch.bool)
            sink_col = opts["sinks"].reshape(heads, 1, 1) if opts else None
            want = masked_attention(query[n][:, None], keys, values, mask, 0.3, None, sink_col)[:, 0]
            torch.testing.assert_close(got[n], want)
    with pytest.raises(ValueError, match="positions"):
        kernels.paged_sparse_attention(query, key_cache, value_cache, tables, rows, positions[:2], 0.3)


def test_pool_keeps_index_keys_beside_the_latent_and_counts_them():
    model = _model("glm_moe_dsa")
    config = model.config
    width = latent_kv_width(config)
    dims = indexer_key_dims(config)
    types = list(getattr(config, "indexer_types", None) or ())
    assert dims and all(types[layer] != "shared" for layer in dims)  # a "shared" layer keeps none
    elements = sum(width + dims.get(layer, 0) for layer in range(config.num_hidden_layers))
    assert kv_bytes_per_token(config, torch.float32) == elements * 4
    cache = PagedCache(config=config, num_blocks=4, block_size=4, device="cpu", dtype=torch.float32)
    assert cache.bytes_per_block() == 4 * elements * 4
    layer = next(iter(dims))
    assert cache.index_pool(layer).shape == (4, 1, 4, config.index_head_dim)
    assert KVShape(1, 8, 8, True, index_dim=4).elements_per_token == 12
    with pytest.raises(ValueError, match="index_dim"):
        KVShape(1, 8, 8, index_dim=-1)
    with pytest.raises(ValueError, match="fp8"):
        PagedCache(config=config, num_blocks=4, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="update_indexer"):  # no padded step open yet
        cache.update_indexer(torch.zeros(1, 1, config.index_head_dim), layer)


def test_engine_refuses_graphs_and_compiled_steps_and_the_gate_still_refuses_other_sparse_families():
    model = _model("deepseek_v32")
    assert support.refusal(model, support.model_features(model)) is None
    assert "sparse_attention" in support.model_features(model.config)  # a config alone cannot say it is adapted
    with pytest.raises(ValueError, match="compile_decode"):
        hf_paged.Engine(model, num_blocks=16, block_size=4, compile_decode=True)
    with pytest.raises(ValueError, match="use_cuda_graph"):
        hf_paged.Engine(model, num_blocks=16, block_size=4, use_cuda_graph=True)
    record = check_architecture("deepseek_v4", timeout_s=120)  # compressed sparse attention: another mechanism
    assert record["verdict"] in ("refused", "not_runnable"), record
    if record["verdict"] == "refused":
        assert "sparse_attention" in record["unhandled"]


def test_model_without_a_paged_cache_folds_the_selection_into_its_mask():
    """Under hf-paged's attention but with transformers' DynamicCache (or none), the module's own code runs with a
    4D mask and hands `indices=` to the attention function, which folds them in: tokens equal transformers'."""
    model = _model("hy_v4")
    ids, mask = tiny_inputs((11, 6), seed=3)
    options = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=None)
    want = dense_generate(model, **options)
    with paged(model), torch.no_grad():
        got = model.generate(**options, past_key_values=DynamicCache(config=model.config))
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # no cache at all
    assert torch.equal(got, want)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(input_ids=ids, attention_mask=mask, use_cache=False).logits)
