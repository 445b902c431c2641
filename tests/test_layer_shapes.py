"""K/V pools whose layers differ in shape (`hf_paged.cache.kv_pool`): per-layer head sizes and KV heads (Gemma 4's
global layers), K wider than V and sliding layers with twice the KV heads (MiMo-V2-Flash), and layers whose values are
their keys (multi-head latent attention's latent, stored once). Tokens are compared with transformers' DynamicCache in
float32 on the CPU.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoConfig, GenerationConfig

import hf_paged
from hf_paged.attention import support
from hf_paged.cache import KVPool, KVShape, PagedCache, kv_bytes_per_token, layer_kv_shapes
from hf_paged.cache.kv_pages import KVPages
from hf_paged.model_zoo import tiny_config, tiny_model

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

# Gemma 4 with its global layers' own head size and KV heads, keys and values from one projection (k_eq_v)
GEMMA4 = dict(attention_k_eq_v=True, num_global_key_value_heads=1, global_head_dim=32,
              num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)
MODELS = {"gemma4_text": GEMMA4, "mimo_v2_flash": {}}
# issue 54's beam search and parallel sampling against transformers: Gemma 4, DeepSeek-V3 (latent attention, through
# its adapter) and gpt-oss (sinks, sliding layers, MoE)
SEARCH_FAMILIES = ("gemma4_text", "deepseek_v3", "gpt_oss")
LENGTHS = (1, 13, 7, 22, 3)


@functools.cache
def model(family: str):
    return generating_model(family, **MODELS.get(family, {}))


@functools.cache
def references(family: str, new: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    return greedy_references(model(family), LENGTHS, seed=7, new=new)


def padded_batch(lengths=(5, 11, 2, 8), seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded_batch(lengths, seed)


# ----------------------------------------------------------------------------------------------- shapes from configs


def test_layer_shapes_come_from_the_config():
    gemma = model("gemma4_text").config
    assert layer_kv_shapes(gemma) == [KVShape(2, 16, 16), KVShape(1, 32, 32)] * 2
    mimo = model("mimo_v2_flash").config  # full, sliding: twice the KV heads; K 16 wide, V 128
    assert layer_kv_shapes(mimo) == [KVShape(2, 16, 128), KVShape(4, 16, 128)]
    mla = AutoConfig.for_model("deepseek_v3", num_hidden_layers=3, kv_lora_rank=32, qk_rope_head_dim=8)
    assert layer_kv_shapes(mla) == [KVShape(1, 40, 40, values_are_keys=True)] * 3
    # bytes per token: each layer its own shape, the latent once
    assert kv_bytes_per_token(gemma, torch.float32) == 4 * 2 * (2 * 2 * 16 + 2 * 1 * 32)
    assert kv_bytes_per_token(mimo, torch.bfloat16) == 2 * (2 * (16 + 128) + 4 * (16 + 128))
    assert kv_bytes_per_token(mla, torch.bfloat16) == 2 * 3 * 40
    cache = PagedCache(config=gemma, block_size=4)
    assert cache.bytes_per_block(torch.float32) == 4 * kv_bytes_per_token(gemma, torch.float32)


def test_the_gate_accepts_mixed_shapes_and_names_them():
    for family in MODELS:
        features = support.model_features(model(family))
        assert "per_layer_head_dim" in features and "cache_shape" not in features
        support.check_supported(model(family))


# ----------------------------------------------------------------------------------------------- tokens


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("path", ["eager", "static", "chunked", "grouped"])
def test_engine_greedy_matches_transformers(family, path):
    """One table over a pool of two shape groups; "grouped": the engine's default for these mixed sliding / full
    stacks, one table per layer group over pages of both shapes (`cache.kv_pages`), its local group releasing."""
    prompts, refs = references(family)
    kwargs = dict(num_blocks=96, block_size=4, release_window_blocks=path == "grouped")
    if path == "chunked":
        kwargs.update(max_num_batched_tokens=6, max_num_seqs=3)
    engine = hf_paged.Engine(model(family), **kwargs)
    if path != "eager":
        engine.runner.decode_mode = "static"
    assert engine_greedy(engine, prompts) == refs
    if path == "grouped":
        assert isinstance(engine.cache.kv, KVPages) and engine.kv_stats().window_released > 0
    else:
        assert len(engine.cache.kv.groups) == 2 and engine.cache.kv.uniform is None
    assert_all_returned(engine)
    engine.close()


@pytest.mark.parametrize("family", list(MODELS))
def test_drop_in_cache_greedy_matches_transformers_and_grows_every_group(family):
    m = model(family)
    ids, mask = padded_batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=None)
    ref = dense_generate(m, **kwargs)
    with paged(m):
        cache = PagedCache(config=m.config, block_size=4)  # grows on demand: 16 blocks first, then doubled
        out = m.generate(**kwargs, past_key_values=cache)
    assert torch.equal(out, ref)
    assert cache.num_blocks > 16 and all(t.shape[t.dim() - 4] == cache.num_blocks for t in cache.kv.tensors)


@pytest.mark.parametrize("family", SEARCH_FAMILIES)
def test_beam_search_matches_transformers_on_the_engine_and_the_drop_in_cache(family):
    m = model(family)
    ids, mask = padded_batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, num_beams=3, num_return_sequences=2, max_new_tokens=8,
                  return_dict_in_generate=True, output_scores=True, eos_token_id=None)
    ref = dense_generate(m, **kwargs)
    with paged(m, num_blocks=256, block_size=4):
        out = m.generate(**kwargs, cache_implementation="paged")
        assert_all_returned(m._hf_paged_engine)
        dropin = m.generate(**kwargs, past_key_values=PagedCache(config=m.config, num_blocks=256, block_size=4))
    for got in (out, dropin):
        assert torch.equal(got.sequences, ref.sequences)
        torch.testing.assert_close(got.sequences_scores, ref.sequences_scores, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", SEARCH_FAMILIES)
def test_parallel_samples_with_a_seed_equal_transformers(family):
    """transformers' own sampling over the drop-in cache draws the tokens it draws over a DynamicCache (same seed);
    the engine's samples (forked blocks, copy-on-write of the shared partial block) score as the model scores them."""
    m = model(family)
    ids, mask = padded_batch((6, 9))
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=True, num_return_sequences=3, max_new_tokens=8,
                  eos_token_id=None, temperature=1.5)
    torch.manual_seed(5)
    ref = dense_generate(m, **kwargs)
    with paged(m, num_blocks=128, block_size=4):
        torch.manual_seed(5)
        dropin = m.generate(**kwargs, past_key_values=PagedCache(config=m.config, num_blocks=128, block_size=4))
        assert torch.equal(dropin, ref)
        prompts = random_prompts((9, 14), seed=2, vocab=200)
        engine = hf_paged.Engine(m, num_blocks=96, block_size=4)
        params = hf_paged.SamplingParams(max_new_tokens=6, do_sample=True, num_return_sequences=3, seed=11,
                                         logprobs=1, ignore_eos=True)
        outputs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1
        for completion in out.outputs:
            full = torch.tensor([prompt + completion.token_ids])
            with torch.no_grad():
                logits = m(input_ids=full).logits[0, len(prompt) - 1: -1].float()
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor([lp for lp, _ in completion.logprobs]), expected, atol=2e-4,
                                       rtol=1e-4)
    assert_all_returned(engine)


