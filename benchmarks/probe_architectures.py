"""Run every causal-LM architecture of transformers through hf-paged and write docs/architectures.json.

For each `model_type` of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: build the tiny seeded model of `hf_paged.model_zoo`,
run transformers' own greedy `generate()` on a left-padded batch, read the static gate's features, record one
forward with `hf_paged.capabilities.inspect_model`, and, when the gate accepts it, compare the greedy tokens of
`generate(cache_implementation="paged")` and of the drop-in `PagedCache` with transformers'. Then regenerate
docs/models.md and the README's supported-models summary (`architecture_report.py`).

    python benchmarks/probe_architectures.py               # all architectures (about a minute on 2 CPU cores)
    python benchmarks/probe_architectures.py llama gemma2  # print these only, write nothing

Run it again after adding a feature to `HANDLED_FEATURES` (hf_paged/attention/support.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import architecture_report  # noqa: E402

from hf_paged import model_zoo  # noqa: E402
from hf_paged.attention.support import HANDLED_FEATURES, KERNEL_FEATURES  # noqa: E402


def probe(model_types, timeout_s: int = 60, verbose: bool = True) -> list[dict]:
    records = []
    for model_type in model_types:
        start = time.perf_counter()
        record = model_zoo.check_architecture(model_type, timeout_s=timeout_s)
        records.append(record)
        if verbose:
            print(f"{model_type:28s} {time.perf_counter() - start:6.2f}s {record['verdict']:12s} "
                  f"{', '.join(record['unhandled'])} {record['reason'][:100] if record['verdict'] != 'refused' else ''}",
                  flush=True)
    return records


def document(records: list[dict]) -> dict:
    return {
        "transformers_version": transformers.__version__,
        "new_tokens": model_zoo.NEW_TOKENS,
        "handled_features": sorted(HANDLED_FEATURES),
        "kernel_features": sorted(KERNEL_FEATURES),
        "architectures": records,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", help="only these (printed, nothing written)")
    parser.add_argument("--timeout", type=int, default=60, help="seconds per architecture")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    records = probe(args.model_types or model_zoo.ARCHITECTURES, args.timeout)
    if args.model_types:
        return 0
    data = document(records)
    architecture_report.JSON_PATH.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    for path, text in architecture_report.rendered_files(data).items():
        path.write_text(text)
    print(json.dumps(architecture_report.summary(data), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
