"""`hf_paged.integrations.gguf`: loading a GGUF checkpoint through transformers, with the tokenizer's eos / pad put back
from the GGUF metadata (transformers' conversion makes eos the bos token and drops pad)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig

from hf_paged.integrations.gguf import fix_gguf_tokenizer, load_gguf

try:
    from tests.helpers import tiny_word_tokenizer
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import tiny_word_tokenizer


def test_load_gguf_names_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="gguf_file is not given"):
        load_gguf(tmp_path)
    with pytest.raises(ValueError, match="'model.gguf' not found"):
        load_gguf(tmp_path, "model.gguf")


@pytest.mark.parametrize("eos, pad, want_pad", [([7, 9], None, "w7"), (5, 11, "w11"), (2, None, "</s>")])
def test_fix_gguf_tokenizer_takes_eos_pad_and_length_from_the_config(eos, pad, want_pad):
    tokenizer = copy.deepcopy(tiny_word_tokenizer())
    tokenizer.padding_side = "right"
    config = LlamaConfig(eos_token_id=eos, pad_token_id=pad, max_position_embeddings=321)
    fix_gguf_tokenizer(tokenizer, config)
    first_eos = eos[0] if isinstance(eos, list) else eos
    assert tokenizer.eos_token_id == first_eos and tokenizer.pad_token == want_pad
    assert tokenizer.padding_side == "left" and tokenizer.model_max_length == 321
    assert tokenizer.clean_up_tokenization_spaces is False


@pytest.mark.slow
def test_load_gguf_of_smollm2_matches_the_converted_checkpoint():
    """The GGUF loaded directly (dequantized, ~20 s) equals the converted copy the tests load, tokenizer included."""
    from hf_paged.testing import load_smollm2, smollm2_path

    try:
        path = smollm2_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    model, tokenizer = load_gguf(path)  # the file itself: directory and name are split off
    reference, reference_tokenizer = load_smollm2()
    assert not hasattr(model.config, "quantization_config") and model.hf_quantizer is None
    assert tokenizer.eos_token == reference_tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id == reference_tokenizer.pad_token_id and tokenizer.padding_side == "left"
    state, reference_state = model.state_dict(), reference.state_dict()
    assert state.keys() == reference_state.keys()
    assert all(torch.equal(state[k], reference_state[k]) for k in state)
