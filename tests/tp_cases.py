"""Runs `examples/tensor_parallel.py`'s requests for several engine configurations in one launch (one process, or each
rank of a `torchrun`): the model is loaded once and each case builds its own engine over it and writes
``OUT/<case>/rank<N>.json`` (a case may name another model: `--model` among its arguments). `tests/test_tensor_parallel.py` launches it twice (one process, two ranks) instead of
twice per case: each launch costs seconds of imports and start-up on the CI machine.

    python tests/tp_cases.py OUT_DIR '{"roomy": [], "swap": ["--num-blocks", "20", "--preemption-mode", "swap"]}' \
        --model tiny --max-new-tokens 14 --device cpu
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch.distributed as dist

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tensor_parallel.py"


def _example():
    spec = importlib.util.spec_from_file_location("tensor_parallel_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> None:
    out, cases, common = Path(argv[0]), json.loads(argv[1]), argv[2:]
    example = _example()
    parser = example.build_parser()
    base = parser.parse_args(common)
    rank, world, device = example.setup(base.device)
    loaded = {}  # each model a case names (`--model` in its arguments, else the common one), loaded once
    for name, extra in cases.items():
        args = parser.parse_args([*common, *extra, "--json", str(out / name)])
        if args.model not in loaded:
            loaded[args.model] = example.load(args, rank, world, device)
        example.run(*loaded[args.model], args, rank, world)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
