"""`model.generate(..., cache_implementation="paged")` after `hf_paged.enable(model)` vs transformers' generate().

The paged path runs the request batch through `hf_paged.Engine` and must return exactly what transformers returns
(same tensor shape, prompt part, pad-after-eos convention), token-identical for greedy decoding.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

import hf_paged
from hf_paged.integrations import generate as paged_generate_module
from hf_paged.testing import FAMILIES, tiny_batch, tiny_model

try:
    from tests.helpers import RecordingStreamer, dense, dense_generate, model_for, paged, restore_generation_config
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import RecordingStreamer, dense, dense_generate, model_for, paged, restore_generation_config

ENGINE = dict(num_blocks=256, block_size=8)
MIXED = tuple((7 * i) % 23 + 1 for i in range(17))  # 17 prompts, lengths 1..23


def mixed_batch(model, seed=0, lengths=MIXED):
    return tiny_batch(model, lengths=lengths, seed=seed)


# ----------------------------------------------------------------------------------------------- greedy == transformers


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_batch_matches_transformers(family):
    model = model_for(family)
    batch = mixed_batch(model, seed=1)
    kwargs = dict(**batch, do_sample=False, max_new_tokens=12)
    ref = dense_generate(model, **kwargs)
    with paged(model, **ENGINE):
        out = model.generate(**kwargs, cache_implementation="paged")
        engine = model._hf_paged_engine
        assert engine is not None and engine.stats["steps"] > 0  # really went through the engine
        assert engine.kv_stats().used_blocks == 0
    assert isinstance(out, torch.Tensor) and out.dtype == ref.dtype
    assert out.shape == ref.shape
    assert torch.equal(out, ref)


def test_int32_and_positional_inputs_match_transformers():
    model = model_for("mistral")
    batch = mixed_batch(model, seed=2, lengths=(3, 9, 14))
    ref = dense_generate(model, **batch, do_sample=False, max_new_tokens=9)
    with paged(model, **ENGINE):
        out32 = model.generate(
            input_ids=batch["input_ids"].int(), attention_mask=batch["attention_mask"], do_sample=False,
            max_new_tokens=9, cache_implementation="paged",
        )
        out_positional = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"],
                                        do_sample=False, max_new_tokens=9, cache_implementation="paged")
    assert torch.equal(out32.long(), ref) and torch.equal(out_positional, ref)


@pytest.mark.parametrize("lengths", [(3, 9, 14), (25, 4)], ids=["width14", "width25"])
def test_default_generation_length_matches_transformers(lengths):
    model = model_for("mistral")
    batch = mixed_batch(model, seed=2, lengths=lengths)
    ref = dense_generate(model, **batch, do_sample=False)
    assert ref.shape[1] == batch["input_ids"].shape[1] + 20
    with paged(model, **ENGINE):
        out = model.generate(**batch, do_sample=False, cache_implementation="paged")
    assert torch.equal(out, ref)


@pytest.mark.parametrize(
    "options",
    [
        dict(repetition_penalty=1.3),
        dict(min_new_tokens=9),
        dict(eos_token_id=[2, 245, 350]),
        dict(max_length=30, max_new_tokens=None),
    ],
    ids=["repetition_penalty", "min_new_tokens", "eos_list", "max_length"],
)
def test_greedy_generation_options_match_transformers(options):
    model = model_for("gpt2")
    batch = mixed_batch(model, seed=3, lengths=(4, 9, 2, 7, 16))
    kwargs = dict(**batch, do_sample=False, max_new_tokens=12)
    kwargs.update(options)
    ref = dense_generate(model, **kwargs)
    with paged(model, **ENGINE):
        out = model.generate(**kwargs, cache_implementation="paged")
    assert torch.equal(out, ref)


def test_left_padded_batch_without_attention_mask_matches_transformers():
    model = model_for("qwen2")
    ids = mixed_batch(model, seed=4, lengths=(4, 9, 6))["input_ids"]  # pad = 0 in the first columns
    ref = dense_generate(model, input_ids=ids, do_sample=False, max_new_tokens=10)
    with paged(model, **ENGINE):
        out = model.generate(input_ids=ids, do_sample=False, max_new_tokens=10, cache_implementation="paged")
    assert torch.equal(out, ref)


# ----------------------------------------------------------------------------------------------- dict output / scores


def test_return_dict_with_scores_matches_transformers():
    model = model_for("llama")
    batch = mixed_batch(model, seed=1)
    width = batch["input_ids"].shape[1]
    kwargs = dict(**batch, do_sample=False, max_new_tokens=12, return_dict_in_generate=True, output_scores=True)
    ref = dense_generate(model, **kwargs)
    with paged(model, **ENGINE):
        out = model.generate(**kwargs, cache_implementation="paged")
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert torch.equal(out.sequences, ref.sequences)
    assert isinstance(out.scores, tuple) and len(out.scores) == len(ref.scores) == ref.sequences.shape[1] - width
    eos = model.generation_config.eos_token_id
    finished = torch.zeros(ref.sequences.shape[0], dtype=torch.bool)
    saw_finished_row = False
    for step, (got, expected) in enumerate(zip(out.scores, ref.scores)):
        assert got.shape == expected.shape == (ref.sequences.shape[0], model.config.vocab_size)
        assert got.dtype == expected.dtype
        running = ~finished
        torch.testing.assert_close(got[running], expected[running], atol=1e-4, rtol=1e-4)
        saw_finished_row |= bool(finished.any())
        finished |= ref.sequences[:, width + step] == eos
    assert saw_finished_row  # this batch has rows that stop at eos early: the running-row mask mattered


def test_processed_scores_with_repetition_penalty_match_transformers():
    """Scores are the processed ones (after the repetition penalty), as in transformers. Unpadded batch."""
    model = model_for("llama")
    batch = mixed_batch(model, seed=21, lengths=(9, 9, 9, 9))
    kwargs = dict(**batch, do_sample=False, max_new_tokens=10, repetition_penalty=1.4,
                  return_dict_in_generate=True, output_scores=True, eos_token_id=None)
    ref = dense_generate(model, **kwargs)
    with paged(model, **ENGINE):
        out = model.generate(**kwargs, cache_implementation="paged")
    assert torch.equal(out.sequences, ref.sequences)
    for got, expected in zip(out.scores, ref.scores):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_repetition_penalty_with_left_padding_matches_transformers():
    model = model_for("llama")
    batch = mixed_batch(model, seed=1)
    kwargs = dict(**batch, do_sample=False, max_new_tokens=12, repetition_penalty=1.4)
    ref = dense_generate(model, **kwargs)
    with paged(model, **ENGINE):
        out = model.generate(**kwargs, cache_implementation="paged")
    assert torch.equal(out, ref)


def test_return_dict_without_scores():
    model = model_for("llama")
    batch = mixed_batch(model, seed=5, lengths=(3, 8))
    kwargs = dict(**batch, do_sample=False, max_new_tokens=5, return_dict_in_generate=True)
    ref = dense_generate(model, **kwargs)
    with paged(model, **ENGINE):
        out = model.generate(**kwargs, cache_implementation="paged")
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert torch.equal(out.sequences, ref.sequences) and out.scores is None


# ----------------------------------------------------------------------------------------------- eos


def test_eos_mid_generation_pads_like_transformers():
    model = model_for("gpt2")
    batch = mixed_batch(model, seed=6, lengths=(4, 9, 2, 7, 12, 5))
    width = batch["input_ids"].shape[1]
    kwargs = dict(**batch, do_sample=False, max_new_tokens=12)
    plain = dense_generate(model, **kwargs)
    eos = int(plain[1, width + 5])  # a token row 1 produces mid-way (and maybe other rows too)
    with restore_generation_config(model) as config:
        config.eos_token_id = eos
        ref = dense_generate(model, **kwargs)
        assert (ref[:, width:] == eos).any()
        assert ref.shape[1] <= plain.shape[1]
        assert (ref[1, width + 6 :] == config.pad_token_id).all()  # transformers pads after eos
        with paged(model, **ENGINE):
            out = model.generate(**kwargs, cache_implementation="paged")
    assert out.shape == ref.shape
    assert torch.equal(out, ref)


def test_all_rows_stop_early_gives_transformers_width():
    model = model_for("gpt2")
    batch = mixed_batch(model, seed=6, lengths=(4, 9))
    width = batch["input_ids"].shape[1]
    plain = dense_generate(model, **batch, do_sample=False, max_new_tokens=12)
    eos = [int(plain[0, width + 2]), int(plain[1, width + 3])]
    kwargs = dict(**batch, do_sample=False, max_new_tokens=12, eos_token_id=eos, pad_token_id=5)
    ref = dense_generate(model, **kwargs)
    assert ref.shape[1] < plain.shape[1]
    with paged(model, **ENGINE):
        out = model.generate(**kwargs, cache_implementation="paged")
    assert torch.equal(out, ref)


# ----------------------------------------------------------------------------------------------- sampling / configs


def test_num_return_sequences_with_sampling():
    model = model_for("qwen3")
    batch = mixed_batch(model, seed=7, lengths=(5, 11, 3, 8))
    width = batch["input_ids"].shape[1]
    with paged(model, **ENGINE):
        out = model.generate(**batch, do_sample=True, num_return_sequences=3, max_new_tokens=8,
                             cache_implementation="paged")
        assert model._hf_paged_engine.kv_stats().used_blocks == 0
    assert out.shape[0] == 3 * 4 and width < out.shape[1] <= width + 8
    assert torch.equal(out[:, :width], batch["input_ids"].repeat_interleave(3, dim=0))
    groups = out[:, width:].view(4, 3, -1)
    assert any(len({tuple(r.tolist()) for r in g}) > 1 for g in groups)  # samples differ


def test_generation_config_argument_is_honoured():
    model = model_for("phi3")
    batch = mixed_batch(model, seed=8, lengths=(5, 11, 3))
    width = batch["input_ids"].shape[1]
    plain = dense_generate(model, **batch, do_sample=False, max_new_tokens=8)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=int(plain[0, width + 2]), pad_token_id=7)
    ref = dense_generate(model, **batch, generation_config=config)
    assert ref.shape[1] == width + 6 and (ref == 7).any()
    with paged(model, **ENGINE):
        out = model.generate(**batch, generation_config=config, cache_implementation="paged")
    assert torch.equal(out, ref)


def test_cache_implementation_inside_generation_config_routes_to_hf_paged(monkeypatch):
    """Pipelines put cache_implementation="paged" into the GenerationConfig instead of passing the kwarg."""
    model = model_for("opt")
    batch = mixed_batch(model, seed=9, lengths=(5, 11, 3))
    config = GenerationConfig(max_new_tokens=7, do_sample=False, eos_token_id=2, pad_token_id=0)
    ref = dense_generate(model, **batch, generation_config=config)
    calls = []
    original = paged_generate_module.paged_generate

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(paged_generate_module, "paged_generate", spy)
    paged_config = GenerationConfig(**config.to_dict())
    paged_config.cache_implementation = "paged"
    with paged(model, **ENGINE):
        out = model.generate(**batch, generation_config=paged_config)
        assert calls == [1]
        steps = model._hf_paged_engine.stats["steps"]
        assert steps > 0
        assert paged_config.cache_implementation == "paged"  # the caller's config is not modified
        # also through the model's own generation_config
        with restore_generation_config(model) as own:
            own.cache_implementation = "paged"
            out_own = model.generate(**batch, max_new_tokens=7, do_sample=False)
            assert calls == [1, 1]
            assert model._hf_paged_engine.stats["steps"] > steps
    assert torch.equal(out, ref) and torch.equal(out_own, ref)


def test_explicit_cache_with_paged_in_a_passed_generation_config_uses_transformers_loop():
    model = model_for("opt")
    batch = mixed_batch(model, seed=9, lengths=(5, 11, 3))
    ref = dense_generate(model, **batch, max_new_tokens=7, do_sample=False)
    config = GenerationConfig(max_new_tokens=7, do_sample=False, cache_implementation="paged")
    with paged(model, **ENGINE):
        cache = hf_paged.PagedCache(config=model.config, num_blocks=32, block_size=8)
        out = model.generate(**batch, generation_config=config, past_key_values=cache)
        assert cache.stats().used_blocks > 0  # transformers' loop wrote into the drop-in cache
    assert torch.equal(out, ref)


def test_explicit_cache_wins_over_paged_in_the_models_generation_config():
    model = model_for("opt")
    batch = mixed_batch(model, seed=9, lengths=(5, 11, 3))
    ref = dense_generate(model, **batch, max_new_tokens=7, do_sample=False)
    with paged(model, **ENGINE), restore_generation_config(model) as own:
        own.cache_implementation = "paged"
        cache = hf_paged.PagedCache(config=model.config, num_blocks=32, block_size=8)
        out = model.generate(**batch, max_new_tokens=7, do_sample=False, past_key_values=cache)
    assert torch.equal(out, ref)


# ----------------------------------------------------------------------------------------------- streamer


def test_streamer_receives_prompt_then_each_token_like_transformers():
    model = model_for("llama")
    ids = tiny_batch(model, lengths=(6,), seed=10)["input_ids"]
    ref_streamer = RecordingStreamer()
    ref = dense_generate(model, input_ids=ids, max_new_tokens=7, do_sample=False, streamer=ref_streamer)
    streamer = RecordingStreamer()
    with paged(model, **ENGINE):
        out = model.generate(input_ids=ids, max_new_tokens=7, do_sample=False, streamer=streamer,
                             cache_implementation="paged")
    assert torch.equal(out, ref)
    assert streamer.puts[0] == ids.tolist()
    assert len(streamer.puts) == 1 + (ref.shape[1] - ids.shape[1])
    assert streamer.puts == ref_streamer.puts
    assert streamer.ends == ref_streamer.ends == 1


def test_streamer_with_eos_stops_like_transformers():
    model = model_for("llama")
    ids = tiny_batch(model, lengths=(6,), seed=10)["input_ids"]
    plain = dense_generate(model, input_ids=ids, max_new_tokens=7, do_sample=False)
    eos = int(plain[0, ids.shape[1] + 3])
    ref_streamer, streamer = RecordingStreamer(), RecordingStreamer()
    ref = dense_generate(model, input_ids=ids, max_new_tokens=7, do_sample=False, eos_token_id=eos,
                         streamer=ref_streamer)
    with paged(model, **ENGINE):
        out = model.generate(input_ids=ids, max_new_tokens=7, do_sample=False, eos_token_id=eos, streamer=streamer,
                             cache_implementation="paged")
    assert torch.equal(out, ref)
    assert streamer.puts == ref_streamer.puts and streamer.ends == 1


class _InterruptingStreamer(RecordingStreamer):
    def put(self, value):
        super().put(value)
        if len(self.puts) == 3:
            raise KeyboardInterrupt  # e.g. the client went away


def test_streamer_exception_aborts_the_request():
    model = model_for("llama")
    ids = tiny_batch(model, lengths=(6,), seed=10)["input_ids"]
    with paged(model, **ENGINE):
        with pytest.raises(KeyboardInterrupt):
            model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, streamer=_InterruptingStreamer(),
                           cache_implementation="paged")
        engine = model._hf_paged_engine
        assert not engine.has_unfinished()
        assert engine.kv_stats().used_blocks == 0


def test_failing_forward_raises_and_frees_the_engine():
    model = model_for("llama")
    batch = mixed_batch(model, seed=15, lengths=(4, 9, 6))
    ref = dense_generate(model, **batch, max_new_tokens=5, do_sample=False)

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    with paged(model, **ENGINE):
        model.forward = broken
        try:
            with pytest.raises(RuntimeError, match="injected failure"):
                model.generate(**batch, max_new_tokens=5, do_sample=False, cache_implementation="paged")
        finally:
            del model.forward
        engine = model._hf_paged_engine
        assert engine.kv_stats().used_blocks == 0 and not engine.has_unfinished()
        out = model.generate(**batch, max_new_tokens=5, do_sample=False, cache_implementation="paged")
    assert torch.equal(out, ref)


def test_default_sampling_keeps_transformers_top_k_50():
    """transformers samples from the 50 most likely tokens by default (top_k=50); so must the paged path."""
    model = model_for("llama")
    prompts = [tiny_batch(model, lengths=(n,), seed=16 + n)["input_ids"] for n in (3, 8, 5)]
    with paged(model, **ENGINE):
        torch.manual_seed(0)
        outs = [model.generate(input_ids=p, do_sample=True, temperature=4.0, max_new_tokens=12, eos_token_id=None,
                               cache_implementation="paged") for p in prompts]
    with dense(model), torch.no_grad():
        for prompt, out in zip(prompts, outs):
            logits = model(input_ids=out).logits[0]
            for pos in range(prompt.shape[1], out.shape[1]):
                token = out[0, pos]
                rank = int((logits[pos - 1] > logits[pos - 1, token]).sum())
                assert rank < 50, f"sampled a token of rank {rank}"


# ----------------------------------------------------------------------------------------------- bad input


def _bad_cases(batch):
    ids, mask = batch["input_ids"], batch["attention_mask"]
    return {
        "empty_prompt": (dict(input_ids=torch.zeros((1, 0), dtype=torch.long), attention_mask=None), ValueError,
                         "input_ids"),
        "max_new_tokens_0": (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        "max_new_tokens_negative": (dict(max_new_tokens=-2), ValueError, "max_new_tokens"),
        "beyond_max_position_embeddings": (dict(max_new_tokens=510), ValueError, "max_position_embeddings"),
        "float_input_ids": (dict(input_ids=ids.float()), TypeError, "input_ids"),
        "list_input_ids": (dict(input_ids=ids.tolist()), TypeError, "input_ids"),
        "no_repeat_ngram_size": (dict(no_repeat_ngram_size=2), ValueError, "no_repeat_ngram_size"),
        "num_beams_2_sampling": (dict(num_beams=2, do_sample=True), ValueError, "num_beams"),
        "num_return_sequences_above_num_beams": (dict(num_beams=2, num_return_sequences=3), ValueError,
                                                 "num_return_sequences"),
        "streamer_with_beams": (dict(input_ids=ids[:1], attention_mask=mask[:1], num_beams=2,
                                     streamer=RecordingStreamer()), ValueError, "streamer"),
        "unknown_kwarg": (dict(frobnicate=3), TypeError, "frobnicate"),
        "streamer_batch_2": (dict(streamer=RecordingStreamer()), ValueError, "streamer"),
        "top_p_1.5": (dict(do_sample=True, top_p=1.5), ValueError, "top_p"),
        "temperature_0_sampling": (dict(do_sample=True, temperature=0.0), ValueError, "temperature"),
        "greedy_num_return_sequences": (dict(num_return_sequences=2), ValueError, "num_return_sequences"),
        "mask_shape": (dict(attention_mask=mask[:, 1:]), ValueError, "attention_mask"),
        "past_key_values_and_paged": (dict(past_key_values=object()), ValueError, "past_key_values"),
        "stopping_criteria_not_callable": (dict(stopping_criteria=[3]), TypeError, "stopping_criteria"),
        "stop_strings_without_tokenizer": (dict(stop_strings=["x"]), ValueError, "tokenizer"),
    }


BAD_CASE_NAMES = sorted(_bad_cases({"input_ids": torch.zeros(1, 2, dtype=torch.long),
                                    "attention_mask": torch.ones(1, 2, dtype=torch.long)}))


@pytest.mark.parametrize("case", BAD_CASE_NAMES)
def test_bad_input_raises_naming_the_argument(case):
    model = model_for("llama")
    batch = mixed_batch(model, seed=11, lengths=(4, 9))
    overrides, error, name = _bad_cases(batch)[case]
    kwargs = dict(**batch, max_new_tokens=4, do_sample=False, cache_implementation="paged")
    kwargs.update(overrides)
    with paged(model, **ENGINE):
        with pytest.raises(error, match=name):
            model.generate(**kwargs)
        engine = getattr(model, "_hf_paged_engine", None)
        if engine is not None:
            assert engine.kv_stats().used_blocks == 0 and not engine.has_unfinished()


def test_request_that_can_never_fit_the_pool_raises():
    model = tiny_model("llama", seed=0)
    batch = mixed_batch(model, seed=12, lengths=(4, 9))
    with paged(model, num_blocks=4, block_size=8):
        with pytest.raises(ValueError, match="num_blocks"):
            model.generate(**batch, max_new_tokens=40, do_sample=False, cache_implementation="paged")
        engine = model._hf_paged_engine
        assert engine.kv_stats().used_blocks == 0 and not engine.has_unfinished()
        # a request that fits still works afterwards
        ref_len = batch["input_ids"].shape[1] + 3
        assert model.generate(**batch, max_new_tokens=3, do_sample=False,
                              cache_implementation="paged").shape[1] <= ref_len


def test_enable_refuses_unsupported_config():
    config = AutoConfig.for_model(
        "gemma", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, use_bidirectional_attention=True,
    )
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError) as info:
        hf_paged.enable(model)
    message = str(info.value)
    assert "bidirectional" in message and "'non_causal'" in message
    assert not hasattr(type(model), "_hf_paged_base")  # nothing was changed
    assert model.config._attn_implementation != hf_paged.ATTENTION_NAME


def test_disable_restores_plain_transformers():
    model = tiny_model("llama", seed=0)
    batch = mixed_batch(model, seed=13, lengths=(3, 7))
    cls, attn = type(model), model.config._attn_implementation
    ref = model.generate(**batch, do_sample=False, max_new_tokens=5)
    hf_paged.enable(model, **ENGINE)
    assert model.generate(**batch, do_sample=False, max_new_tokens=5, cache_implementation="paged").equal(ref)
    hf_paged.disable(model)
    assert type(model) is cls and model.config._attn_implementation == attn
    assert model.generate(**batch, do_sample=False, max_new_tokens=5).equal(ref)


# ----------------------------------------------------------------------------------------------- generate_paged


def test_generate_paged_keeps_input_order_and_per_request_params():
    model = model_for("granite")
    lengths = (13, 2, 7, 20, 5)
    batch = mixed_batch(model, seed=14, lengths=lengths)
    width = batch["input_ids"].shape[1]
    prompts = [row[width - n :].tolist() for row, n in zip(batch["input_ids"], lengths)]
    max_new = [3, 9, 1, 6, 4]
    with dense(model):
        refs = []
        for prompt, n in zip(prompts, max_new):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
            refs.append(out[0, len(prompt) :].tolist())
    params = [hf_paged.SamplingParams(max_new_tokens=n) for n in max_new]
    with paged(model, **ENGINE):
        results = model.generate_paged(prompts, params)
        shared = model.generate_paged(prompts, max_new_tokens=4)
        engine = model._hf_paged_engine
        assert engine.kv_stats().used_blocks == 0
    assert [r.prompt_token_ids for r in results] == prompts
    assert [r.outputs[0].token_ids for r in results] == refs
    assert all(r.finished and r.error is None for r in results)
    assert [r.prompt_token_ids for r in shared] == prompts
    for r, ref in zip(shared, refs):  # greedy is deterministic: the common prefix agrees
        got = r.outputs[0].token_ids
        assert 0 < len(got) <= 4
        assert got[: len(ref)] == ref[: len(got)]
    # the caller's SamplingParams objects are not mutated (eos defaults are filled into copies)
    assert all(p.eos_token_id == () for p in params)


def test_generate_paged_params_length_mismatch_raises():
    model = model_for("granite")
    with paged(model, **ENGINE):
        with pytest.raises(ValueError, match="params"):
            model.generate_paged([[5, 6], [7, 8]], [hf_paged.SamplingParams()])
        assert not model._hf_paged_engine.has_unfinished()