@pytest.mark.parametrize("family", list(MODELS))
def test_swap_preemption_and_prefix_hits_keep_every_group_consistent(family):
    prompts, refs = references(family)
    m = model(family)
    swap = hf_paged.Engine(m, num_blocks=14, block_size=4, preemption_mode="swap", swap_space=0.01,
                           release_window_blocks=False)  # (one table: the grouped pool is test_gemma4_groups')
    swap.runner.decode_mode = "static"
    assert engine_greedy(swap, prompts) == refs
    assert swap.scheduler.num_preemptions["swap"] > 0
    assert_all_returned(swap)
    swap.close()
    engine = hf_paged.Engine(m, num_blocks=96, block_size=4, enable_prefix_caching=True)
    shared = prompts[3][:16]
    first = engine_greedy(engine, [shared + [5, 6, 7]])
    again = engine_greedy(engine, [shared + [5, 6, 7], shared + [9]])
    assert engine.prefix_cache_stats().hit_tokens >= 16
    assert again[0] == first[0]
    assert again[1] == dense_generate(m, input_ids=torch.tensor([shared + [9]]), max_new_tokens=8, do_sample=False,
                                      eos_token_id=None)[0, 17:].tolist()
    assert_all_returned(engine)


# ----------------------------------------------------------------------------------------------- the pool itself


def _filled_pool(shapes, num_blocks=6, cpu_blocks=4) -> KVPool:
    pool = KVPool(shapes, num_blocks, 4, torch.device("cpu"), torch.float32, num_cpu_blocks=cpu_blocks)
    g = torch.Generator().manual_seed(0)
    for t in pool.tensors:
        t.copy_(torch.randn(t.shape, generator=g))
    return pool


