"""`enable(model)`: route `generate(..., cache_implementation="paged")` to hf_paged's engine.

transformers 5.17 intercepts `cache_implementation="paged"` (kwarg only) inside `GenerationMixin.generate` and sends it
to its own `generate_batch`. `enable` therefore gives the model instance a subclass of its own class with
`PagedGenerationMixin` first in the MRO: the override sees the kwarg *and* a `generation_config` that carries
"paged" (as pipelines build it), runs the request batch through `hf_paged.Engine`, and leaves every other call to
transformers untouched. The model's modules are not changed; its attention implementation becomes `hf_paged`, which
falls back to exact SDPA whenever no `PagedCache` is in use.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput

from ..attention import EXPERTS_NAME, on_prepare, prepare_model, release_model
from ..cache import resolve_kv_cache_dtype
from ..engine import Engine, SamplingParams
from ..engine.params import CONSTRAINT_FIELDS
from ..runner import uncompile_submodules
from .criteria import per_row_criteria

__all__ = ["enable", "disable", "PagedGenerationMixin"]

_PAGED = "paged"
logger = logging.getLogger(__name__)

# GenerationConfig fields the paged path honours; any other field that differs from its default raises.
_HONOURED = {
    "max_new_tokens", "max_length", "min_new_tokens", "min_length", "do_sample", "temperature", "top_k", "top_p",
    "min_p", "repetition_penalty", "eos_token_id", "pad_token_id", "bos_token_id", "stop_strings",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "use_cache", "cache_implementation",
    "num_beams", "length_penalty", "early_stopping", "decoder_start_token_id", "transformers_version",
    "_from_model_config", "_commit_hash", "_original_object_hash", "compile_config", "cache_config",
    "disable_compile", "generation_kwargs",
}
_MODEL_KWARGS = {"attention_mask", "input_ids", "use_cache", "tokenizer", "position_ids", "token_type_ids"}


class PagedGenerationMixin:
    """Placed first in the MRO of an enabled model: intercepts paged generation, defers everything else."""

    def generate(self, inputs=None, generation_config=None, logits_processor=None, stopping_criteria=None, **kwargs):
        requested = kwargs.get("cache_implementation")
        configured = getattr(generation_config or self.generation_config, "cache_implementation", None)
        if requested == _PAGED or (requested is None and configured == _PAGED and "past_key_values" not in kwargs):
            kwargs.pop("cache_implementation", None)
            return paged_generate(self, inputs, generation_config, logits_processor, stopping_criteria, **kwargs)
        if configured == _PAGED:
            # the caller chose another cache explicitly: an explicit None wins over the configs' "paged"
            kwargs["cache_implementation"] = None
        return super().generate(
            inputs, generation_config=generation_config, logits_processor=logits_processor,
            stopping_criteria=stopping_criteria, **kwargs,
        )

    def generate_paged(self, prompts, params=None, *, tokenizer=None, use_tqdm: bool = False, **kwargs):
        """Heterogeneous batch: token lists / strings, one `SamplingParams` (or kwargs) or one per prompt."""
        engine = get_engine(self, tokenizer=tokenizer)
        return engine.generate(prompts, params, use_tqdm=use_tqdm, **kwargs)


def get_engine(model, tokenizer=None):
    """The engine cached on the model (its KV pool is allocated once and reused by later calls).

    The engine holds the model weakly (the model holds the engine): `del model` frees both and the pool by reference
    counting. A model moved to another dtype or device since gets a new engine (the old pool is freed first).
    """
    engine = getattr(model, "_hf_paged_engine", None)
    if engine is not None:
        first = next(model.parameters())
        if (first.dtype, first.device) != (engine.dtype, engine.device):
            engine.close()
            model._hf_paged_engine = engine = None
    if engine is None:
        engine = Engine(model, tokenizer, weak_model_ref=True, **getattr(model, "_hf_paged_engine_kwargs", {}))
        model._hf_paged_engine = engine
    if tokenizer is not None:
        engine.tokenizer = tokenizer
    return engine


def _generation_params(model, generation_config, kwargs: dict) -> tuple[GenerationConfig, dict]:
    """Merge `generation_config`, the model's own and `kwargs` exactly as transformers does; refuse what we ignore."""
    if generation_config is not None and generation_config.cache_implementation == _PAGED:
        generation_config = copy.deepcopy(generation_config)
        generation_config.cache_implementation = None
    gen_kwargs = {k: v for k, v in kwargs.items() if k not in _MODEL_KWARGS}
    model_kwargs = {k: v for k, v in kwargs.items() if k in _MODEL_KWARGS}
    config, unused = model._prepare_generation_config(generation_config, **gen_kwargs)
    if config.cache_implementation == _PAGED:
        config.cache_implementation = None
    if unused:
        raise TypeError(f"generate() got argument(s) hf_paged does not know: {sorted(unused)}")
    defaults = GenerationConfig().to_dict()
    defaults.update(GenerationConfig._get_default_generation_params())
    current = config.to_dict()
    unsupported = sorted(
        k for k, v in current.items()
        if k not in _HONOURED and k in defaults and _is_set(v, defaults[k])
    )
    if unsupported:
        raise ValueError(
            f"cache_implementation='paged' does not support generation option(s) {unsupported}; "
            "drop them or use transformers' own generate() with hf_paged.PagedCache"
        )
    if (config.num_beams or 1) > 1 and config.do_sample:
        raise ValueError(
            "num_beams > 1 with do_sample=True (beam sampling) is not available with cache_implementation='paged'; "
            "pass past_key_values=hf_paged.PagedCache(config=model.config) to transformers' beam sampling instead"
        )
    return config, model_kwargs


