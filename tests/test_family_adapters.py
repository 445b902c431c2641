"""Families the architecture sweep once refused, each checked where the sweep's one short batch would not catch a
regression: greedy tokens of the engine (one step and chunked prefill, so prefill chunks and decodes share steps)
against transformers' own `generate()`, on tiny seeded models (float32, CPU).

* Zaya: its CCA projection is a recurrent mixer that returns query, key and value (a tuple) and its attention picks
  the model's own causal mask out of a mapping (`attention_mask_modified` no longer reported for it).
"""

from __future__ import annotations

import functools

import pytest

import hf_paged

try:
    from tests.helpers import generating_model, greedy_references
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import generating_model, greedy_references


@functools.cache
def family_model(family: str):
    return generating_model(family)


def engine_greedy(model, prompts, new: int, **kwargs) -> list[list[int]]:
    engine = hf_paged.Engine(model, num_blocks=96, block_size=4, **kwargs)
    outs = engine.generate(prompts, hf_paged.SamplingParams(max_new_tokens=new, ignore_eos=True))
    assert not engine.has_unfinished() and engine.kv_stats().used_blocks == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("chunked", [False, True])
def test_zaya_matches_transformers_on_the_engine(chunked):
    model = family_model("zaya")
    assert "attention_mask_modified" not in hf_paged.attention.model_features(model)
    prompts, refs = greedy_references(model, (1, 23, 7, 17, 3), seed=5, new=8)
    kwargs = dict(max_num_batched_tokens=6, max_num_seqs=3) if chunked else {}
    assert engine_greedy(model, prompts, 8, **kwargs) == refs


def test_a_mask_the_module_builds_itself_is_still_refused():
    """Doge hands the attention function a dynamic mask built from its hidden states: still refused."""
    features = hf_paged.attention.model_features(family_model("doge"))
    assert "attention_mask_modified" in features and "attn_mask" in features["attention_mask_modified"]
