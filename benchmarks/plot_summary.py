"""Plot (and tabulate) the headline comparison of hf-paged against transformers from a small JSON summary.

The README's performance table and its plot come from one data file, so the two cannot drift apart:
`benchmarks/results/summary_<machine>_<date>.json` holds the machine, date, commit, method and one row per workload
(hf-paged's figure, transformers' figure or why there is none, the fraction of the bandwidth bound). This script
writes the plot (speed-up against transformers, and fraction of the bound, per workload) and can print the table
as Markdown. When a new measurement replaces the figures: write a new summary file, run this script, and point the
README and docs/performance.md at the new PNG.

    python benchmarks/plot_summary.py                              # the default data file -> docs/performance_h200.png
    python benchmarks/plot_summary.py --markdown                   # also print the Markdown table
    python benchmarks/plot_summary.py --data FILE.json --out FILE.png

Needs matplotlib for the plot (the `bench` extra); `--markdown --no-plot` runs without it. Tests use no matplotlib.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT / "benchmarks" / "results" / "summary_h200_2026-11-28.json"
DEFAULT_OUT = ROOT / "docs" / "performance_h200.png"

__all__ = ["parse_args", "load", "speedup", "markdown_table", "plot", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="summary JSON (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="PNG to write (default: %(default)s)")
    parser.add_argument("--dpi", type=int, default=120, help="resolution of the PNG (default: %(default)s)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG (no matplotlib needed)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.dpi <= 0:
        parser.error(f"--dpi must be positive, got {args.dpi}")
    if args.no_plot and not args.markdown:
        parser.error("--no-plot without --markdown has nothing to do")
    return args


def load(path: Path) -> dict:
    """The summary, checked: every row names its workload, unit and hf-paged's figure."""
    data = json.loads(Path(path).read_text())
    for key in ("title", "machine", "date", "commit", "rows"):
        if key not in data:
            raise ValueError(f"{path}: missing {key!r}")
    for row in data["rows"]:
        for key in ("workload", "unit", "higher_is_better", "hf_paged"):
            if key not in row:
                raise ValueError(f"{path}: row {row.get('workload')!r} has no {key!r}")
    return data


def speedup(row: dict) -> float | None:
    """How many times faster hf-paged is than transformers on this row (None without a transformers figure)."""
    theirs, ours = row.get("transformers"), row["hf_paged"]
    if theirs is None:
        return None
    return ours / theirs if row["higher_is_better"] else theirs / ours


def _figure(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    text = f"{value:,.0f}" if value >= 100 else f"{value:.2f}"
    return f"{text} {unit}"


def markdown_table(data: dict) -> str:
    """The README's table: workload, hf-paged, transformers, speed-up, fraction of the bound."""
    lines = ["| workload | hf-paged | transformers | speed-up | bound / run |", "|---|---|---|---|---|"]
    for row in data["rows"]:
        ratio = speedup(row)
        theirs = _figure(row.get("transformers"), row["unit"])
        note = row.get("transformers_note")
        if note:
            theirs = note if row.get("transformers") is None else f"{theirs} ({note})"
        bound = row.get("bound_fraction")
        lines.append(
            f"| {row['workload']} | **{_figure(row['hf_paged'], row['unit'])}** | {theirs} "
            f"| {f'**{ratio:.1f}x**' if ratio is not None else '-'} "
            f"| {f'{100 * bound:.0f} %' if bound is not None else '-'} |"
        )
    return "\n".join(lines)


def plot(data: dict, out: Path, dpi: int = 120) -> Path:
    """Two panels: speed-up against transformers (log scale) and fraction of the bandwidth bound, per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compared = [(r["workload"], speedup(r)) for r in data["rows"] if speedup(r) is not None]
    bounded = [(r["workload"], r["bound_fraction"]) for r in data["rows"] if r.get("bound_fraction") is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1, 1]})
    names, values = zip(*compared)
    bars = left.barh(range(len(names)), values, color="#3b75af")
    left.set_xscale("log")
    left.set_yticks(range(len(names)), [_wrap(n) for n in names], fontsize=8)
    left.invert_yaxis()
    left.axvline(1.0, color="black", linewidth=0.8)
    left.set_xlabel("speed-up against transformers (x, log scale)")
    left.bar_label(bars, labels=[f"{v:.1f}x" for v in values], padding=3, fontsize=8)
    left.set_xlim(0.8, max(values) * 3)
    names, values = zip(*bounded)
    bars = right.barh(range(len(names)), [100 * v for v in values], color="#e1812c")
    right.set_yticks(range(len(names)), [_wrap(n) for n in names], fontsize=8)
    right.invert_yaxis()
    right.set_xlim(0, 100)
    right.set_xlabel("hf-paged: fraction of the memory-bandwidth bound (%)")
    right.bar_label(bars, labels=[f"{100 * v:.0f} %" for v in values], padding=3, fontsize=8)
    fig.suptitle(f"{data['title']} ({data['date']}, commit {data['commit']})", fontsize=10)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def _wrap(text: str, width: int = 34) -> str:
    words, lines, line = text.split(), [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "\n".join([*lines, line])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data = load(args.data)
    if args.markdown:
        print(markdown_table(data))
    if not args.no_plot:
        print(f"wrote {plot(data, args.out, args.dpi)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
