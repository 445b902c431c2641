"""Families the architecture sweep once refused, each checked where the sweep's one short batch would not catch a
regression: greedy tokens of the engine (one step and chunked prefill, so prefill chunks and decodes share steps)
against transformers' own `generate()`, on tiny seeded models (float32, CPU).

* Zaya: its CCA projection is a recurrent mixer that returns query, key and value (a tuple) and its attention picks
  the model's own causal mask out of a mapping (`attention_mask_modified` no longer reported for it).
* Moshi: its window is applied by transformers' cache only (`hf_paged.attention.adapters.moshi`). With its
  checkpoints' window (as long as the context) tokens equal transformers' on the engine's eager and static decode
  paths (chunked prefill and prefix hits included) and the drop-in cache; a shorter window is refused.
* Zamba and HRM (`cache_layer_index`): a module writes cache layers other than its own `layer_idx` (Zamba's shared
  attention block, `layer_idx` None, at each hybrid depth; HRM's two layers at each of their 8 cycles): the pool keeps
  each depth's K/V apart, and the attention reads the layer `update()` wrote. Checked on the engine (one step and
  chunked prefill, every depth in every forward), by the pool's distinct layers, and the compiled decode step (whose
  fused op writes the module's own layer) is refused when asked for and not chosen by default.
* Mllama's text model (`text_only_cross_attention`): its image cross-attention layer (layer 1 of the zoo's 3) keeps no
  K/V and is skipped by the model in text-only runs (`PagedCache.get_seq_length` of it stays 0); image states are
  refused with a ValueError, not run against an empty cache.
"""

from __future__ import annotations

import functools

import pytest
import torch

import hf_paged
from hf_paged.cache import PagedCache
from hf_paged.engine.defaults import compile_decode_for

try:
    from tests.helpers import (
        assert_all_returned,
        dense_generate,
        engine_greedy,
        generating_model,
        greedy_references,
        left_padded_batch,
    )
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import (
        assert_all_returned,
        dense_generate,
        engine_greedy,
        generating_model,
        greedy_references,
        left_padded_batch,
    )


@functools.cache
def family_model(family: str):
    return generating_model(family)


def model_greedy(model, prompts, new: int, static: bool = False, **kwargs) -> list[list[int]]:
    engine = hf_paged.Engine(model, num_blocks=96, block_size=4, **kwargs)
    if static:
        engine.runner.decode_mode = "static"  # the GPU's decode path (buffers, padded buckets), run eagerly
    tokens = engine_greedy(engine, prompts, new)
    assert_all_returned(engine)
    return tokens


@pytest.mark.parametrize("path", ["eager", "static", "chunked"])
def test_zaya_matches_transformers_on_the_engine(path):
    model = family_model("zaya")
    assert "attention_mask_modified" not in hf_paged.attention.model_features(model)
    prompts, refs = greedy_references(model, (1, 23, 7, 17, 3), seed=5, new=8)
    kwargs = dict(max_num_batched_tokens=6, max_num_seqs=3) if path == "chunked" else {}
    assert model_greedy(model, prompts, 8, static=path == "static", **kwargs) == refs