def _is_set(value, default) -> bool:
    """Whether a generation option differs from its default. None means "the default" in transformers 5; None, False
    and empty containers all mean "off"; but 0 is a value (`forced_bos_token_id=0` is BART's real setting), so
    `(value or default)` would have let it through silently."""
    def off(v) -> bool:
        return v is None or v is False or (isinstance(v, (list, tuple, dict)) and not v)

    return value is not None and value != default and not (off(value) and off(default))


def sampling_params_from_config(
    config: GenerationConfig, width: int, logits_processor=None, *, default_max_length: bool = False,
    max_position_embeddings: int | None = None,
) -> tuple[SamplingParams, int]:
    """(`SamplingParams`, pad id) for prompts of `width` tokens, following transformers' length conventions:
    `max_new_tokens` wins; a `max_length` nobody set means that many *new* tokens (capped by the model's positions)."""
    if config.max_new_tokens is not None:
        max_new = config.max_new_tokens
    elif default_max_length:
        max_new = config.max_length or 20
        if max_position_embeddings is not None:
            max_new = min(width + max_new, max_position_embeddings) - width
    else:
        max_new = (config.max_length or 20) - width
    if max_new <= 0:
        raise ValueError(
            f"max_new_tokens must be positive (got max_new_tokens={config.max_new_tokens}, "
            f"max_length={config.max_length} for inputs of length {width})"
        )
    min_new = config.min_new_tokens or max(0, (config.min_length or 0) - width)
    eos = config.eos_token_id
    eos = (eos,) if isinstance(eos, int) else tuple(eos or ())
    pad = config.pad_token_id
    if pad is None:
        pad = eos[0] if eos else 0
    params = SamplingParams(
        max_new_tokens=max_new, min_new_tokens=min_new, do_sample=bool(config.do_sample),
        temperature=config.temperature if config.temperature is not None else 1.0,
        top_k=(config.top_k or 0) if config.do_sample else 0,
        top_p=config.top_p if (config.do_sample and config.top_p is not None) else 1.0,
        min_p=(config.min_p or 0.0) if config.do_sample else 0.0,
        repetition_penalty=config.repetition_penalty or 1.0,
        eos_token_id=eos, stop_strings=config.stop_strings or (), ignore_eos=not eos,
        num_return_sequences=config.num_return_sequences or 1, logits_processor=logits_processor or None,
        output_scores=bool(config.output_scores), num_beams=config.num_beams or 1,
        length_penalty=config.length_penalty if config.length_penalty is not None else 1.0,
        early_stopping=config.early_stopping if config.early_stopping is not None else False,
    )
    return params, pad


