"""KV memory of a mixed sliding / full stack with one block table (today) and with layer groups (issue 54, item 2).

For a model shape (default: Gemma-3-27B's text stack, 62 layers of 16 KV heads x 128, every sixth layer global, the
others with a 1,024-token window, bf16; `--family gemma4`: Gemma-4-31B's, 60 layers, local layers 16 KV heads x 256,
global ones 4 x 512, packed into pages by width, `hf_paged.cache.kv_pages`) and each context length, two numbers per
layout:

* **KV bytes per sequence**: a sequence is prefilled to the context in chunks of `--chunk` tokens and decodes one
  more token, through the real block managers (`BlockManager` for one table, `GroupedBlockManager` for the groups,
  whose sliding groups release before every chunk as the scheduler does: `release_out_of_window`); the blocks its
  tables hold then, times the bytes of a block from the real caches (`PagedCache.bytes_per_block`,
  `GroupedPagedCache.bytes_per_block`; the grouping is `plan_for` of the config). Also the peak during the prefill.
* **Largest running batch at a fixed KV budget** (`--budget-gib`): the pool is sized as the engine sizes it from
  `kv_cache_memory` (`PagedCache._auto_num_blocks`), and sequences are prefilled to the context one after another in
  that pool until the next one no longer fits (each must keep room for its next decode token).

Everything is block bookkeeping (no tensors, no model weights: the config alone), so the CPU measures it exactly.

    python benchmarks/bench_kv_groups.py                                 # Gemma-3-27B, 4k / 32k / 128k, 60 GiB
    python benchmarks/bench_kv_groups.py --contexts 8192 32768 --budget-gib 40 --out benchmarks/results/<dir>
    python benchmarks/bench_kv_groups.py --family gemma4 --contexts 32768  # Gemma-4-31B's layers
    python benchmarks/bench_kv_groups.py --tiny                          # a tiny shape (the test's smoke run)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import Gemma3TextConfig, Gemma4TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_paged.cache import GroupedPagedCache, PagedCache, plan_for  # noqa: E402
from hf_paged.core import BlockManager, GroupedBlockManager, NoFreeBlocksError  # noqa: E402

_GIB = 2**30


class _Seq:
    """What `release_out_of_window` reads of a scheduler sequence."""

    def __init__(self, seq_id: int) -> None:
        self.seq_id, self.num_computed, self.token_ids = seq_id, 0, []


def gemma3_config(layers: int = 62, kv_heads: int = 16, head_dim: int = 128, window: int = 1024,
                  pattern: int = 6) -> Gemma3TextConfig:
    """A Gemma 3 text config of this shape (Gemma-3-27B's by default); only the KV-relevant fields matter."""
    types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    return Gemma3TextConfig(num_hidden_layers=layers, num_key_value_heads=kv_heads, num_attention_heads=2 * kv_heads,
                            head_dim=head_dim, hidden_size=256, intermediate_size=256, vocab_size=256,
                            sliding_window=window, layer_types=types)


def gemma4_config(layers: int = 60, kv_heads: int = 16, head_dim: int = 256, window: int = 1024, pattern: int = 6,
                  global_kv_heads: int = 4, global_head_dim: int = 512) -> Gemma4TextConfig:
    """A Gemma 4 text config of this shape (Gemma-4-31B's by default: its global layers have their own KV heads and
    head size, keys and values from one projection); only the KV-relevant fields matter."""
    types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    types[-1] = "full_attention"  # (Gemma 4's config makes the last layer global)
    return Gemma4TextConfig(num_hidden_layers=layers, num_key_value_heads=kv_heads, num_attention_heads=2 * kv_heads,
                            head_dim=head_dim, global_head_dim=global_head_dim, attention_k_eq_v=True,
                            num_global_key_value_heads=global_kv_heads, hidden_size=256, intermediate_size=256,
                            vocab_size=256, vocab_size_per_layer_input=256, hidden_size_per_layer_input=16,
                            sliding_window=window, layer_types=types)


def _prefill(bm, seq: _Seq, context: int, chunk: int, window: int | None) -> int:
    """Prefill `seq` to `context` tokens in chunks, then reserve one decode token; return the most blocks its tables
    held at once. Raises `NoFreeBlocksError` (nothing of the failing chunk reserved) when the pool is full."""
    peak = end = 0
    while end <= context:  # the prompt's chunks, then one decode token
        n = min(chunk, context - end) or 1
        if window is not None:
            bm.release_out_of_window([seq], window)
        bm.append_slots(seq.seq_id, n)  # all or nothing
        end += n
        seq.num_computed = end
        peak = max(peak, held(bm, seq.seq_id))
    return peak


def held(bm, seq_id: int) -> int:
    """Blocks the sequence's tables hold now (released entries excluded)."""
    if isinstance(bm, GroupedBlockManager):
        return bm.held_blocks(seq_id)
    return sum(block >= 0 for block in bm.table_view(seq_id))


def measure(config, context: int, *, block_size: int, chunk: int, budget: int, dtype: torch.dtype) -> dict:
    """One context length: bytes per sequence and the largest batch in `budget` bytes, for both layouts."""
    today = PagedCache(config=config, num_blocks=1, block_size=block_size, kv_cache_memory=budget)
    plan = plan_for(config, today)
    if plan is None:
        raise ValueError("this config is not a mixed sliding / full stack: there is nothing to group")
    grouped = GroupedPagedCache(config=config, num_blocks=1, block_size=block_size, kv_cache_memory=budget,
                                layer_groups=plan)
    window = max(w for w in plan.windows if w is not None)
    row = {"context": context}
    for name, cache in (("today", today), ("grouped", grouped)):
        per_block = cache.bytes_per_block(dtype)
        num_blocks = cache._auto_num_blocks(torch.device("cpu"), dtype)  # what `kv_cache_memory` buys

        def manager(blocks: int, name: str = name):
            if name == "today":
                return BlockManager(blocks, block_size)
            return GroupedBlockManager(blocks, block_size, plan.windows)

        release = window if name == "grouped" else None  # one table of a mixed stack releases nothing
        one = manager(max(num_blocks, (context // block_size + 2) * plan.num_groups))
        one.allocate(0, 0)
        seq = _Seq(0)
        peak = _prefill(one, seq, context, chunk, release)
        steady = held(one, 0)
        pool = manager(num_blocks)
        batch = 0
        while True:
            seq = _Seq(batch)
            pool.allocate(batch, 0)
            try:
                _prefill(pool, seq, context, chunk, release)
            except NoFreeBlocksError:
                break
            batch += 1
        row[name] = {"bytes_per_block": per_block, "pool_blocks": num_blocks, "blocks_per_seq": steady,
                     "bytes_per_seq": steady * per_block, "peak_bytes_per_seq": peak * per_block, "max_batch": batch}
    row["saving"] = 1 - row["grouped"]["bytes_per_seq"] / row["today"]["bytes_per_seq"]
    row["batch_ratio"] = row["grouped"]["max_batch"] / row["today"]["max_batch"] if row["today"]["max_batch"] else None
    row["groups"] = {"group_size": plan.group_size, "windows": list(plan.windows)}
    return row


def table(rows: list[dict], budget_gib: float) -> str:
    lines = [f"KV budget {budget_gib:g} GiB; groups: size {rows[0]['groups']['group_size']}, "
             f"windows {rows[0]['groups']['windows']}",
             "| context | today MiB/seq | grouped MiB/seq | saving | today batch | grouped batch | batch x |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        t, g = r["today"], r["grouped"]
        ratio = f"{r['batch_ratio']:.1f}" if r["batch_ratio"] is not None else "inf (today: 0)"
        lines.append(f"| {r['context']:,} | {t['bytes_per_seq'] / 2**20:,.1f} | {g['bytes_per_seq'] / 2**20:,.1f} | "
                     f"{r['saving']:.1%} | {t['max_batch']} | {g['max_batch']} | {ratio} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--budget-gib", type=float, default=60.0, help="KV memory of the pool (kv_cache_memory)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=8192, help="prefill chunk (the engine's token budget)")
    parser.add_argument("--family", choices=("gemma3", "gemma4"), default="gemma3",
                        help="gemma3: the shape of --layers, --kv-heads, --head-dim; gemma4: Gemma-4-31B's layers "
                             "(--window and --pattern apply)")
    parser.add_argument("--layers", type=int, default=62)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--pattern", type=int, default=6, help="every pattern-th layer is global")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape and small contexts (CPU smoke run)")
    parser.add_argument("--out", type=Path, help="directory for kv_groups.json and kv_groups.png")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tiny:
        args.contexts, args.budget_gib, args.block_size, args.chunk = [256, 1024], 0.01, 4, 64
        args.layers, args.kv_heads, args.head_dim, args.window = 12, 2, 16, 32
    if min(args.contexts) < 1 or args.budget_gib <= 0 or args.chunk < 1:
        parser.error("contexts, --budget-gib and --chunk must be positive")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.family == "gemma4" and args.tiny:
        config = gemma4_config(args.layers, args.kv_heads, args.head_dim, args.window, args.pattern, 1, 2 * args.head_dim)
    elif args.family == "gemma4":
        config = gemma4_config(window=args.window, pattern=args.pattern)
    else:
        config = gemma3_config(args.layers, args.kv_heads, args.head_dim, args.window, args.pattern)
    budget = int(args.budget_gib * _GIB)
    rows = [measure(config, c, block_size=args.block_size, chunk=args.chunk, budget=budget, dtype=torch.bfloat16)
            for c in args.contexts]
    print(table(rows, args.budget_gib))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kv_groups.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                             "rows": rows}, indent=1))
        plot(rows, args.out / "kv_groups.png")
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """KV MiB per sequence and the largest batch, one table against layer groups, per context (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"{r['context']:,}" for r in rows]
    x = range(len(rows))
    fig, (mem, batch) = plt.subplots(1, 2, figsize=(9, 3.5))
    for offset, (name, colour) in enumerate((("today", "tab:gray"), ("grouped", "tab:blue"))):
        xs = [i + (offset - 0.5) * 0.4 for i in x]
        mem.bar(xs, [r[name]["bytes_per_seq"] / 2**20 for r in rows], 0.4, color=colour, label=name)
        batch.bar(xs, [r[name]["max_batch"] for r in rows], 0.4, color=colour, label=name)
    for ax, title in ((mem, "KV MiB per sequence"), (batch, "largest running batch at the budget")):
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("context (tokens)")
        ax.set_title(title)
        ax.legend()
    mem.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
