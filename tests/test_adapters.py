"""Per-family attention adapters (`hf_paged.attention.adapters`): families that compute attention themselves.

What must hold, on each adapted family's tiny seeded model (float32, CPU), variants of Falcon included:

* logits of a left-padded prefill and a decode step through the drop-in `PagedCache` equal transformers' own, and
  so does a forward without a cache (the engine's and `generate()`'s tokens are the architecture sweep's:
  `tests/test_architectures.py`, and Falcon's variants here);
* the ALiBi slopes are the family's own and matter (zeroed, the logits change), so the equality is not vacuous;
* an adapter is per instance and comes off with `hf_paged.disable` (class, instances, buffers, implementation back),
  and an installed adapter under another attention implementation runs the module's own code;
* a variant an adapter does not handle is refused up front, naming it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

import hf_paged
from hf_paged import capabilities
from hf_paged.attention import adapters, support
from hf_paged.attention.adapters import alibi
from hf_paged.cache import layer_kv_shapes
from hf_paged.model_zoo import check_architecture, tiny_inputs, tiny_model

warnings.filterwarnings("ignore", module="transformers")
transformers.logging.set_verbosity_error()

ADAPTED = ("falcon", "gptj", "gpt_neo", "codegen", "jetmoe", "bloom", "mpt", "xglm", "gpt_neox_japanese", "diffllama",
           "moshi")
FALCON_VARIANTS = [
    dict(new_decoder_architecture=True),  # Falcon-40B/180B: grouped K/V broadcast over query heads before the cache
    dict(alibi=True),  # Falcon-RW
    dict(alibi=True, new_decoder_architecture=True),
    dict(multi_query=False, num_kv_heads=4, parallel_attn=False),
]
DIFFLLAMA_PAIRS = dict(num_attention_heads=8, num_key_value_heads=4)  # two pool heads, each pairing two KV heads
CASES = ([(family, {}) for family in ADAPTED] + [("falcon", v) for v in FALCON_VARIANTS]
         + [("diffllama", DIFFLLAMA_PAIRS)])


def _logits(model, ids, mask, cache=None):
    """Logits of the prompt, then of one more token per row, through `cache` (or transformers' own)."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        mask2 = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        step = model(input_ids=nxt, attention_mask=mask2, past_key_values=out.past_key_values, use_cache=True)
    return out.logits, step.logits


@pytest.mark.parametrize("family,overrides", CASES, ids=lambda c: str(c) if isinstance(c, str) else
                         "-".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_adapted_family_logits_equal_transformers(family, overrides):
    model = tiny_model(family, **overrides)
    ids, mask = tiny_inputs((9, 5))
    want_prefill, want_step = _logits(model, ids, mask)
    with torch.no_grad():
        want_plain = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    hf_paged.enable(model)
    assert adapters.adapted_modules(model)
    try:
        cache = hf_paged.PagedCache(config=model.config, num_blocks=16, block_size=4)
        got_prefill, got_step = _logits(model, ids, mask, cache)
        with torch.no_grad():
            got_plain = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    finally:
        hf_paged.disable(model)
    valid = mask.bool()
    torch.testing.assert_close(got_prefill[valid], want_prefill[valid], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got_step, want_step, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got_plain[valid], want_plain[valid], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides", FALCON_VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
def test_falcon_variants_pass_the_sweep(overrides):
    """Engine (`generate(cache_implementation="paged")`) and drop-in greedy tokens equal transformers'."""
    record = check_architecture("falcon", timeout_s=120, **overrides)
    assert record["verdict"] == "pass", record["reason"]
    assert ("alibi" in record["observed"]) == bool(overrides.get("alibi"))


@pytest.mark.parametrize("overrides", [{}, DIFFLLAMA_PAIRS], ids=["default", "pairs"])
def test_diffllama_passes_the_sweep_with_paired_kv_heads(overrides):
    """Engine and drop-in greedy tokens equal transformers' DynamicCache greedy (left-padded batch, float32); the pool
    holds half the KV heads at twice the width, the same bytes per token as the model's own cache."""
    record = check_architecture("diffllama", timeout_s=120, **overrides)
    assert record["verdict"] == "pass", record["reason"]
    config = tiny_model("diffllama", **overrides).config
    shapes = layer_kv_shapes(config)
    head_dim = config.head_dim
    assert {(s.kv_heads, s.key_dim, s.value_dim) for s in shapes} == {
        (config.num_key_value_heads // 2, 2 * head_dim, 2 * head_dim)}


@pytest.mark.parametrize("family,overrides,want", [
    ("bloom", {}, [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]),  # the ALiBi paper's slopes for 4 heads
    ("mpt", {}, [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]),  # MPT's (alibi_bias_max 8), the same for 4 heads
    ("falcon", dict(alibi=True), [x / 4 for x in (2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8)]),  # scaled by 1/sqrt(16)
])
def test_alibi_slopes_are_the_familys_and_they_matter(family, overrides, want):
    model = tiny_model(family, **overrides)
    ids, mask = tiny_inputs((9, 5))
    want_prefill, _ = _logits(model, ids, mask)
    hf_paged.enable(model)
    try:
        modules = [m for m in model.modules() if hasattr(m, alibi.SLOPES)]
        assert modules and all(torch.equal(alibi.slopes_of(m), torch.tensor(want)) for m in modules)
        for m in modules:
            alibi.slopes_of(m).zero_()
        cache = hf_paged.PagedCache(config=model.config, num_blocks=16, block_size=4)
        zeroed, _ = _logits(model, ids, mask, cache)
    finally:
        hf_paged.disable(model)
    valid = mask.bool()
    assert (zeroed[valid] - want_prefill[valid]).abs().max() > 1e-2


@pytest.mark.parametrize("family,method", [("gptj", "_attn"), ("falcon", "forward"), ("mpt", "forward")])
def test_disable_takes_the_adapters_off(family, method):
    model = tiny_model(family)
    before = model.config._attn_implementation
    ids, mask = tiny_inputs()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    hf_paged.enable(model)
    modules = adapters.adapted_modules(model)
    assert modules and all(method in m.__dict__ for m in modules)
    assert model.config._attn_implementation == hf_paged.ATTENTION_NAME
    hf_paged.disable(model)
    assert model.config._attn_implementation == before
    for m in modules:
        assert not {method, "_hf_paged_adapter", "_hf_paged_original"} & set(m.__dict__)
        assert alibi.SLOPES not in m._buffers
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, want)


def test_installed_adapter_runs_the_modules_own_code_under_another_implementation():
    model = tiny_model("falcon")
    ids, mask = tiny_inputs()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    assert adapters.install(model) == model.config.num_hidden_layers
    assert adapters.install(model) == model.config.num_hidden_layers  # idempotent
    try:
        with torch.no_grad():  # still "sdpa": the adapters route nothing
            assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, want)
    finally:
        adapters.uninstall(model)


def test_gpt_neo_local_layers_pass_their_window_and_layer():
    model = tiny_model("gpt_neo")
    caps = capabilities.inspect_model(model)
    assert caps.interface_routed and [c.layer_idx for c in caps.calls] == [0, 1]
    assert [c.sliding_window for c in caps.calls] == [None, model.config.window_size]
    assert [c.scaling for c in caps.calls] == [1.0, 1.0]  # GPT-Neo does not scale its logits
    assert not any("layer_idx" in m.__dict__ for m in model.modules())  # the alias came off with the adapters


def test_a_variant_the_adapter_does_not_handle_is_refused_naming_it():
    model = tiny_model("bloom", pretraining_tp=2, slow_but_exact=True)
    features = support.model_features(model)
    assert "slow_but_exact" in features["not_interface_routed"] and "attention_adapter" not in features
    with pytest.raises(ValueError, match="not_interface_routed"):
        hf_paged.enable(model)
    assert not adapters.adapted_modules(model)


def test_xglm_cross_attention_call_is_refused():
    model = tiny_model("xglm")
    hf_paged.enable(model)
    try:
        attention = adapters.adapted_modules(model)[0]
        hidden = torch.zeros(1, 2, model.config.d_model)
        with pytest.raises(ValueError, match="cross-attention"):
            attention(hidden, key_value_states=hidden)
    finally:
        hf_paged.disable(model)


def test_diffllama_module_with_other_kv_heads_is_refused():
    """A shard holding some of the config's KV heads cannot pair `a` with `a + kv_heads / 2`: refused, naming it."""
    model = tiny_model("diffllama")
    attention = next(m for m in model.modules() if type(m).__name__ == "DiffLlamaAttention")
    attention.k_proj = torch.nn.Linear(model.config.hidden_size, attention.head_dim)
    assert "k_proj writes" in adapters.refusal(attention)
    assert "not_interface_routed" in support.model_features(model)
