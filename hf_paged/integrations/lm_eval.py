"""lm-evaluation-harness backend `hf-paged`: lm-eval's `hf` model with its requests on hf_paged's engine.

Like lm-eval's own vLLM backend, `generate_until` hands *all* of a task's requests to one continuous-batching run
(`Engine.generate` with one `SamplingParams` per request: the request's `until` strings as stop strings, its
`max_gen_toks` as `max_new_tokens`), instead of lm-eval's fixed, padded batches that wait for their longest row.
Prompts are tokenized, truncated and post-processed exactly as `HFLM.generate_until` does it, so greedy outputs are
the ones the plain `hf` backend produces.

Loglikelihood requests (`loglikelihood`, multiple choice, and `loglikelihood_rolling`'s windows) are scored by the
engine's paged prefill too: each request is one scoring-only engine request (`max_new_tokens=0`,
`prompt_logprobs_start` at its continuation), all of a call's requests in one run. Inputs are built and truncated as
`HFLM._loglikelihood_tokens` does (the last `max_length + 1` tokens of context + continuation), and each answer is
(sum of the continuation tokens' float32 log-probabilities, whether each is the argmax), so the results are the
`hf` backend's up to float rounding. Requests sharing a context (the choices of a question, few-shot preambles)
compute its whole KV blocks once: the later ones take them from the prefix cache (`enable_prefix_caching`, on by
default), only the positions whose scores are wanted are recomputed. `loglikelihood_rolling` hands every window of
every document to one call (HFLM scores them `batch_size` at a time).

Model arguments are HFLM's (`pretrained=...,gguf_file=...,dtype=...`) plus the engine's (`block_size`,
`num_blocks`, `kv_cache_memory`, `max_num_seqs`, `max_num_batched_tokens`, `enable_prefix_caching`,
`compile_decode`, `use_cuda_graph`, ...), which configure the engine behind the model.

This module imports `lm_eval`; the core package never imports it (install `hf-paged[lm-eval]`).
"""

from __future__ import annotations

import inspect
import logging
import sys
import time

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from ..engine import Engine, RequestOutput, SamplingParams
from .generate import enable, get_engine

__all__ = ["HFPagedLM"]

logger = logging.getLogger(__name__)

