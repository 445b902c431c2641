"""lm-evaluation-harness backend `hf-paged`: lm-eval's `hf` model with `generate_until` on hf_paged's engine.

Like lm-eval's own vLLM backend, `generate_until` hands *all* of a task's requests to one continuous-batching run
(`Engine.generate` with one `SamplingParams` per request: the request's `until` strings as stop strings, its
`max_gen_toks` as `max_new_tokens`), instead of lm-eval's fixed, padded batches that wait for their longest row.
Prompts are tokenized, truncated and post-processed exactly as `HFLM.generate_until` does it, so greedy outputs are
the ones the plain `hf` backend produces. Loglikelihood requests run HFLM's own forward passes on the same (enabled)
model: outside a `PagedCache` hf_paged's attention is exact SDPA, so the scores are transformers'.

Model arguments are HFLM's (`pretrained=...,gguf_file=...,dtype=...`) plus the engine's (`block_size`,
`num_blocks`, `kv_cache_memory`, `max_num_seqs`, `max_num_batched_tokens`, `enable_prefix_caching`,
`compile_decode`, `use_cuda_graph`, ...), which configure the engine behind the model.

This module imports `lm_eval`; the core package never imports it (install `hf-paged[lm-eval]`).
"""

from __future__ import annotations

import inspect
import logging
import time

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from ..engine import Engine, SamplingParams
from .generate import enable, get_engine

__all__ = ["HFPagedLM"]

logger = logging.getLogger(__name__)

_ENGINE_ARGS = set(inspect.signature(Engine.__init__).parameters) - {"self", "model", "tokenizer", "weak_model_ref"}
_BOOL_ARGS = {"enable_prefix_caching", "compile_modules", "compile_decode", "use_cuda_graph", "show_progress"}


def _engine_kwargs(kwargs: dict) -> dict:
    """Take the engine's arguments out of `kwargs` (strings from `--model_args` converted where lm-eval did not)."""
    engine = {}
    for name in list(kwargs):
        if name in _ENGINE_ARGS:
            value = kwargs.pop(name)
            if name in _BOOL_ARGS and isinstance(value, str):
                if value.lower() not in ("true", "false"):
                    raise ValueError(f"{name} must be true or false, got {value!r}")
                value = value.lower() == "true"
            engine[name] = value
    return engine


def sampling_params(gen_kwargs: dict, default_max_gen_toks: int, eos: str) -> tuple[SamplingParams, list[str]]:
    """(`SamplingParams`, until strings) for one lm-eval request, following `HFLM.generate_until`'s reading of its
    generation kwargs (temperature 0 or no `do_sample` -> greedy)."""
    kwargs = normalize_gen_kwargs(dict(gen_kwargs), default_max_gen_toks)
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
    max_gen_toks = kwargs.pop("max_gen_toks")
    kwargs.pop("max_length", None)
    temperature = kwargs.pop("temperature", 0.0)
    do_sample = kwargs.pop("do_sample", None)
    if do_sample is None:
        do_sample = temperature > 0.0
    fields = {}
    if do_sample:
        fields["temperature"] = float(temperature) if temperature else 1.0
    for name in ("top_k", "top_p", "min_p", "repetition_penalty", "seed", "min_new_tokens"):
        if name in kwargs:
            fields[name] = kwargs.pop(name)
    if kwargs:
        raise ValueError(f"hf-paged: generation kwargs {sorted(kwargs)} are not supported")
    params = SamplingParams(max_new_tokens=int(max_gen_toks), do_sample=bool(do_sample),
                            stop_strings=tuple(s for s in until if s), **fields)
    return params, until


@register_model("hf-paged")
class HFPagedLM(HFLM):
    """lm-eval's `HFLM` whose generation runs on hf_paged's continuous-batching engine (`--model hf-paged`)."""

    def __init__(self, **kwargs) -> None:
        engine_kwargs = _engine_kwargs(kwargs)
        super().__init__(**kwargs)
        if self.backend != "causal":
            raise ValueError("hf-paged supports decoder-only (causal) models only")
        enable(self.model, **engine_kwargs)

    @property
    def engine(self):
        return get_engine(self.model, tokenizer=self.tokenizer)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        prompts, params, stops = [], [], []
        for request in requests:
            context, gen_kwargs = request.args
            p, until = sampling_params(gen_kwargs, self.max_gen_toks, eos)
            max_ctx_len = self.max_length - p.max_new_tokens
            if max_ctx_len <= 0:
                raise ValueError(f"max_gen_toks ({p.max_new_tokens}) must be less than the model's maximum "
                                 f"sequence length ({self.max_length})")
            ids, _ = self.tok_batch_encode([context], left_truncate_len=max_ctx_len, truncation=self.truncation)
            prompts.append(ids[0].tolist())
            params.append(p)
            stops.append(until)
        if not prompts:
            return []
        engine = self.engine
        start = time.perf_counter()
        results = engine.generate(prompts, params, use_tqdm=not disable_tqdm and self.rank == 0)
        elapsed = time.perf_counter() - start
        generated = sum(len(r.outputs[0].token_ids) for r in results)
        logger.info("hf-paged: %d requests, %d tokens in %.2f s (%.1f tokens/s)", len(results), generated,
                    elapsed, generated / max(elapsed, 1e-9))
        out = []
        for request, result, until in zip(requests, results, stops):
            if result.error is not None:
                raise RuntimeError(f"hf-paged request failed: {result.error}") from result.error
            toks = list(result.outputs[0].token_ids)
            if isinstance(self.think_end_token, int):
                marks = [i for i, t in enumerate(toks) if t == self.think_end_token]
                if marks:
                    toks = toks[marks[-1] + 1:]
            text = self.tok_decode(toks)
            if isinstance(self.think_end_token, int):
                text = text.lstrip()
            text = postprocess_generated_text(
                generation=text, stop=until,
                think_end_token=self.think_end_token if isinstance(self.think_end_token, str) else None,
            )
            out.append(text)
            self.cache_hook.add_partial("generate_until", request.args, text)
        return out
