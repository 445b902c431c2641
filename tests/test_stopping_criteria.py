"""`stopping_criteria` on the paged path: evaluated per row with transformers' semantics (tokens identical to
transformers' own generate for per-row criteria), batch-stateful criteria (lm-eval's `done_tracker` kind) split per
row, the engine's `SamplingParams.stopping_criteria`, and `max_length` with an inferred attention mask."""

from __future__ import annotations

import pytest
import torch
from transformers import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList

from hf_paged.engine import SamplingParams
from hf_paged.testing import tiny_batch

try:
    from tests.helpers import dense, model_for, paged
except ImportError:  # run from inside tests/
    from helpers import dense, model_for, paged

ENGINE = dict(num_blocks=128, block_size=8)
LENGTHS = (5, 9, 3)


class StopOnToken(StoppingCriteria):
    """Per-row: a row stops once its last token is `token` (a BoolTensor per row, as transformers' own)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


class BatchTracker(StoppingCriteria):
    """lm-eval's `MultiTokenEOSCriteria` shape: a `done_tracker` sized to the batch, True when every row is done."""

    def __init__(self, token: int, start: int, batch: int) -> None:
        self.token, self.start, self.done_tracker = token, start, [False] * batch

    def __call__(self, input_ids, scores, **kwargs):
        for i in range(len(self.done_tracker)):
            if not self.done_tracker[i]:
                self.done_tracker[i] = self.token in input_ids[i, self.start:].tolist()
        return False not in self.done_tracker


def _generate(model, batch, **kwargs):
    return model.generate(**batch, do_sample=False, pad_token_id=0, **kwargs)


def _reference(model, batch, max_new_tokens=12):
    with dense(model):
        return _generate(model, batch, max_new_tokens=max_new_tokens)


def test_per_row_criteria_match_transformers():
    model = model_for("llama")
    batch = tiny_batch(model, lengths=LENGTHS, seed=3)
    plain = _reference(model, batch)
    width = batch["input_ids"].shape[1]
    token = int(plain[1, width + 2])  # row 1 stops after its third token, the others when (if) they produce it
    criteria = StoppingCriteriaList([StopOnToken(token), MaxLengthCriteria(width + 10)])
    with dense(model):
        expected = _generate(model, batch, max_new_tokens=12, stopping_criteria=criteria)
    with paged(model, **ENGINE):
        got = _generate(model, batch, max_new_tokens=12, stopping_criteria=criteria,
                        cache_implementation="paged")
    assert expected.shape[1] < plain.shape[1]  # the criteria did stop something
    assert torch.equal(got, expected)


def test_batch_stateful_criterion_is_split_per_row():
    model = model_for("llama")
    batch = tiny_batch(model, lengths=LENGTHS, seed=4)
    plain = _reference(model, batch)
    width = batch["input_ids"].shape[1]
    token = int(plain[0, width + 1])
    tracker = BatchTracker(token, width, batch["input_ids"].shape[0])
    with paged(model, **ENGINE):
        got = _generate(model, batch, max_new_tokens=12, stopping_criteria=[tracker],
                        cache_implementation="paged")
    assert tracker.done_tracker == [False] * 3  # the caller's object was not mutated: each row used its own copy
    for row in range(plain.shape[0]):
        new = plain[row, width:].tolist()
        stop = new.index(token) + 1 if token in new else len(new)
        assert got[row, width:width + stop].tolist() == new[:stop]
        assert (got[row, width + stop:] == 0).all()  # nothing after this row's own stop (pad fill)


def test_max_length_and_inferred_mask_as_lm_eval_calls_it():
    """lm-eval's call: left-padded input_ids, no attention_mask, pad_token_id, max_length, stopping_criteria."""
    model = model_for("llama")
    batch = tiny_batch(model, lengths=LENGTHS, seed=5)
    ids = batch["input_ids"]
    width = ids.shape[1]
    criteria = StoppingCriteriaList([StopOnToken(-1)])  # never fires: only max_length ends the rows
    with dense(model):
        expected = model.generate(input_ids=ids, max_length=width + 6, stopping_criteria=criteria, pad_token_id=0,
                                  use_cache=True, do_sample=False)
    with paged(model, **ENGINE):
        got = model.generate(input_ids=ids, max_length=width + 6, stopping_criteria=criteria, pad_token_id=0,
                             use_cache=True, do_sample=False, cache_implementation="paged")
    assert got.shape[1] == width + 6
    assert torch.equal(got, expected)


def test_engine_sampling_params_stopping_criteria():
    model = model_for("llama")
    prompt = tiny_batch(model, lengths=(6,), seed=6)["input_ids"][0].tolist()
    seen = []

    def stop_after_four(input_ids, scores):
        seen.append(input_ids.shape)
        return input_ids.shape[1] >= len(prompt) + 4

    with paged(model, **ENGINE):
        free = model.generate_paged([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
        out = model.generate_paged([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True,
                                                            stopping_criteria=stop_after_four))[0]
    assert out.outputs[0].token_ids == free.outputs[0].token_ids[:4]
    assert out.outputs[0].finish_reason in ("stop", "stopping_criteria")
    assert all(shape[0] == 1 for shape in seen)


def test_bad_criteria_name_the_argument():
    with pytest.raises(TypeError, match="stopping_criteria"):
        SamplingParams(stopping_criteria=[3])
    with pytest.raises(ValueError, match="stopping_criteria"):
        SamplingParams(num_beams=2, stopping_criteria=[lambda ids, scores: False])
