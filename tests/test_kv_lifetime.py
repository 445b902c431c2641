"""Cached K/V never outlives the weights that computed it (issue 13, item 1).

Each test fills the prefix cache with a first `generate(cache_implementation="paged")`, changes the weights one way,
and checks the next paged call's greedy tokens equal transformers' (DynamicCache) with the new weights, and that the
change did change transformers' tokens (otherwise the test would prove nothing).
"""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.testing import tiny_model

NEW = 8


def _prompts() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(3, 300, (2, 40), generator=g)  # two full 16-token blocks each: prefix-cache hits


def _paged(model, ids):
    return model.generate(ids, cache_implementation="paged", max_new_tokens=NEW, do_sample=False)


def _reference(model, ids):
    return model.generate(ids, max_new_tokens=NEW, do_sample=False)


@pytest.fixture
def model():
    m = tiny_model("llama")
    hf_paged.enable(m, kv_cache_memory="8MiB")
    return m


def _check_after(model, change, must_change: bool = True):
    ids = _prompts()
    before = _paged(model, ids)
    assert torch.equal(before, _reference(model, ids))
    engine = model._hf_paged_engine
    hits_before = engine.block_manager.prefix_hit_tokens
    change(model)
    expected = _reference(model, ids)
    assert not must_change or not torch.equal(expected, before), "the weight change did not change the outputs: the test proves nothing"
    assert torch.equal(_paged(model, ids), expected)
    engine = model._hf_paged_engine
    return engine, hits_before


def _scale_in_place(model):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.3)


def test_optimizer_step_drops_the_prefix_cache(model):
    def step(m):
        opt = torch.optim.SGD(m.parameters(), lr=5.0)
        ids = _prompts()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    engine, hits = _check_after(model, step)
    assert engine.stats["weight_changes"] == 1
    assert engine.block_manager.prefix_hit_tokens == hits  # nothing was served from the old cache


def test_in_place_update_then_cache_serves_again(model):
    engine, _ = _check_after(model, _scale_in_place)
    hits = engine.block_manager.prefix_hit_tokens
    _paged(model, _prompts())  # unchanged weights: the new cache is used again
    assert engine.block_manager.prefix_hit_tokens > hits


def test_replaced_parameter(model):
    def replace(m):
        proj = m.model.layers[0].self_attn.k_proj
        proj.weight = torch.nn.Parameter(proj.weight.detach() * 3.0)

    _check_after(model, replace)


def test_load_state_dict_copy_and_assign(model):
    other = tiny_model("llama", seed=7).state_dict()
    _check_after(model, lambda m: m.load_state_dict(other))
    third = tiny_model("llama", seed=8).state_dict()
    _check_after(model, lambda m: m.load_state_dict(third, assign=True))


def test_storage_swap_through_data(model):
    def swap(m):
        for p in m.model.layers[1].parameters():
            p.data = p.data * 1.5

    _check_after(model, swap)


def test_dtype_moves(model):
    # a round trip through bfloat16 rounds every weight in new storage: same engine (same dtype), cache dropped
    engine, _ = _check_after(model, lambda m: m.to(torch.bfloat16).to(torch.float32), must_change=False)
    assert engine.stats["weight_changes"] == 1
    # a real move: the engine's pool has the old dtype, so generate builds a new engine (the old one is closed)
    model.to(torch.bfloat16)
    out = _paged(model, _prompts())
    assert out.shape == (2, 40 + NEW)
    assert model._hf_paged_engine is not engine and model._hf_paged_engine.dtype == torch.bfloat16
    assert engine.closed


def test_direct_engine_refuses_a_moved_model():
    m = tiny_model("llama")
    engine = hf_paged.Engine(m, kv_cache_memory="4MiB")
    engine.generate([[5, 6, 7]], max_new_tokens=2)
    m.to(torch.bfloat16)
    with pytest.raises(ValueError, match="build a new Engine"):
        engine.generate([[5, 6, 8]], max_new_tokens=2)


