"""`python -m hf_paged.lm_eval --model_args pretrained=...[,engine args] --tasks ...`: lm-eval's command line with
the `hf-paged` model (`hf_paged.integrations.lm_eval.HFPagedLM`) registered and chosen unless `--model` is given.

A thin entry point, imported only when run: it needs `pip install hf-paged[lm-eval]` (the core package never imports
lm-eval). Every other argument is lm-eval's own (`lm-eval run --help`).
"""

from __future__ import annotations

import sys

from lm_eval.__main__ import cli_evaluate

from hf_paged.integrations.lm_eval import HFPagedLM

__all__ = ["HFPagedLM", "main"]


def main(argv: list[str] | None = None) -> None:
    """lm-eval's CLI (`run` implied, as `lm-eval` itself does) with `--model hf-paged` as the default model."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "run":
        args = args[1:]
    if not any(a == "--model" or a.startswith("--model=") for a in args) and not {"-h", "--help"} & set(args):
        args = ["--model", "hf-paged", *args]
    sys.argv = [sys.argv[0], "run", *args]
    cli_evaluate()


if __name__ == "__main__":
    main()
