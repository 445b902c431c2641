"""Loading a GGUF checkpoint (model + tokenizer) through transformers' own GGUF support, for the server's
`--gguf-file` and anyone else: transformers dequantizes the file into a regular model of the given dtype.

transformers 5.17's GGUF tokenizer conversion sets the eos token to the *bos* token and drops the pad token
(integrations/ggml.py); `load_gguf` restores what the model config (read from the GGUF metadata) says.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

__all__ = ["load_gguf", "fix_gguf_tokenizer"]


def fix_gguf_tokenizer(tokenizer, config) -> None:
    """Set eos / pad from the config (the GGUF metadata) and the real context length; pad on the left."""
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, (list, tuple)) else config.eos_token_id
    pad = config.pad_token_id if config.pad_token_id is not None else eos
    if eos is not None and tokenizer.eos_token_id != eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    if pad is not None and tokenizer.pad_token_id != pad:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad)
    tokenizer.padding_side = "left"
    tokenizer.clean_up_tokenization_spaces = False
    if getattr(config, "max_position_embeddings", None):
        tokenizer.model_max_length = config.max_position_embeddings


def load_gguf(path: str | os.PathLike, gguf_file: str | None = None, *, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu"):
    """`(model, tokenizer)` from a GGUF file: `path` is the file itself, or its directory with `gguf_file` its name.

    Offline: nothing is fetched from the Hub. The model is dequantized to `dtype`, moved to `device`, in eval mode,
    and no longer records the GGUF as a quantization method (its weights are plain tensors).
    """
    path = os.fspath(path)
    if gguf_file is None:
        if not os.path.isfile(path):
            raise ValueError(f"gguf_file is not given and path {path!r} is not a GGUF file")
        path, gguf_file = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    if not os.path.isfile(os.path.join(path, gguf_file)):
        raise ValueError(f"gguf_file {gguf_file!r} not found in {path!r}")
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=dtype, local_files_only=True)
    fix_gguf_tokenizer(tokenizer, model.config)
    for obj in (model, model.config):
        if hasattr(obj, "quantization_config"):
            delattr(obj, "quantization_config")
    model.hf_quantizer = None
    for key in ("local_files_only", "gguf_file"):
        tokenizer.init_kwargs.pop(key, None)
    return model.to(device).eval(), tokenizer
