"""Quickstart: SmolLM2-135M-Instruct on the CPU through hf_paged.

Answers two chat prompts with `generate(cache_implementation="paged")` (continuous batching over a paged KV cache),
then runs the same prompts through transformers' own `generate()` with a drop-in `hf_paged.PagedCache`, and prints the
cache's block statistics.
"""

from __future__ import annotations

import time

import torch

import hf_paged
from hf_paged.testing import load_smollm2

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Give me three tips for writing clean Python code.",
]


def main() -> None:
    torch.manual_seed(0)
    model, tokenizer = load_smollm2()
    hf_paged.enable(model, kv_cache_memory="256MiB")
    tokenizer.padding_side = "left"
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    batch = tokenizer(texts, return_tensors="pt", padding=True)

    start = time.perf_counter()
    out = model.generate(**batch, max_new_tokens=64, do_sample=False, cache_implementation="paged")
    elapsed = time.perf_counter() - start
    width = batch["input_ids"].shape[1]
    for prompt, row in zip(PROMPTS, out):
        answer = tokenizer.decode(row[width:], skip_special_tokens=True).strip()
        print(f"\n>>> {prompt}\n{answer}")
    engine = model._hf_paged_engine
    print(f"\n[engine] {out.shape[0]} requests in {elapsed:.1f}s, steps={engine.stats['steps']}, "
          f"pool={engine.block_manager.num_blocks} blocks of {engine.block_manager.block_size} tokens")

    cache = hf_paged.PagedCache(config=model.config, kv_cache_memory="64MiB")
    same = model.generate(**batch, max_new_tokens=64, do_sample=False, past_key_values=cache)
    stats = cache.stats()
    print(
        f"[drop-in PagedCache] identical to the engine: {torch.equal(same, out)}; blocks used={stats.used_blocks}, "
        f"shared={stats.shared_blocks}, free={stats.free_blocks}, waste={100 * stats.waste_fraction:.1f}% of "
        f"{stats.allocated_slots} allocated slots"
    )


if __name__ == "__main__":
    main()
