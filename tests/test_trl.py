"""TRL's GRPOTrainer with `GRPOConfig(cache_implementation="paged")` after `hf_paged.enable(model)` (no vLLM): the
rollouts after every optimizer step are token-identical to transformers' own `generate` with the same weights, with
and without the prefix cache (K/V cached under the old weights must not be served after a step), and the
`num_generations` copies of a prompt share its blocks."""

from __future__ import annotations

import logging

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import hf_paged  # noqa: E402
from hf_paged.testing import tiny_model  # noqa: E402

try:
    from tests.helpers import tiny_word_tokenizer
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import tiny_word_tokenizer

PROMPTS = ["w10 w11 w12 w13 w14 w15 w16 w17 w18", "w40 w41 w42", "w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19",
           "w90 w91 w92 w93 w94"]


class RecordingGenerate:
    """Stands in for `model.generate`: runs the paged call TRL makes, then transformers' generate on the same inputs
    and weights (cache_implementation=None: DynamicCache), and records both."""

    def __init__(self, model) -> None:
        self.model, self.calls = model, []

    def __call__(self, *args, generation_config=None, **kwargs):
        model = self.model
        got = type(model).generate(model, *args, generation_config=generation_config, **kwargs)
        with torch.no_grad():
            expected = type(model).generate(model, *args, generation_config=generation_config,
                                            cache_implementation=None, **kwargs)
        self.calls.append((got.clone(), expected.clone(), next(model.parameters()).detach().clone()))
        return got


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no_prefix_cache", "prefix_cache"])
def test_grpo_rollouts_equal_transformers(tmp_path, prefix_caching, caplog):
    model = tiny_model("llama", seed=1)
    tokenizer = tiny_word_tokenizer(model.config.vocab_size)
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    hf_paged.enable(model, num_blocks=128, block_size=4, enable_prefix_caching=prefix_caching)
    recorder = RecordingGenerate(model)
    model.generate = recorder
    config = trl.GRPOConfig(
        output_dir=str(tmp_path), cache_implementation="paged", num_generations=2, per_device_train_batch_size=4,
        max_completion_length=6, max_steps=3, learning_rate=0.05, weight_decay=0.5, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, generation_kwargs={"do_sample": False},
        disable_tqdm=True, seed=0,
    )
    trainer = trl.GRPOTrainer(model=model, reward_funcs=_reward, args=config, processing_class=tokenizer,
                              train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS * 4}))
    with caplog.at_level(logging.INFO, logger="hf_paged.integrations.generate"):
        trainer.train()
    assert len(recorder.calls) >= 3
    for got, expected, _ in recorder.calls:
        assert torch.equal(got, expected)
    weights = [w for _, _, w in recorder.calls]
    assert any(not torch.equal(a, b) for a, b in zip(weights, weights[1:]))  # steps did change the weights
    if prefix_caching:  # the copies of each prompt were served from its cached blocks
        served = [int(r.getMessage().split("served ")[1].split()[0]) for r in caplog.records
                  if "distinct prompts; prefix cache served" in r.getMessage()]
        assert served and max(served) > 0, served