def test_peft_adapter_enable_disable_switch_merge():
    peft = pytest.importorskip("peft")
    base = tiny_model("llama")
    hf_paged.enable(base, kv_cache_memory="8MiB")
    ids = _prompts()
    plain = _paged(base, ids)
    config = peft.LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj"],
                             init_lora_weights=False)
    model = peft.get_peft_model(base, config, adapter_name="a")
    model.add_adapter("b", peft.LoraConfig(r=4, lora_alpha=64, target_modules=["k_proj", "v_proj"],
                                           init_lora_weights=False))
    seen = [plain]

    def check():
        out = model.generate(input_ids=ids, cache_implementation="paged", max_new_tokens=NEW, do_sample=False)
        expected = model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(out, expected)
        assert not any(torch.equal(expected, s) for s in seen[-1:])  # each change changed the outputs
        seen.append(expected)

    check()  # adapter "a" injected and active
    model.set_adapter("b")
    check()
    with model.disable_adapter():
        out = model.generate(input_ids=ids, cache_implementation="paged", max_new_tokens=NEW, do_sample=False)
        assert torch.equal(out, plain)
    model.set_adapter("a")
    model.merge_adapter()
    out = model.generate(input_ids=ids, cache_implementation="paged", max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False))
    model.unmerge_adapter()


def test_reset_prefix_cache_recomputes_running_requests():
    m = tiny_model("llama")
    engine = hf_paged.Engine(m, kv_cache_memory="4MiB")
    ids = _prompts().tolist()
    engine.generate(ids, max_new_tokens=2)  # cache the prompts
    assert engine.prefix_cache_stats().cached_blocks > 0
    request = engine.add_request(ids[0], params=hf_paged.SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    engine.step()  # admitted, prefix hit, decoding
    _scale_in_place(m)
    dropped = engine.reset_prefix_cache(recompute_running=True)
    assert dropped > 0 and engine.prefix_cache_stats().cached_blocks == 0
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    got = outputs[request].outputs[0].token_ids
    # recomputed with the new weights: the first token was sampled before the change, the rest after, all over
    # K/V of the new weights, exactly what transformers computes continuing from that first token
    prefix = torch.tensor([ids[0] + got[:1]])
    expected = m.generate(prefix, max_new_tokens=NEW - 1, do_sample=False)[0, prefix.shape[1]:].tolist()
    assert got[1:] == expected
    with pytest.raises(TypeError, match="recompute_running"):
        engine.reset_prefix_cache(recompute_running="yes")


def test_requests_in_flight_are_never_shared_after_a_change():
    m = tiny_model("llama")
    engine = hf_paged.Engine(m, kv_cache_memory="4MiB")
    ids = _prompts().tolist()
    first = engine.add_request(ids[0], params=hf_paged.SamplingParams(max_new_tokens=40, ignore_eos=True))
    engine.step()
    _scale_in_place(m)
    # a new request with the same prompt: the weights changed, so it must not get the in-flight sequence's blocks
    out = engine.generate([ids[0]], max_new_tokens=NEW)[0].outputs[0].token_ids
    expected = m.generate(torch.tensor([ids[0]]), max_new_tokens=NEW, do_sample=False)[0, 40:].tolist()
    assert out == expected
    assert engine.stats["weight_changes"] == 1
    while engine.has_unfinished():
        engine.step()
    assert first not in engine.registry.groups


def test_weight_watch_sees_each_kind_of_change():
    from hf_paged.runner import ModelRef, WeightWatch

    m = tiny_model("llama")
    watch = WeightWatch(ModelRef(m))
    assert watch.check() is None
    with torch.no_grad():
        m.lm_head.weight.add_(1.0)
    change = watch.check()
    assert change is not None and not change.storage
    assert watch.check() is None
    m.model.norm.weight = torch.nn.Parameter(m.model.norm.weight.detach().clone())
    assert watch.check().storage
    m.model.layers[0].mlp.up_proj.weight.data = m.model.layers[0].mlp.up_proj.weight.data.clone()
    assert watch.check().storage
    m.to(torch.float64)
    change = watch.check()
    assert change.storage and change.dtype == torch.float64
    assert watch.check() is None
