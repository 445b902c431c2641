"""`hf_paged.pipeline(...)`: transformers' text-generation pipeline served by one continuous-batching run.

transformers' pipeline loops over (mini-)batches and calls `generate()` per batch, so a long answer holds up its whole
batch. Here a list of prompts or chats is preprocessed by the pipeline itself (tokenisation, chat templates), then every
request goes to the engine at once, and each result goes through the pipeline's own `postprocess`, so outputs have
exactly transformers' format (`generated_text`, chat messages, `return_full_text`, ...).
"""

from __future__ import annotations

import copy

import torch
from transformers import pipeline as hf_pipeline
from transformers.pipelines.text_generation import TextGenerationPipeline

from .generate import _generation_params, _has_default_max_length, enable, get_engine, sampling_params_from_config

__all__ = ["pipeline", "PagedTextGenerationPipeline"]


class PagedTextGenerationPipeline(TextGenerationPipeline):
    """A `TextGenerationPipeline` whose model calls run on hf_paged's engine."""

    def _forward(self, model_inputs, **generate_kwargs):
        generate_kwargs["cache_implementation"] = "paged"
        return super()._forward(model_inputs, **generate_kwargs)

    def get_iterator(self, inputs, num_workers, batch_size, preprocess_params, forward_params, postprocess_params):
        items = list(inputs)
        if not items:
            return iter([])
        forward_params = dict(forward_params)
        if forward_params.pop("prefix_length", 0):
            # rare (XLNet-style prefixes): keep transformers' per-item path, still served by the engine
            return iter([self.run_single(item, preprocess_params, forward_params, postprocess_params) for item in items])
        config = copy.deepcopy(forward_params.pop("generation_config", None) or self.generation_config)
        logits_processor = forward_params.pop("logits_processor", None)
        default_max_length = _has_default_max_length(self.model, config, forward_params)
        config, _ = _generation_params(self.model, config, forward_params)
        engine = get_engine(self.model, tokenizer=self.tokenizer)
        prepared, prompts, params = [], [], []
        for item in items:
            model_inputs = self.preprocess(item, **preprocess_params)
            ids = model_inputs["input_ids"][0]
            mask = model_inputs.get("attention_mask")
            if mask is not None:
                ids = ids[mask[0].to(torch.bool)]
            p, pad = sampling_params_from_config(
                config, model_inputs["input_ids"].shape[1], logits_processor, default_max_length=default_max_length,
                max_position_embeddings=getattr(self.model.config, "max_position_embeddings", None),
            )
            prepared.append((model_inputs, pad))
            prompts.append(ids.tolist())
            params.append(p)
        results = engine.generate(prompts, params)
        outputs = []
        for (model_inputs, pad), result in zip(prepared, results):
            if result.error is not None:
                raise RuntimeError(f"request failed: {result.error}") from result.error
            input_ids = model_inputs["input_ids"]
            samples = [o.token_ids for o in result.outputs]
            width = input_ids.shape[1] + max(len(s) for s in samples)
            generated = torch.full((1, len(samples), width), pad, dtype=torch.long)
            for j, sample in enumerate(samples):
                generated[0, j, : input_ids.shape[1]] = input_ids[0]
                generated[0, j, input_ids.shape[1] : input_ids.shape[1] + len(sample)] = torch.tensor(sample)
            model_outputs = {
                "generated_sequence": generated,
                "input_ids": input_ids,
                "prompt_text": model_inputs["prompt_text"],
            }
            outputs.append(self.postprocess(model_outputs, **postprocess_params))
        return iter(outputs)


def pipeline(task: str = "text-generation", model=None, tokenizer=None, **kwargs):
    """Like `transformers.pipeline`, for "text-generation" with an hf_paged-enabled model.

    `model` may be a loaded model or a path; engine options go in `engine_kwargs` (block_size, num_blocks,
    kv_cache_memory, max_num_seqs, ...).
    """
    if task != "text-generation":
        raise ValueError(f"hf_paged.pipeline supports task='text-generation' only, got {task!r}")
    engine_kwargs = kwargs.pop("engine_kwargs", None) or {}
    if model is None:
        raise ValueError("hf_paged.pipeline needs model=... (a loaded model or a local path)")
    pipe = hf_pipeline(task, model=model, tokenizer=tokenizer, pipeline_class=PagedTextGenerationPipeline, **kwargs)
    enable(pipe.model, **engine_kwargs)
    return pipe
