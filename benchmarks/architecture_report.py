"""Render docs/architectures.json (written by probe_architectures.py) into docs/models.md and the README.

Both documents keep their hand-written parts; the generated parts sit between `<!-- BEGIN GENERATED ... -->` /
`<!-- END GENERATED ... -->` markers. `tests/test_architectures.py` checks that the files hold exactly what this
script renders from the JSON, so the record of what each family does cannot drift from the sweep.

    python benchmarks/architecture_report.py          # rewrite the generated parts
    python benchmarks/architecture_report.py --check  # exit 1 if they are stale
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JSON_PATH = ROOT / "docs" / "architectures.json"
MODELS_PATH = ROOT / "docs" / "models.md"
README_PATH = ROOT / "README.md"
MODELS_MARK = "ARCHITECTURES"
README_MARK = "SUPPORTED MODELS"

# imported lazily by main() only when rendering needs the constants; the JSON carries them too
__all__ = ["load", "summary", "render_models", "render_readme", "replace_block", "rendered_files"]


def load(path: Path = JSON_PATH) -> dict:
    return json.loads(path.read_text())


def summary(data: dict) -> dict:
    """Counts over the architectures, and the estimate with the kernel features handled."""
    records = data["architectures"]
    handled, kernel = set(data["handled_features"]), set(data["kernel_features"])
    runs = [r for r in records if r["runs_under_transformers"]]
    verdicts = Counter(r["verdict"] for r in records)
    would = [r for r in runs if r["verdict"] == "pass"
             or (r["verdict"] == "refused" and set(r["unhandled"]) <= handled | kernel)]
    blockers = Counter(f for r in runs if r["verdict"] == "refused" for f in r["unhandled"] if f not in kernel)
    return {
        "architectures": len(records),
        "runs_under_transformers": len(runs),
        "interface_routed": sum(bool(r["interface_routed"]) for r in runs),
        "adapted": sum("attention_adapter" in r["features"] for r in runs),
        "pass": verdicts["pass"],
        "refused": verdicts["refused"],
        "not_runnable": verdicts["not_runnable"],
        "failures": sum(v for k, v in verdicts.items() if k not in ("pass", "refused", "not_runnable")),
        "would_pass_with_kernel_features": len(would),
        "other_blockers": dict(blockers.most_common()),
    }


def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:.0f} %" if b else "-"


def _summary_lines(data: dict) -> list[str]:
    s = summary(data)
    runs = s["runs_under_transformers"]
    return [
        f"Sweep of transformers {data['transformers_version']}'s `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` "
        f"({s['architectures']} architectures; tiny seeded configs from `hf_paged.model_zoo`, float32, a left-padded "
        f"batch of 2, {data['new_tokens']} greedy tokens). Handled features: "
        + ", ".join(f"`{f}`" for f in data["handled_features"]) + ".",
        "",
        f"- run under transformers: **{runs}** (not runnable: {s['not_runnable']})",
        f"- attention routed through `AttentionInterface` with a `Cache` (by the model, or by a per-family adapter: "
        f"{s['adapted']}): {s['interface_routed']}",
        f"- accepted and token-identical (`generate(cache_implementation=\"paged\")` and `PagedCache`): "
        f"**{s['pass']}** ({_pct(s['pass'], runs)} of those that run)",
        f"- refused up front, feature named: {s['refused']}; failures (crash / mismatch / gate missed): "
        f"{s['failures']}",
        f"- with the kernel features {', '.join(f'`{f}`' for f in data['kernel_features'])} handled, "
        f"{s['would_pass_with_kernel_features']} would be accepted "
        f"({_pct(s['would_pass_with_kernel_features'], runs)}); the other refusals are "
        + ", ".join(f"`{k}` ({v})" for k, v in s["other_blockers"].items()) + ".",
    ]


def _cell(text: str, limit: int = 120) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render_models(data: dict) -> str:
    lines = _summary_lines(data) + [
        "",
        "| `model_type` | class | runs under transformers | interface-routed | features (gate) | verdict | reason |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in data["architectures"]:
        features = ", ".join(f"`{k}`" for k in sorted(r["features"]))
        reason = r["reason"]
        if r["verdict"] == "refused":
            reason = "refused: " + ", ".join(f"`{f}`" for f in r["unhandled"])
        routed = "-" if r["interface_routed"] is None else ("yes" if r["interface_routed"] else "no")
        lines.append(f"| `{r['model_type']}` | `{r['class']}` | {'yes' if r['runs_under_transformers'] else 'no'} "
                     f"| {routed} | {features} | {r['verdict']} | {_cell(reason)} |")
    return "\n".join(lines)


def render_readme(data: dict) -> str:
    """The README's short summary: the counts and the accepted `model_type`s, the table itself in docs/models.md."""
    s = summary(data)
    passing = [r["model_type"] for r in data["architectures"] if r["verdict"] == "pass"]
    return "\n".join([
        f"**{s['pass']} of the {s['runs_under_transformers']} causal-LM architectures** that run under transformers "
        f"{data['transformers_version']} are accepted and give transformers' greedy tokens "
        "(`generate(cache_implementation=\"paged\")` and the drop-in `PagedCache`); the other "
        f"{s['refused']} are refused by `hf_paged.enable` with a `ValueError` naming the feature. Accepted "
        "`model_type`s: " + ", ".join(f"`{t}`" for t in passing) + ".",
        "",
        "The table of every architecture, with the reason for each refusal: [docs/models.md](docs/models.md).",
    ])


def replace_block(text: str, mark: str, body: str) -> str:
    begin, end = f"<!-- BEGIN GENERATED {mark} -->", f"<!-- END GENERATED {mark} -->"
    if begin not in text or end not in text:
        raise ValueError(f"markers {begin} / {end} not found")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def rendered_files(data: dict) -> dict[Path, str]:
    """{path: the file's full text with its generated part rendered from `data`}."""
    return {
        MODELS_PATH: replace_block(MODELS_PATH.read_text(), MODELS_MARK, render_models(data)),
        README_PATH: replace_block(README_PATH.read_text(), README_MARK, render_readme(data)),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the documents are stale")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stale = []
    for path, text in rendered_files(load()).items():
        if path.read_text() != text:
            stale.append(path)
            if not args.check:
                path.write_text(text)
    if args.check and stale:
        print("stale: " + ", ".join(str(p.relative_to(ROOT)) for p in stale), file=sys.stderr)
        return 1
    print(json.dumps(summary(load()), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
