"""Ragged (prefill / mixed) steps run at `padded_tokens` counts on CUDA, so that cuBLAS's per-shape heuristic cache
hits; the padding rows belong to no sequence; the output projection runs over a decode bucket's row count. Forced on
here on the CPU: tokens, prompt log-probabilities and the pool must not notice."""

from __future__ import annotations

import pytest

import hf_paged
from hf_paged.runner import shapes
from hf_paged.runner.shapes import padded_tokens
from hf_paged.testing import tiny_model

try:
    from tests.helpers import greedy_reference, random_prompts
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import greedy_reference, random_prompts


@pytest.mark.parametrize("tokens, limit, expected", [
    (1, None, 16), (16, None, 16), (17, None, 32), (256, None, 256), (257, None, 320), (300, 2048, 320),
    (2000, 2000, 2000), (1990, 2000, 2000), (2100, 2000, 2100), (16383, 16384, 16384)])
def test_padded_tokens_grid_and_limit(tokens, limit, expected):
    assert padded_tokens(tokens, limit) == expected


def test_padded_ragged_steps_keep_tokens_logprobs_and_pool():
    model = tiny_model("llama", seed=1)
    prompts = random_prompts((5, 9, 3, 12, 7, 4, 10, 6, 8, 11, 2, 13, 30, 1), seed=5)
    refs = [greedy_reference(model, p, 6) for p in prompts]
    results = {}
    for pad in (False, True):
        engine = hf_paged.Engine(model, num_blocks=128, block_size=4, max_num_seqs=5, max_num_batched_tokens=40)
        engine.runner.pad_ragged = pad
        make_step, padded_rows = engine.cache._make_step, []

        def spy(layout, slots, tables, lens, q_lens, device, _make=make_step, _rows=padded_rows):
            _rows.append(len(slots) - sum(q_lens))
            return _make(layout, slots, tables, lens, q_lens, device)

        engine.cache._make_step = spy
        params = [hf_paged.SamplingParams(max_new_tokens=6, prompt_logprobs_start=1 if len(p) > 1 else None)
                  for p in prompts]
        outs = engine.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == refs
        results[pad] = [o.prompt_logprobs for o in outs]
        assert (max(padded_rows) > 0) == pad  # chunked prompts beside decodes (budget 40): steps were padded
        assert engine.block_manager.gpu.num_free == engine.block_manager.num_blocks
        engine.close()
    for padded, plain in zip(results[True], results[False]):  # the same scores, to float32 rounding
        assert (padded is None) == (plain is None)
        if plain is not None:
            assert [g for _, g in padded] == [g for _, g in plain]
            assert max(abs(a - b) for (a, _), (b, _) in zip(padded, plain)) < 1e-5


@pytest.mark.parametrize("rows, expected", [
    ([7], [7]), ([3, 9, 20], [3, 9, 20, 20]), ([1, 2, 3, 4], [1, 2, 3, 4]), ([5] * 9, [5] * 16),
    (list(range(300)), list(range(300)))])  # past the largest bucket: as they are
def test_padded_rows_repeat_the_last_row_up_to_a_bucket(rows, expected):
    assert shapes.padded_rows(rows, shapes.decode_buckets(256)) == expected


@pytest.mark.parametrize("pad", [False, True])
def test_output_projection_of_a_ragged_step_runs_at_a_decode_bucket(pad):
    """Three prompts admitted together keep three rows of logits; padded, the output projection runs over four (the
    bucket above, the last row repeated) and the step hands back three: the same tokens."""
    model = tiny_model("llama", seed=2)
    prompts = random_prompts((5, 9, 7), seed=3)
    refs = [greedy_reference(model, p, 4) for p in prompts]
    engine = hf_paged.Engine(model, num_blocks=64, block_size=4, max_num_seqs=8)
    engine.runner.pad_ragged = pad
    assert 3 not in engine.runner._bucket_sizes and 4 in engine.runner._bucket_sizes
    rows = []
    hook = model.lm_head.register_forward_hook(lambda _m, args, _o: rows.append(args[0].shape[-2]))
    try:
        outs = engine.generate(prompts, max_new_tokens=4)
    finally:
        hook.remove()
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert rows[0] == (4 if pad else 3)  # the prefill step of all three
    engine.close()
