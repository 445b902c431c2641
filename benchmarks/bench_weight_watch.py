"""Cost of the weight-change check the engine runs before admitting requests (`hf_paged.runner.WeightWatch`).

The check walks the model's tensors comparing version counters and data pointers (plus PEFT adapter state when there
is any). It runs only in steps after new requests were added (once per generate() call; at most once per serving step,
which then also prefills those requests); this prints it
per check for model shapes built on the `meta` device (no memory, same tensor count), and as a fraction of a decode
step of the given length.

    python benchmarks/bench_weight_watch.py --step-ms 2.0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import SHAPES  # noqa: E402

from hf_paged.runner import ModelRef, WeightWatch  # noqa: E402

EXTRA = {
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
    "llama-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=128256),
}


def build(name: str):
    shape = dict(SHAPES.get(name) or EXTRA[name])
    model_type = shape.pop("model_type", "llama")
    config = AutoConfig.for_model(model_type, **shape)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def time_check(model, repeats: int) -> float:
    watch = WeightWatch(ModelRef(model))
    watch.check()
    start = time.perf_counter()
    for _ in range(repeats):
        assert watch.check() is None
    return (time.perf_counter() - start) / repeats * 1e6


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama-1b,qwen3-0.6b,llama-8b,llama-70b")
    parser.add_argument("--step-ms", type=float, default=2.0, help="decode step time to compare with")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--peft", action="store_true", help="also with a LoRA adapter on q/k/v/o (needs peft)")
    parser.add_argument("--out", default=None)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    rows = []
    print(f"| model | tensors | check (us) | share of a {args.step_ms:g} ms step |")
    print("|---|---|---|---|")
    for name in args.models.split(","):
        model = build(name)
        variants = [("", model)]
        if args.peft:
            import peft

            lora = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                   "o_proj"]))
            variants.append(("+lora", lora.base_model.model))
        for suffix, m in variants:
            tensors = sum(1 for _ in m.parameters()) + sum(1 for _ in m.buffers())
            us = time_check(m, args.repeats)
            rows.append({"model": name + suffix, "tensors": tensors, "check_us": us,
                         "share": us / (args.step_ms * 1000)})
            print(f"| {name + suffix} | {tensors} | {us:.1f} | {us / (args.step_ms * 10):.2f} % |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "weight_watch.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