def _has_default_max_length(model, generation_config, kwargs) -> bool:
    """transformers' rule: nobody set max_length (kwargs, the passed config, the model's config)."""
    return (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )


def _infer_attention_mask(input_ids: torch.Tensor, pad: int | None, eos: tuple[int, ...]) -> torch.Tensor:
    """As transformers: pads are masked when the pad id occurs in the inputs and differs from every eos id."""
    if pad is None or pad in eos or not bool((input_ids == pad).any()):
        return torch.ones_like(input_ids)
    return (input_ids != pad).long()


def paged_generate(model, inputs=None, generation_config=None, logits_processor=None, stopping_criteria=None, **kwargs):
    """`generate()` over hf_paged's engine; returns what transformers returns for decoder-only models."""
    for name in ("assistant_model", "prefix_allowed_tokens_fn", "negative_prompt_ids", "inputs_embeds",
                 "synced_gpus", "custom_generate", "past_key_values"):
        if kwargs.get(name) is not None:
            raise ValueError(f"`{name}` is not supported with cache_implementation='paged'")
        kwargs.pop(name, None)
    streamer = kwargs.pop("streamer", None)
    tokenizer = kwargs.pop("tokenizer", None)
    # structured outputs: `json_schema=`, `regex=`, `choice=`, `json_object=`, `grammar=`, `structural_tag=` (the
    # `SamplingParams` fields; transformers has no such options), applied to every row
    constraint = {name: kwargs.pop(name) for name in CONSTRAINT_FIELDS if name in kwargs}
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    kwargs.pop("input_ids", None)
    if input_ids is None:
        raise ValueError("generate() needs input_ids (or inputs) with cache_implementation='paged'")
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.LongTensor, got {type(input_ids).__name__}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must hold integer token ids (int64), got dtype {input_ids.dtype}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, length] with length > 0, got shape {tuple(input_ids.shape)}")
    attention_mask = kwargs.pop("attention_mask", None)
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    default_max_length = _has_default_max_length(model, generation_config, kwargs)
    config, _ = _generation_params(model, generation_config, kwargs)
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("streamer only supports batch size 1 (as in transformers)")
    if streamer is not None and (config.num_beams or 1) > 1:
        raise ValueError("`streamer` cannot be used with beam search (as in transformers); set num_beams=1")

    width = input_ids.shape[1]
    params, pad = sampling_params_from_config(
        config, width, logits_processor, default_max_length=default_max_length,
        max_position_embeddings=getattr(model.config, "max_position_embeddings", None),
    )
    if constraint:
        params = dataclasses.replace(params, **constraint)  # validated again, with the constraint
    if attention_mask is None:
        attention_mask = _infer_attention_mask(input_ids, pad if config.pad_token_id is not None else None,
                                               params.eos_token_id)

    rows = input_ids.tolist()
    keep = attention_mask.to(torch.bool).tolist()
    padded = [not all(mask) for mask in keep]
    rows = [[t for t, k in zip(row, mask) if k] for row, mask in zip(rows, keep)]
    if params.repetition_penalty != 1.0 and any(padded):
        # transformers penalises the pad ids that sit in a padded row's input_ids: do the same, token for token
        row_params = []
        for row, was_padded in zip(input_ids.tolist(), padded):
            p = copy.copy(params)
            p.extra = {"penalty_ids": tuple(sorted({t for t, k in zip(row, keep[len(row_params)]) if not k}))}
            row_params.append(p if was_padded else params)
    else:
        row_params = params
    if stopping_criteria:
        if (config.num_beams or 1) > 1 or params.num_return_sequences > 1:
            raise ValueError("`stopping_criteria` with cache_implementation='paged' needs num_beams=1 and "
                             "num_return_sequences=1 (it is evaluated per row)")
        base = row_params if isinstance(row_params, list) else [params] * len(rows)
        row_params = []
        for p, crit in zip(base, per_row_criteria(stopping_criteria, input_ids, [len(r) for r in rows])):
            p = copy.copy(p)
            p.stopping_criteria = (crit,)
            row_params.append(p)
    engine = get_engine(model, tokenizer=tokenizer)
    if params.stop_strings and engine.tokenizer is None:
        raise ValueError("stop_strings needs tokenizer=... in generate() (as in transformers)")
    if constraint and engine.tokenizer is None:
        raise ValueError(f"{next(iter(constraint))} (structured output) needs tokenizer=... in generate()")
    if streamer is not None:
        streamer.put(input_ids.cpu())
        request = engine.add_request(rows[0], params=row_params if isinstance(row_params, SamplingParams)
                                     else row_params[0])
        sent = 0
        final = None
        try:
            for out in engine.stream():
                if out.request_id != request:
                    continue
                new = out.outputs[0].token_ids[sent:]
                for token in new:
                    streamer.put(torch.tensor([token]))
                sent += len(new)
                if out.finished:
                    final = out
        except BaseException:
            engine.abort(request)
            raise
        streamer.end()
        results = [final]
    else:
        before = engine.prefix_cache_stats().hit_tokens
        results = engine.generate(rows, row_params)
        _log_sharing(engine, rows, before)
    for result in results:
        if result.error is not None:
            raise RuntimeError(f"request {result.request_id} failed: {result.error}") from result.error

    n = params.num_return_sequences
    if params.num_beams > 1:
        return _beam_output(config, params, input_ids, results)
    outputs, sequences = _sequences(input_ids, results, n, pad)
    new_len = sequences.shape[1] - width
    if not config.return_dict_in_generate:
        return sequences
    scores = None
    if config.output_scores:
        vocab = outputs[0].scores[0].shape[-1] if outputs[0].scores else engine.vocab_size
        scores = tuple(
            torch.stack([
                o.scores[t] if o.scores and t < len(o.scores) else torch.full((vocab,), float("-inf"))
                for o in outputs
            ]).to(input_ids.device)
            for t in range(new_len)
        )
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores)


