"""End to end: families whose attention uses windows / soft-capping / sinks / chunks, paged vs transformers.

Greedy (and beam) tokens of `generate(cache_implementation="paged")` must equal transformers' default path on
tiny seeded float32 models, left-padded batches with prompts longer than the window / chunk. The model acceptance
check (`attention/support.py`, owned elsewhere) is patched to accept, so these tests exercise the kernels and
the attention function's wiring only.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_paged
import hf_paged.attention.setup as attention_setup
from hf_paged.testing import tiny_batch

ENGINE = dict(num_blocks=256, block_size=8)
LENGTHS = (21, 6, 13)
COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)

CONFIGS = {
    "gemma2": dict(num_hidden_layers=2, sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(num_hidden_layers=6, sliding_window=8, attn_logit_softcapping=3.0),
    "gpt_oss": dict(num_hidden_layers=2, sliding_window=8, num_local_experts=4, num_experts_per_tok=2),
    "mistral": dict(num_hidden_layers=2, sliding_window=8),
    "llama4_text": dict(num_hidden_layers=4, attention_chunk_size=8, intermediate_size_mlp=96, num_local_experts=2,
                        num_experts_per_tok=1, interleave_moe_layer_step=2),
}


def _model(model_type: str, seed: int = 0):
    config = AutoConfig.for_model(model_type, **{**COMMON, **CONFIGS[model_type]})
    config._attn_implementation = "eager"  # gpt-oss has no SDPA path; the same reference for every family
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # jitter constant tensors (norms, biases, sinks) so they matter
            for p in model.parameters():
                flat = p.reshape(-1)
                if flat.numel() and bool((flat == flat[0]).all()):
                    p.add_(torch.randn(p.shape) * 0.3)
    return model.eval()


@contextlib.contextmanager
def paged(model, **engine_kwargs):
    """hf_paged on inside the block, back to eager after (gpt-oss refuses transformers' default, SDPA)."""
    hf_paged.enable(model, **engine_kwargs)
    try:
        yield model
    finally:
        hf_paged.disable(model, attn_implementation="eager")


@pytest.fixture(autouse=True)
def _accept_all(monkeypatch):
    monkeypatch.setattr(attention_setup, "check_supported", lambda model: None)


def _uses_features(model) -> None:
    """Guard against a config that silently turns the feature off (the test would then prove nothing)."""
    c = model.config
    assert getattr(c, "sliding_window", None) or getattr(c, "attention_chunk_size", None)
    types = set(getattr(c, "layer_types", None) or [])
    assert types & {"sliding_attention", "chunked_attention"} or c.model_type == "mistral", types


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_greedy_matches_transformers(model_type):
    model = _model(model_type)
    _uses_features(model)
    batch = tiny_batch(model, lengths=LENGTHS, seed=3)
    kwargs = dict(**batch, do_sample=False, max_new_tokens=10)
    with torch.no_grad():
        ref = model.generate(**kwargs)  # transformers' default path (DynamicCache, eager attention)
    with paged(model, **ENGINE):
        out = model.generate(**kwargs, cache_implementation="paged")
    assert torch.equal(out, ref), (out, ref)


@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss"])
def test_beam_matches_transformers(model_type):
    model = _model(model_type, seed=1)
    batch = tiny_batch(model, lengths=(12, 5), seed=4)
    kwargs = dict(**batch, do_sample=False, num_beams=2, max_new_tokens=8)
    with torch.no_grad():
        ref = model.generate(**kwargs)  # transformers' default path (DynamicCache, eager attention)
    with paged(model, **ENGINE):
        out = model.generate(**kwargs, cache_implementation="paged")
    assert torch.equal(out, ref), (out, ref)


def test_no_cache_forward_applies_window():
    """Without a paged cache (use_cache=False) the attention function still applies window / softcap exactly."""
    model = _model("gemma2")
    batch = tiny_batch(model, lengths=LENGTHS, seed=5)
    with torch.no_grad():
        ref = model(**batch, use_cache=False).logits
        with paged(model, **ENGINE):
            out = model(**batch, use_cache=False).logits
    m = batch["attention_mask"].bool()
    torch.testing.assert_close(out[m], ref[m], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["gpt_oss", "gemma2"])
def test_no_cache_forward_takes_long_prompts_in_query_chunks(family, monkeypatch):
    """The dense fallback bounds its scores (`DENSE_SCORES_BYTES`: query chunks; the engine's memory profiling runs a
    long prompt through it) and gives what one chunk gives: sinks and window (gpt-oss), softcap and window (Gemma 2)."""
    from hf_paged.attention import functions

    model = _model(family, seed=3)
    batch = tiny_batch(model, lengths=LENGTHS, seed=7)
    with torch.no_grad(), paged(model, **ENGINE):
        whole = model(**batch, use_cache=False).logits
        monkeypatch.setattr(functions, "DENSE_SCORES_BYTES", 1)  # one query row a chunk
        chunked = model(**batch, use_cache=False).logits
    m = batch["attention_mask"].bool()
    torch.testing.assert_close(chunked[m], whole[m], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["static", "compiled"])
def test_engine_static_and_compiled_decode(compiled):
    """The static-buffer decode (what CUDA graphs replay) and the compiled decode op get the layer's options too.

    The compiled variant is marked slow (about a minute of Inductor compilation on CPU)."""
    model = _model("gpt_oss", seed=2)  # sinks (a Parameter into the custom op) + sliding window
    prompts = [tiny_batch(model, lengths=(n,), seed=6 + n)["input_ids"][0].tolist() for n in (17, 9, 3)]
    with torch.no_grad():
        refs = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=9)[0, len(p):].tolist()
                for p in prompts]
    # two at a time: the third prompt is prefilled after the first decode step (by the compiled layers, if compiled)
    engine = hf_paged.Engine(model, block_size=8, max_num_seqs=2, compile_decode=compiled)
    engine.runner.decode_mode = "static"
    try:
        results = engine.generate(prompts, [hf_paged.SamplingParams(max_new_tokens=9) for _ in prompts])
        assert [r.outputs[0].token_ids for r in results] == refs
        assert engine.runner.graph_steps > 0
        assert (engine.runner.compiled_prefill_steps > 0) == compiled
    finally:
        engine.close()


def test_prefix_hits_with_windows():
    """Prompts sharing a 24-token prefix (3x the window): the second one prefills over cached blocks, same tokens."""
    model = _model("gemma3_text", seed=3)
    prefix = tiny_batch(model, lengths=(24,), seed=8)["input_ids"][0].tolist()
    prompts = [prefix + [5, 6, 7], prefix + [9, 10, 11, 12, 13]]
    with torch.no_grad():
        refs = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=6)[0, len(p):].tolist()
                for p in prompts]
    engine = hf_paged.Engine(model, block_size=8, max_num_seqs=4, enable_prefix_caching=True)
    try:
        first = engine.generate(prompts[:1], [hf_paged.SamplingParams(max_new_tokens=6)])
        second = engine.generate(prompts[1:], [hf_paged.SamplingParams(max_new_tokens=6)])
        assert [r.outputs[0].token_ids for r in first + second] == refs
        assert engine.prefix_cache_stats().hit_tokens >= 16  # the second prompt really prefilled over cached blocks
    finally:
        engine.close()