def _block(pool: KVPool, index: int, block: int) -> list[torch.Tensor]:
    keys, values = pool.layer_views(index)
    return [keys[block].clone(), values[block].clone()]


def test_pool_block_operations_keep_every_group_consistent():
    shapes = [KVShape(2, 8, 8), KVShape(1, 12, 4), KVShape(1, 6, 6, values_are_keys=True), KVShape(2, 8, 8)]
    pool = _filled_pool(shapes)
    assert len(pool.groups) == 3 and pool.uniform is None
    assert [len(g.tensors) for g in pool.groups] == [1, 2, 1]  # joint K/V, K and V apart, keys alone
    before = [_block(pool, i, 1) for i in range(4)]
    pool.copy_blocks(torch.tensor([1]), torch.tensor([4]))  # copy-on-write
    for i in range(4):
        assert all(torch.equal(a, b) for a, b in zip(_block(pool, i, 4), before[i]))
    pool.swap_out(torch.tensor([1]), torch.tensor([2]))
    for t in pool.tensors:
        t.zero_()
    pool.swap_in(torch.tensor([2]), torch.tensor([5]))
    for i in range(4):
        assert all(torch.equal(a, b) for a, b in zip(_block(pool, i, 5), before[i]))
    pool.grow(9)
    assert pool.num_blocks == 9 and all(t.shape[t.dim() - 4] == 9 for t in pool.tensors)
    for i in range(4):
        assert all(torch.equal(a, b) for a, b in zip(_block(pool, i, 5), before[i]))
    keys, values = pool.layer_views(2)
    assert values is keys  # values that are the keys: one view


def test_values_that_are_the_keys_are_stored_once():
    """The MLA adapter's contract: `update(latent, latent, layer)` with the same tensor twice, on a layer declared
    `KVShape(..., values_are_keys=True)`; the block holds the latent once, the value cache read back is the keys."""
    shapes = [KVShape(1, 24, 24, values_are_keys=True), KVShape(2, 8, 8)]
    cache = PagedCache(num_layers=2, kv_shapes=shapes, num_blocks=8, block_size=4)
    assert cache.bytes_per_block(torch.float32) == (1 * 24 + 2 * (8 + 8)) * 4 * 4
    latent = torch.randn(1, 1, 5, 24)
    keys, values = cache.update(latent, latent, 0)
    assert values is keys and keys.shape == (8, 1, 4, 24)
    table = cache.block_manager.block_table(cache._rows[0])
    stored = torch.cat([keys[b] for b in table], dim=1)[:, :5]  # [1, tokens, 24]
    assert torch.equal(stored, latent[0])
    other = torch.randn(1, 2, 5, 8)
    cache.update(other, other.clone(), 1)
    with pytest.raises(ValueError, match="values_are_keys"):
        cache.update(latent, latent.clone(), 0)  # values that are not the keys themselves
    with pytest.raises(ValueError, match="holds"):
        cache.update(torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16), 1)  # a width the layer does not hold
    with pytest.raises(ValueError, match="kv_shapes"):
        PagedCache(num_layers=2, kv_shapes=shapes[:1], num_blocks=8)


def test_fp8_pool_of_mixed_shapes_has_per_layer_scales_and_follows_the_drop_in_cache():
    m = model("mimo_v2_flash")
    prompts = random_prompts((13, 4), seed=2, vocab=200)
    engine = hf_paged.Engine(m, num_blocks=64, block_size=8, kv_cache_dtype="fp8", kv_scales=0.03)
    engine_tokens = engine_greedy(engine, prompts, new=6)
    cache = engine.cache
    assert all(t.dtype == torch.float8_e4m3fn for t in cache.kv.tensors)
    assert [cache.layer_scales(layer)[0].shape[0] for layer in cache.kv_layers] == [2, 4]
    assert cache.bytes_per_block() == kv_bytes_per_token(m.config, torch.float8_e4m3fn) * 8
    engine.close()
    with paged(m):
        for prompt, expected in zip(prompts, engine_tokens):
            dropin = PagedCache(config=m.config, block_size=8, kv_cache_dtype="fp8", kv_scales=0.03)
            out = m.generate(torch.tensor([prompt]), past_key_values=dropin, max_new_tokens=6, do_sample=False,
                             eos_token_id=None)
            assert out[0, len(prompt):].tolist() == expected
    # an FP8 latent is read with its key scale: the value scale of a values-are-keys layer follows it
    latent_cache = PagedCache(num_layers=1, kv_shapes=[KVShape(1, 16, 16, values_are_keys=True)], num_blocks=4,
                              block_size=4, kv_cache_dtype="fp8")
    latent = torch.randn(1, 1, 3, 16)
    latent_cache.update(latent, latent, 0)
    k_scale, v_scale = latent_cache.layer_scales(0)
    assert torch.equal(k_scale, v_scale) and float(k_scale[0]) != 1.0