def _log_sharing(engine, rows: list[list[int]], hits_before: int) -> None:
    """Identical rows (TRL repeats each prompt `num_generations` times) share their prompt's full blocks through
    the prefix cache: say how many prefill tokens that saved."""
    distinct = len({tuple(r) for r in rows})
    if distinct == len(rows) or not logger.isEnabledFor(logging.INFO):
        return
    saved = engine.prefix_cache_stats().hit_tokens - hits_before
    total = sum(len(r) for r in rows)
    logger.info("generate: %d rows, %d distinct prompts; prefix cache served %d of %d prompt tokens (%.0f%%)",
                len(rows), distinct, saved, total, 100.0 * saved / max(total, 1))


def _sequences(input_ids: torch.Tensor, results, n: int, fill: int):
    """(the first `n` completions of each request, `[rows * n, width + longest]` prompt + completion padded with
    `fill`) on the inputs' device: the `sequences` transformers returns."""
    width = input_ids.shape[1]
    outputs = [o for r in results for o in r.outputs[:n]]
    new_len = max(len(o.token_ids) for o in outputs)
    sequences = torch.full((len(outputs), width + new_len), fill, dtype=torch.long)
    sequences[:, :width] = input_ids.cpu().repeat_interleave(n, dim=0)
    for row, out in enumerate(outputs):
        sequences[row, width : width + len(out.token_ids)] = torch.tensor(out.token_ids, dtype=torch.long)
    return outputs, sequences.to(input_ids.device)


