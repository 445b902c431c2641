"""GRPO with TRL on hf_paged (no vLLM): `hf_paged.enable(model)` + `GRPOConfig(cache_implementation="paged")`.

A tiny random llama and a word-level tokenizer, so it runs offline on a CPU in seconds; swap in any causal LM and
its tokenizer. Logs each rollout's throughput (new tokens per second) and how many prompt tokens the
`num_generations` copies of each prompt got from the prefix cache.

    python examples/trl_grpo.py --steps 4 --num-generations 4
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import datasets  # noqa: E402
import trl  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged.testing import tiny_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import tiny_word_tokenizer  # noqa: E402

logger = logging.getLogger("trl_grpo")


class TimedGenerate:
    """Wraps `model.generate` (what GRPOTrainer calls for its rollouts) to log tokens/s per rollout."""

    def __init__(self, model, pad_id: int) -> None:
        self.model, self.pad_id = model, pad_id

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = type(self.model).generate(self.model, *args, **kwargs)
        elapsed = time.perf_counter() - start
        width = kwargs["input_ids"].shape[1] if "input_ids" in kwargs else args[0].shape[1]
        new = int((out[:, width:] != self.pad_id).sum())
        logger.info("rollout: %d rows, %d new tokens in %.3f s (%.0f tokens/s)", out.shape[0], new, elapsed,
                    new / max(elapsed, 1e-9))
        return out


def reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--greedy", action="store_true", help="generation_kwargs do_sample=False")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    model = tiny_model("llama", seed=0)
    tokenizer = tiny_word_tokenizer(model.config.vocab_size)
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    hf_paged.enable(model)  # the one-line change (plus cache_implementation="paged" below)
    model.generate = TimedGenerate(model, tokenizer.pad_token_id)
    prompts = [" ".join(f"w{(7 * i + j) % 300 + 3}" for j in range(24 + i % 9)) for i in range(16)]
    with tempfile.TemporaryDirectory() as out:
        config = trl.GRPOConfig(
            output_dir=out, cache_implementation="paged", num_generations=args.num_generations,
            per_device_train_batch_size=args.num_generations * 2, max_completion_length=args.max_completion_length,
            max_steps=args.steps, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
            use_cpu=True, disable_tqdm=True, generation_kwargs={"do_sample": False} if args.greedy else None,
        )
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_len, args=config, processing_class=tokenizer,
                                  train_dataset=datasets.Dataset.from_dict({"prompt": prompts}))
        trainer.train()


if __name__ == "__main__":
    main()