def test_a_tensor_parallel_rank_writing_its_share_splits_every_layer():
    """A rank of a tensor-parallel model writes its share of each layer's KV heads: the first write shows the share
    and every layer's heads are split alike; a share that some layer cannot give is refused, naming it."""
    config = tiny_config("mimo_v2_flash")  # full layer: 2 KV heads, sliding layer: 4
    cache = PagedCache(config=config, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV heads"):
        cache.update(torch.randn(1, 3, 2, 16), torch.randn(1, 3, 2, 128), 1)  # no share of 4
    cache.update(torch.randn(1, 2, 2, 16), torch.randn(1, 2, 2, 128), 1)  # half of layer 1's: a 2-way rank
    assert [s.kv_heads for s in cache.kv_shapes] == [1, 2] and cache.kv.groups[0].tensors[0].shape[2] == 1
    with pytest.raises(ValueError, match="KV heads in layer 0"):
        cache.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 128), 0)
    odd = PagedCache(config=tiny_config("mimo_v2_flash", num_key_value_heads=1), num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="cannot be split"):
        odd.update(torch.randn(1, 1, 2, 16), torch.randn(1, 1, 2, 128), 1)


# ----------------------------------------------------------------------------------------------- KV sharing

SHARING = {
    "gemma4_text": dict(GEMMA4, num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3,
                        num_kv_shared_layers=2),
    "gemma3n_text": dict(num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3,
                         num_kv_shared_layers=2, activation_sparsity_pattern=[0.0] * 6),
}


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f == "gemma4_text" else f
                                    for f in SHARING])
def test_layers_reading_an_earlier_layers_kv_hold_no_blocks_and_match_transformers(family):
    """Gemma 3n / 4: the last `num_kv_shared_layers` layers read the K/V of the last earlier layer of their type
    (their modeling code hands them that layer's pool views); they write none and get no blocks."""
    overrides = dict(SHARING[family])
    if family == "gemma3n_text":
        overrides["intermediate_size"] = [tiny_config(family).intermediate_size[0]] * 6
    m = tiny_model(family, **overrides)
    m.generation_config = GenerationConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    assert "kv_sharing" in support.model_features(m)
    prompts = random_prompts(LENGTHS, seed=4, vocab=200)
    refs = [dense_generate(m, input_ids=torch.tensor([p]), max_new_tokens=8, do_sample=False,
                           eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    engine = hf_paged.Engine(m, num_blocks=96, block_size=4)
    engine.runner.decode_mode = "static"
    assert engine_greedy(engine, prompts) == refs
    cache = engine.cache
    assert cache.kv_layers == [0, 1, 2, 3]  # layers 4 and 5 read layers 2 and 3
    assert cache.layer_caches(4) == cache.layer_caches(2) and cache.layer_caches(5) == cache.layer_caches(3)
    with pytest.raises(ValueError, match="no K/V of its own"):
        cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 4)
    assert_all_returned(engine)
    engine.close()
    ids, mask = padded_batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    ref = dense_generate(m, **kwargs)
    with paged(m):
        assert torch.equal(m.generate(**kwargs, past_key_values=PagedCache(config=m.config, block_size=4)), ref)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mimo_v2_flash", "gemma4_text-sharing"])
def test_compiled_decode_step_matches_transformers(family):
    """The compiled step writes each layer's new K/V in its fused op (`attention.compiled_op`): values of their own
    width, and layers that read another layer's K/V through that layer's views."""
    if family == "mimo_v2_flash":
        m = model(family)
    else:
        m = tiny_model("gemma4_text", **SHARING["gemma4_text"])
        m.generation_config = GenerationConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    prompts = random_prompts(LENGTHS, seed=4, vocab=200)
    refs = [dense_generate(m, input_ids=torch.tensor([p]), max_new_tokens=6, do_sample=False,
                           eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    torch._dynamo.reset()
    engine = hf_paged.Engine(m, num_blocks=96, block_size=4, max_num_seqs=8, compile_decode=True)
    assert engine_greedy(engine, prompts, new=6) == refs
    assert engine.runner.graph_steps > 0 and engine.runner.compile_failure is None
    assert_all_returned(engine)
    engine.close()
    torch._dynamo.reset()