@pytest.mark.slow
def test_zaya_compiled_decode_matches_transformers():
    """Zaya's CCA projection returns a tuple: the compiled decode step commits its states through the first tensor."""
    torch._dynamo.reset()
    model = family_model("zaya")
    prompts, refs = greedy_references(model, (1, 23, 7, 17, 3), seed=5, new=8)
    engine = hf_paged.Engine(model, num_blocks=96, block_size=4, max_num_seqs=2, compile_decode=True)
    try:
        engine.warm_up(freeze_gc=False)
        outs = engine.generate(prompts, hf_paged.SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == refs and engine.runner.graph_steps > 0
    finally:
        engine.close()
        torch._dynamo.reset()


def test_a_mask_the_module_builds_itself_is_still_refused():
    """Doge hands the attention function a dynamic mask it builds from the cached values (a learned per-key bias, and
    beyond `keep_window_size` keys a top-k selection): still refused, naming what builds it."""
    features = hf_paged.attention.model_features(family_model("doge"))
    assert "prepare_dynamic_mask" in features["attention_mask_modified"]
    with pytest.raises(ValueError, match="attention_mask_modified"):
        hf_paged.attention.check_supported(family_model("doge"))


@pytest.mark.parametrize("static", [False, True])
def test_moshi_runs_with_its_checkpoints_window_and_refuses_a_shorter_one(static):
    """Moshi's checkpoints have a window as long as the context (3000 = 3000; the zoo's 256 = 256): tokens equal
    transformers' on the engine, also with prompts cut into chunks and prefix-cache hits. A window shorter than the
    context is refused, naming why: transformers applies it through its cache, so what a long prompt attends to would
    depend on the engine's scheduling (chunks, prefix hits, recompute)."""
    model = family_model("moshi")
    assert model.config.sliding_window == model.config.max_position_embeddings
    assert "mask_only_window" not in hf_paged.attention.model_features(model)
    prompts, refs = greedy_references(model, (1, 23, 7, 17, 3), seed=5, new=8)
    prompts.append(prompts[1] + prompts[3])  # (a prefix-cache hit on the second prompt's blocks)
    refs.append(dense_generate(model, input_ids=torch.tensor([prompts[-1]]), max_new_tokens=8, do_sample=False,
                               eos_token_id=None)[0, len(prompts[-1]):].tolist())
    assert model_greedy(model, prompts, 8, static=static) == refs
    assert model_greedy(model, prompts, 8, static=static, max_num_batched_tokens=6, max_num_seqs=3) == refs
    short = generating_model("moshi", sliding_window=4)
    with pytest.raises(ValueError, match="sliding_window=4 < max_position_embeddings=256"):
        hf_paged.attention.check_supported(short)


def test_moshi_drop_in_cache_matches_transformers_on_a_padded_batch():
    model = family_model("moshi")
    input_ids, mask = left_padded_batch((11, 3, 6))
    kwargs = dict(input_ids=input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    reference = dense_generate(model, **kwargs)
    with torch.no_grad():
        hf_paged.enable(model)
        try:
            out = model.generate(past_key_values=PagedCache(config=model.config, num_blocks=64, block_size=4), **kwargs)
        finally:
            hf_paged.disable(model)
    assert torch.equal(out, reference)


@pytest.mark.parametrize("family", ["zamba", "hrm_text"])
@pytest.mark.parametrize("path", ["eager", "static", "chunked"])
def test_modules_writing_other_cache_layers_match_transformers_on_the_engine(family, path):
    model = family_model(family)
    prompts, refs = greedy_references(model, (1, 23, 7, 17, 3), seed=5, new=8)
    kwargs = dict(max_num_batched_tokens=6, max_num_seqs=3) if path == "chunked" else {}
    assert model_greedy(model, prompts, 8, static=path == "static", **kwargs) == refs


@pytest.mark.parametrize("family,depths", [("zamba", [1, 3]), ("hrm_text", list(range(16)))])
def test_every_depth_keeps_its_own_kv_in_the_drop_in_cache(family, depths):
    """A prompt through every depth of the shared / cycled modules: each writes its own cache layer."""
    model = family_model(family)
    assert "cache_layer_index" in hf_paged.attention.model_features(model)
    input_ids, mask = left_padded_batch((9, 5))
    kwargs = dict(input_ids=input_ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
    reference = dense_generate(model, **kwargs)
    cache = PagedCache(config=model.config, num_blocks=64, block_size=4)
    with torch.no_grad():
        hf_paged.enable(model)
        try:
            out = model.generate(past_key_values=cache, **kwargs)
        finally:
            hf_paged.disable(model)
    assert torch.equal(out, reference)
    assert cache.kv_layers == depths
    first_block = cache.block_manager.block_table(cache._rows[0])[0]
    keys = [cache.layer_caches(layer)[0][first_block] for layer in depths]
    assert all(not torch.equal(keys[0], other) for other in keys[1:])  # (written, and apart)


@pytest.mark.parametrize("family", ["zamba", "hrm_text"])
def test_the_compiled_decode_step_is_not_used_for_them(family):
    model = family_model(family)
    assert compile_decode_for(model, True, compile_auto=True) is False
    with pytest.raises(ValueError, match="cache_layer_index"):
        compile_decode_for(model, True, compile_auto=False)
    assert compile_decode_for(family_model("moshi"), True, compile_auto=False) is True


def test_mllama_runs_text_only_and_refuses_image_states():
    model = family_model("mllama")
    assert model.config.cross_attention_layers == [1]
    prompts, refs = greedy_references(model, (1, 23, 7, 17, 3), seed=5, new=8)
    assert model_greedy(model, prompts, 8) == refs
    cache = PagedCache(config=model.config, num_blocks=16, block_size=4)
    assert cache.kv_layers == [0, 2]
    input_ids, mask = left_padded_batch((5, 3))
    states = torch.zeros((2, 4, model.config.hidden_size))
    with torch.no_grad():
        hf_paged.enable(model)
        try:
            with pytest.raises(ValueError, match="layer 1 keeps no K/V"):
                model(input_ids=input_ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                      cross_attention_states=states)
        finally:
            hf_paged.disable(model)


@pytest.mark.slow
def test_moshi_compiled_decode_and_prefill_match_transformers():
    """The compiled step's fused op takes `cache_window` too: the decode window, and on the prefill steps routed
    through the compiled layers (prompts admitted beside running decodes), each sequence's first key."""
    torch._dynamo.reset()
    model = family_model("moshi")
    prompts, refs = greedy_references(model, (1, 23, 7, 17, 3), seed=5, new=8)
    engine = hf_paged.Engine(model, num_blocks=96, block_size=4, max_num_seqs=2, compile_decode=True)
    try:
        engine.warm_up(freeze_gc=False)
        routed = engine.runner.compiled_prefill_steps
        assert engine_greedy(engine, prompts, 8) == refs
        assert engine.runner.graph_steps > 0 and engine.runner.compiled_prefill_steps > routed
    finally:
        engine.close()
        torch._dynamo.reset()
