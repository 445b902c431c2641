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
def test_the_converted_smollm2_is_its_gguf_dequantized():
    """The SmolLM2 copy the tests load is `load_gguf` of the GGUF file (the file-path form; `hf_paged.testing` converts
    it once per machine): its config and tokenizer say what the GGUF metadata says (eos / pad put back, no
    quantization left), and its weights are the GGUF's dequantized, compared on a few tensors decoded here with the
    gguf package itself (a whole second dequantization took 40 s of the CI machine)."""
    gguf = pytest.importorskip("gguf")
    from hf_paged.testing import load_smollm2, smollm2_path

    try:
        path = smollm2_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    reader = gguf.GGUFReader(str(path))

    def field(key):
        f = reader.fields[key]
        return f.parts[f.data[0]].tolist()[0]

    model, tokenizer = load_smollm2()
    config = model.config
    assert not hasattr(config, "quantization_config") and getattr(model, "hf_quantizer", None) is None
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (
        field("llama.block_count"), field("llama.embedding_length"), field("llama.attention.head_count"),
        field("llama.attention.head_count_kv"))
    assert tokenizer.eos_token_id == field("tokenizer.ggml.eos_token_id") and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id is not None and tokenizer.padding_side == "left"
    tensors = {t.name: t for t in reader.tensors}
    layers = model.model.layers
    # (not attn_q / attn_k: llama.cpp's converter permutes their rows for its rotary layout, transformers undoes it)
    for name, weight in (("token_embd.weight", model.model.embed_tokens.weight),
                         ("blk.0.attn_v.weight", layers[0].self_attn.v_proj.weight),
                         ("blk.7.ffn_down.weight", layers[7].mlp.down_proj.weight),
                         (f"blk.{config.num_hidden_layers - 1}.attn_norm.weight",
                          layers[-1].input_layernorm.weight)):
        t = tensors[name]
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        assert torch.equal(weight.detach(), want.reshape(weight.shape)), name