def _beam_output(config: GenerationConfig, params: SamplingParams, input_ids: torch.Tensor, results):
    """transformers' beam-search return value: best `num_return_sequences` hypotheses per row, filled like
    `_beam_search` fills its static-shaped buffers (`pad_token_id or eos_token_id[0]`, or -1 without eos)."""
    eos = config.eos_token_id
    eos = (eos,) if isinstance(eos, int) else tuple(eos or ())
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
    fill = (pad or eos[0]) if eos else -1
    n, k = params.num_return_sequences, params.num_beams
    outputs, sequences = _sequences(input_ids, results, n, fill)
    if not config.return_dict_in_generate:
        return sequences
    sequences_scores = scores = None
    if config.output_scores:
        sequences_scores = torch.tensor([o.score for o in outputs], dtype=torch.float32, device=input_ids.device)
        # per step, the processed log-probs of each request's k running beams (a request that stopped earlier than
        # the batch has -inf rows there: transformers keeps scoring its beams, hf_paged frees them)
        steps = [r.outputs[0].scores or [] for r in results]
        vocab = next((s[0].shape[-1] for s in steps if s), 0)
        absent = torch.full((k, vocab), float("-inf"))
        scores = tuple(
            torch.cat([s[t] if t < len(s) else absent for s in steps]).to(input_ids.device)
            for t in range(max(len(s) for s in steps))
        )
    return GenerateBeamDecoderOnlyOutput(sequences=sequences, sequences_scores=sequences_scores, scores=scores)


_subclass_cache: dict[type, type] = {}


def _paged_class(cls: type) -> type:
    if issubclass(cls, PagedGenerationMixin):
        return cls
    sub = _subclass_cache.get(cls)
    if sub is None:
        # same name so save_pretrained() writes the original architecture into config.json
        sub = type(cls.__name__, (PagedGenerationMixin, cls), {"__module__": cls.__module__, "_hf_paged_base": cls})
        sub.__qualname__ = cls.__qualname__
        _subclass_cache[cls] = sub
    return sub


@on_prepare
def install_generate(model) -> None:
    """Give `model` the generate override (`PagedGenerationMixin` first in its class's MRO); idempotent.

    Registered with `hf_paged.attention.on_prepare`, so every prepared model (by `enable` or by an `Engine`) answers
    `generate(cache_implementation="paged")`.
    """
    model.__class__ = _paged_class(model.__class__)


def enable(model, **engine_kwargs):
    """Make `model` paged-aware in place and return it.

    Checks the family is supported (raises ValueError listing the supported ones otherwise), registers the attention
    and mask functions, switches the model to them (and its mixture-of-experts layers to hf_paged's fused experts:
    `experts_implementation="eager"`, `"grouped_mm"`, ... picks one of transformers', None keeps the model's), and
    installs the generate mixin. `engine_kwargs` (block_size, num_blocks, kv_cache_memory, max_num_seqs,
    preemption_mode, swap_space, experts_implementation, kv_cache_dtype, ...) configure the engine behind
    `generate(cache_implementation="paged")`; `kv_cache_dtype="fp8"` stores its K/V in FP8 (`Engine`).
    """
    if "kv_cache_dtype" in engine_kwargs:  # refused now, not at the first generate()
        resolve_kv_cache_dtype(engine_kwargs["kv_cache_dtype"])
    prepare_model(model, engine_kwargs.get("experts_implementation", EXPERTS_NAME))
    if engine_kwargs:
        model._hf_paged_engine_kwargs = dict(engine_kwargs)
        model._hf_paged_engine = None
    return model


def disable(model, attn_implementation: str | None = None):
    """Undo `enable`: original class, the attention implementation it had before (or `attn_implementation`), attention
    adapters uninstalled, the experts implementations it had before, engine released, compiled submodules
    uncompiled."""
    if attn_implementation is None:
        attn_implementation = getattr(model, "_hf_paged_previous_attn", None) or "sdpa"
    base = getattr(type(model), "_hf_paged_base", None)
    if base is not None:
        model.__class__ = base
    uncompile_submodules(model)
    release_model(model, attn_implementation)  # attention adapters off, the implementation and experts back
    engine = getattr(model, "_hf_paged_engine", None)
    if engine is not None:
        # its pool and CUDA graphs go now, not whenever the last reference does: under tensor parallelism the graphs
        # must be gone before `destroy_process_group()`
        engine.close()
    model._hf_paged_engine = None
    return model