_ENGINE_ARGS = set(inspect.signature(Engine.__init__).parameters) - {"self", "model", "tokenizer", "weak_model_ref"}
_BOOL_ARGS = {"enable_prefix_caching", "compile_modules", "compile_decode", "use_cuda_graph", "show_progress",
              "release_window_blocks"}


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
        self.engine_loglikelihood_requests = 0  # scored on the engine (the rest went to HFLM's forwards)

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

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """HFLM's rolling log-likelihood, with every window of every document scored in one engine run.

        HFLM passes its windows to `_loglikelihood_tokens` `batch_size` at a time (and first probes a batch size
        with `batch_size=auto`); for the engine, one call with all of them is one continuous-batching run.
        """
        saved = self.batch_size_per_gpu
        self.batch_size_per_gpu = sys.maxsize
        try:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        finally:
            self.batch_size_per_gpu = saved

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None
                              ) -> list[tuple[float, bool]]:
        """(log-likelihood of the continuation, whether it is the greedy continuation) per (key, context tokens,
        continuation tokens) request, scored by the engine in one run (see the module docstring).

        Falls back to HFLM's padded forwards only for requests the engine cannot hold: an input longer than the
        model's `max_position_embeddings` (with a `max_length` set above it) or needing more KV blocks than the
        whole pool has.
        """
        engine = self.engine
        prompts, params, on_engine, fallback = [], [], [], []
        for index, (_, context_enc, continuation_enc) in enumerate(requests):
            tokens, start = self._scored_input(context_enc, continuation_enc)
            if not self._engine_can_score(engine, len(tokens)):
                fallback.append(index)
                continue
            prompts.append(tokens)
            params.append(SamplingParams(max_new_tokens=0, prompt_logprobs_start=start))
            on_engine.append(index)
        answers: list[tuple[float, bool] | None] = [None] * len(requests)
        if fallback:
            logger.warning("hf-paged: %d loglikelihood requests do not fit the engine; HFLM scores them",
                           len(fallback))
            for index, answer in zip(fallback, super()._loglikelihood_tokens(
                    [requests[i] for i in fallback], disable_tqdm=disable_tqdm, override_bs=override_bs)):
                answers[index] = answer
        if on_engine:
            results = self._score_on_engine(engine, prompts, params, disable_tqdm)
            self.engine_loglikelihood_requests += len(results)
            for index, result in zip(on_engine, results):
                answers[index] = _answer(result)
                key = requests[index][0]
                if key is not None:  # loglikelihood_rolling's windows have none: it caches per document
                    self.cache_hook.add_partial("loglikelihood", key, answers[index])
        return answers

    def _scored_input(self, context_enc: list[int], continuation_enc: list[int]) -> tuple[list[int], int]:
        """(tokens, index of the first continuation token) as `HFLM._loglikelihood_tokens` builds its input: the
        last `max_length + 1` tokens of context + continuation (the model reads all but the last)."""
        if not context_enc or not continuation_enc:
            raise ValueError("hf-paged: loglikelihood requests need non-empty context and continuation tokens")
        if len(continuation_enc) > self.max_length:
            raise ValueError(f"hf-paged: continuation of {len(continuation_enc)} tokens exceeds max_length "
                             f"({self.max_length})")
        total = len(context_enc) + len(continuation_enc)
        if total > self.max_length + 1:
            logger.warning("hf-paged: context (%d) + continuation (%d) exceeds max_length (%d); truncating %d "
                           "tokens from the left", len(context_enc), len(continuation_enc), self.max_length,
                           total - self.max_length - 1)
        tokens = (context_enc + continuation_enc)[-(self.max_length + 1):]
        return tokens, len(tokens) - len(continuation_enc)

    @staticmethod
    def _engine_can_score(engine: Engine, num_tokens: int) -> bool:
        """Whether a scoring-only request of `num_tokens` tokens fits the engine (it computes all but the last)."""
        computed = num_tokens - 1
        if engine.max_model_len is not None and computed > engine.max_model_len:
            return False
        bm = engine.block_manager
        return bm.blocks_to_hold(computed, engine.scheduler.max_num_batched_tokens) <= bm.num_blocks

    def _score_on_engine(self, engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
                         disable_tqdm: bool) -> list[RequestOutput]:
        """One engine run over all scoring requests, in token order so that requests sharing a prefix are admitted
        together (the later ones then hit its blocks); results in input order. Logs the throughput."""
        order = sorted(range(len(prompts)), key=lambda i: prompts[i])
        hits = engine.prefix_cache_stats().hit_tokens
        begin = time.perf_counter()
        ran = engine.generate([prompts[i] for i in order], [params[i] for i in order],
                              use_tqdm=not disable_tqdm and self.rank == 0)
        elapsed = time.perf_counter() - begin
        results: list[RequestOutput] = [None] * len(prompts)  # type: ignore[list-item]
        for i, result in zip(order, ran):
            if result.error is not None:
                raise RuntimeError(f"hf-paged request failed: {result.error}") from result.error
            results[i] = result
        tokens = sum(len(p) - 1 for p in prompts)
        logger.info("hf-paged: %d loglikelihood requests, %d input tokens (%d from the prefix cache) in %.2f s "
                    "(%.1f tokens/s)", len(prompts), tokens, engine.prefix_cache_stats().hit_tokens - hits,
                    elapsed, tokens / max(elapsed, 1e-9))
        return results


def _answer(result: RequestOutput) -> tuple[float, bool]:
    """lm-eval's answer from a scoring request: (sum of the continuation's log-probabilities, all greedy)."""
    scores = result.prompt_logprobs
    return float(sum(logprob for logprob, _ in scores)), all(greedy for _, greedy in scores)
