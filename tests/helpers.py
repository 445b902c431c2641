"""Shared helpers of the correctness tests (test_cache, test_generate, test_engine, test_smollm2).

The golden rule of these tests: greedy decoding (and transformers' beam search through the drop-in cache) is
token-identical to transformers with its default ``DynamicCache`` on CPU float32. References are always computed on
the *plain* model (``dense(model)``: hf_paged disabled, attention implementation "sdpa"), never through the paged
model's SDPA fallback.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

import hf_paged
from hf_paged.model_zoo import tiny_model as zoo_model
from hf_paged.testing import tiny_model

__all__ = [
    "LM_EVAL_QA",
    "RecordingStreamer",
    "dense",
    "dense_generate",
    "greedy_reference",
    "is_enabled",
    "model_for",
    "paged",
    "random_prompts",
    "restore_generation_config",
    "tiny_word_tokenizer",
    "write_lm_eval_gen_task",
]

# a tiny lm-eval `generate_until` task (questions with one-word answers, stop sequences), for the lm-eval backend's
# tests and the server's under lm-eval's chat-completions model
LM_EVAL_QA = [
    ("The capital of France is", "Paris"),
    ("Two plus two equals", "four"),
    ("The color of the sky on a clear day is", "blue"),
    ("Water freezes at zero degrees", "Celsius"),
    ("The opposite of hot is", "cold"),
]
_GEN_TASK_YAML = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write_lm_eval_gen_task(root: Path, qa: list[tuple[str, str]] = LM_EVAL_QA) -> None:
    """Write the `tiny_gen` task (its YAML and `qa` as JSONL) into `root`, for `TaskManager(include_path=root)`."""
    data = Path(root) / "gen.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in qa))
    (Path(root) / "tiny_gen.yaml").write_text(_GEN_TASK_YAML.format(path=data))


@functools.cache
def model_for(family: str, seed: int = 0):
    """One plain tiny model per (family, seed) for the whole session. Tests must leave it plain (use `paged`)."""
    return tiny_model(family, seed=seed)


def is_enabled(model) -> bool:
    return getattr(type(model), "_hf_paged_base", None) is not None


@contextlib.contextmanager
def dense(model):
    """The model as plain transformers (hf_paged disabled, sdpa attention) inside the block; restored after."""
    was_enabled = is_enabled(model)
    kwargs = dict(getattr(model, "_hf_paged_engine_kwargs", None) or {})
    if was_enabled:
        hf_paged.disable(model)
    assert model.config._attn_implementation != hf_paged.ATTENTION_NAME
    try:
        yield model
    finally:
        if was_enabled:
            hf_paged.enable(model, **kwargs)


@contextlib.contextmanager
def paged(model, **engine_kwargs):
    """`hf_paged.enable(model, **engine_kwargs)` inside the block; the model is plain again after it."""
    was_enabled = is_enabled(model)
    hf_paged.enable(model, **engine_kwargs)
    assert model.config._attn_implementation == hf_paged.ATTENTION_NAME
    try:
        yield model
    finally:
        if not was_enabled:
            hf_paged.disable(model)
            if hasattr(model, "_hf_paged_engine_kwargs"):
                del model._hf_paged_engine_kwargs


@contextlib.contextmanager
def restore_generation_config(model):
    saved = copy.deepcopy(model.generation_config)
    try:
        yield model.generation_config
    finally:
        model.generation_config = saved


def dense_generate(model, **kwargs):
    """transformers' own generate() with its default DynamicCache on the plain model."""
    with dense(model), torch.no_grad():
        return model.generate(**kwargs)


def random_prompts(lengths, seed: int = 0, vocab: int = 384) -> list[list[int]]:
    """Token lists (ids avoid pad/bos/eos = 0/1/2)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def generating_model(family: str, **overrides):
    """A tiny seeded model of any `family` of the sweep (`hf_paged.model_zoo`) whose generation config names pad / bos / eos 0 / 1 / 2 (what the prompts of
    `random_prompts` avoid)."""
    model = zoo_model(family, **overrides)
    model.generation_config = GenerationConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return model


def greedy_references(model, lengths, seed: int, new: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts of `lengths`, transformers' greedy continuation of each: `new` tokens, eos ignored)."""
    prompts = random_prompts(lengths, seed=seed, vocab=200)
    outs = [dense_generate(model, input_ids=torch.tensor([p]), max_new_tokens=new, do_sample=False,
                           eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    return prompts, outs


def engine_greedy(engine, prompts, new: int = 8) -> list[list[int]]:
    """`engine`'s greedy tokens of `prompts`: `new` each, eos ignored (what `greedy_references` gives)."""
    outs = engine.generate(prompts, hf_paged.SamplingParams(max_new_tokens=new, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def assert_all_returned(engine) -> None:
    """Nothing left running, and every block (device and CPU), every state slot and every sequence record back."""
    stats = engine.kv_stats()
    assert not engine.has_unfinished()
    assert stats.used_blocks == 0 and stats.cpu_used_blocks == 0, stats
    assert stats.state_slots_used == 0 and stats.state_cpu_slots_used == 0, stats
    assert engine.block_manager.seq_ids() == []


def left_padded_batch(lengths, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of a left-padded batch of random prompts of `lengths` (ids 3..199)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, n in enumerate(lengths):
        input_ids[row, width - n:] = torch.randint(3, 200, (n,), generator=g)
        mask[row, width - n:] = 1
    return input_ids, mask


def greedy_reference(model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """New tokens of transformers' greedy generate() for one unpadded prompt (stops at the model's eos)."""
    out = dense_generate(
        model, input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, **kwargs
    )
    return out[0, len(prompt) :].tolist()


class RecordingStreamer(BaseStreamer):
    """Records every `put` (as a list) and counts `end` calls, like TextStreamer without a tokenizer."""

    def __init__(self):
        self.puts: list[list] = []
        self.ends = 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ends += 1


@functools.cache
def tiny_word_tokenizer(vocab_size: int = 384):
    """An offline word-level tokenizer over the tiny models' vocabulary: token i <-> the word ``w{i}``.

    Decoding joins words with spaces, so a 3-digit token's word appears in decoded text only when that token is
    there (the vocabulary has no 4-digit ids). Ids 0/1/2 are <pad>/<s>/</s>.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {0: "<pad>", 1: "<s>", 2: "</s>"}
    vocab = {specials.get(i, f"w{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<pad>"
    )
