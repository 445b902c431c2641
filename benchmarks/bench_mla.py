"""Multi-head latent attention: one decode attention call over the latent pool vs over expanded K/V, and the KV budget.

For each batch and context size, one decode step of one layer (one query token per sequence, block_size 16, shuffled
physical blocks), three ways that compute the same thing (the expanded K/V are made from the same latent):

* ``latent``: hf-paged's MLA path (`hf_paged.attention.adapters.mla`): the query absorbed into the latent space
  (`W_UK`), `kernels.paged_decode` over the latent pool (one KV head of `kv_lora_rank + qk_rope_head_dim`, values =
  keys), `W_UV` on the output; also the kernel call alone (``latent_kernel``);
* ``expanded``: `kernels.paged_decode` over a paged pool of expanded per-head K (`nope + rope`) and V (`v_head_dim`),
  what a cache of the model's expanded K/V would hold;
* ``sdpa``: `torch.nn.functional.scaled_dot_product_attention` over dense expanded K/V (no paging).

Each is timed (CUDA: `triton.testing.do_bench` median; CPU: median of `--reps` wall-clock runs) and given its
bytes: the K/V it must read (the latent once, or expanded K and V) plus, for ``latent``, the two absorbed weights. The
bound is those bytes at the device's copy bandwidth (CUDA, measured) and the fraction is bound / measured time (on
the CPU no bound is given). Outputs are checked against ``sdpa`` (max abs error). A system the kernels refuse is recorded with the reason (the Triton
kernels take the 576-wide latent in 16-bit types for up to 32 query heads per KV head, not in float32). Then the KV bytes per token of the
model shape (all layers, latent vs expanded) and the largest running batch at `--budget-context` tokens each in a
`--kv-budget` pool. Prints a markdown table, writes ``mla.json`` and ``mla.png`` (if matplotlib is installed) under
``--out``.

    PYTHONPATH=. python benchmarks/bench_mla.py --out /tmp/mla                      # CUDA: DeepSeek-V2-Lite's shape
    PYTHONPATH=. python benchmarks/bench_mla.py --device cpu --shape tiny --out /tmp/mla
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hf_paged import kernels  # noqa: E402
from hf_paged.cache import parse_memory  # noqa: E402

# DeepSeek-V2-Lite: 16 heads, kv_lora_rank 512, rope 64, nope 128, v 128, 27 layers; and a CPU-sized one
SHAPES = {
    "lite": dict(heads=16, rank=512, rope=64, nope=128, v=128, layers=27),
    "tiny": dict(heads=4, rank=32, rope=16, nope=16, v=16, layers=2),
}
BLOCK_SIZE = 16


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def kv_bytes_per_token(shape: dict, element: int, latent: bool, value_is_key_once: bool = True) -> int:
    """One token's KV bytes over all layers: the latent (stored once, or twice as keys and values on a pool that does
    not share them) or expanded K (`nope + rope` per head) and V (`v` per head)."""
    if latent:
        return shape["layers"] * (shape["rank"] + shape["rope"]) * element * (1 if value_is_key_once else 2)
    return shape["layers"] * shape["heads"] * (shape["nope"] + shape["rope"] + shape["v"]) * element


def build(shape: dict, batch: int, context: int, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    """Latent pool, expanded pool and dense K/V of `batch` sequences of `context` tokens, all from one latent."""
    h, r, rope, nope, v = (shape[k] for k in ("heads", "rank", "rope", "nope", "v"))
    g = torch.Generator(device=device).manual_seed(seed)
    latent = torch.randn(batch, context, r + rope, device=device, dtype=dtype, generator=g)
    w_uk = torch.randn(h, nope, r, device=device, dtype=dtype, generator=g) * r ** -0.5
    w_uv = torch.randn(h, v, r, device=device, dtype=dtype, generator=g) * r ** -0.5
    q_nope = torch.randn(batch, h, nope, device=device, dtype=dtype, generator=g)
    q_pe = torch.randn(batch, h, rope, device=device, dtype=dtype, generator=g)
    k_nope = torch.einsum("btr,hnr->bhtn", latent[..., :r], w_uk)
    keys = torch.cat((k_nope, latent[:, None, :, r:].expand(-1, h, -1, -1)), dim=-1)  # [B, H, L, nope + rope]
    values = torch.einsum("btr,hvr->bhtv", latent[..., :r], w_uv)  # [B, H, L, v]
    per_seq = -(-context // BLOCK_SIZE)
    tables = torch.randperm(batch * per_seq, device=device, generator=g).to(torch.int32).view(batch, per_seq)

    def paged(dense: torch.Tensor) -> torch.Tensor:  # [B, Hkv, L, D] -> pool [blocks, Hkv, BLOCK_SIZE, D]
        padded = F.pad(dense, (0, 0, 0, per_seq * BLOCK_SIZE - context))
        blocks = padded.view(batch, dense.shape[1], per_seq, BLOCK_SIZE, -1).permute(0, 2, 1, 3, 4)
        pool = torch.empty(batch * per_seq, dense.shape[1], BLOCK_SIZE, dense.shape[-1], device=device, dtype=dtype)
        pool[tables.flatten().long()] = blocks.reshape(-1, *pool.shape[1:])
        return pool

    return dict(latent_pool=paged(latent[:, None]), key_pool=paged(keys), value_pool=paged(values), keys=keys,
                values=values, w_uk=w_uk, w_uv=w_uv, q_nope=q_nope, q_pe=q_pe, tables=tables,
                lens=torch.full((batch,), context, device=device, dtype=torch.int32))


def systems(data: dict, shape: dict) -> dict:
    """The callables timed, each returning the `[B, H, v]` attention output."""
    r, scale = shape["rank"], (shape["nope"] + shape["rope"]) ** -0.5
    query = torch.cat((data["q_nope"], data["q_pe"]), dim=-1)
    absorbed = torch.cat((torch.einsum("bhn,hnr->bhr", data["q_nope"], data["w_uk"]), data["q_pe"]), dim=-1)
    pool, tables, lens = data["latent_pool"], data["tables"], data["lens"]

    def latent():
        q = torch.cat((torch.einsum("bhn,hnr->bhr", data["q_nope"], data["w_uk"]), data["q_pe"]), dim=-1)
        out = kernels.paged_decode(q, pool, pool, tables, lens, scale)
        return torch.einsum("bhr,hvr->bhv", out[..., :r], data["w_uv"])

    def latent_kernel():
        return kernels.paged_decode(absorbed, pool, pool, tables, lens, scale)

    def expanded():
        return kernels.paged_decode(query, data["key_pool"], data["value_pool"], tables, lens, scale)

    def sdpa():
        return F.scaled_dot_product_attention(query[:, :, None], data["keys"], data["values"], scale=scale)[:, :, 0]

    return dict(latent=latent, latent_kernel=latent_kernel, expanded=expanded, sdpa=sdpa)


def read_bytes(shape: dict, batch: int, context: int, element: int) -> dict:
    """Bytes each system must read: its K/V (and the latent path's two absorbed weights)."""
    h, r, rope, nope, v = (shape[k] for k in ("heads", "rank", "rope", "nope", "v"))
    latent = batch * context * (r + rope) * element
    expanded = batch * context * h * (nope + rope + v) * element
    weights = h * (nope + v) * r * element
    return dict(latent=latent + weights, latent_kernel=latent, expanded=expanded, sdpa=expanded)


def timer(device: str, reps: int):
    if device == "cuda":
        import triton.testing

        return lambda fn: 1e3 * triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median")

    def cpu(fn):
        times = []
        for _ in range(reps + 1):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e6 * statistics.median(times[1:])
    return cpu


def run(args) -> dict:
    shape = SHAPES[args.shape]
    dtype = getattr(torch, args.dtype)
    element = torch.empty((), dtype=dtype).element_size()
    bench = timer(args.device, args.reps)
    bandwidth = None
    if args.device == "cuda":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import roofline

        bandwidth = roofline.copy_bandwidth("cuda") / 2  # read (or write) bytes per second of a copy
    records = []
    for batch in args.batches:
        for context in args.contexts:
            data = build(shape, batch, context, args.device, dtype)
            calls = systems(data, shape)
            reference = calls["sdpa"]().float()
            need = read_bytes(shape, batch, context, element)
            record = dict(batch=batch, context=context)
            for name, fn in calls.items():
                try:
                    out = fn()
                except ValueError as error:  # the Triton kernels take heads of up to 256 values: not the latent's 576
                    record[name] = dict(us=None, bytes=need[name], bound_us=None, fraction=None, error=None,
                                        refused=str(error))
                    continue
                us = bench(fn)
                error = None if name == "latent_kernel" else float((out.float() - reference).abs().max())
                bound = need[name] / bandwidth * 1e6 if bandwidth else None
                record[name] = dict(us=us, bytes=need[name], bound_us=bound,
                                    fraction=bound / us if bound else None, error=error)
            records.append(record)
            del data, calls
            if args.device == "cuda":
                torch.cuda.empty_cache()
    budget = parse_memory(args.kv_budget, "--kv-budget")
    per_token = {"latent": kv_bytes_per_token(shape, element, True),
                 "latent_stored_twice": kv_bytes_per_token(shape, element, True, value_is_key_once=False),
                 "expanded": kv_bytes_per_token(shape, element, False)}
    capacity = {name: budget // (b * args.budget_context) for name, b in per_token.items()}
    return dict(meta=dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                          shape=args.shape, **shape, dtype=args.dtype, block_size=BLOCK_SIZE, torch=torch.__version__,
                          read_bandwidth=bandwidth, kv_budget=budget, budget_context=args.budget_context),
                records=records, kv_bytes_per_token=per_token, max_running_batch=capacity)


def render(result: dict, out_dir: str) -> str:
    names = ("latent", "latent_kernel", "expanded", "sdpa")
    lines = ["| batch | context | " + " | ".join(f"{n} us (bound, fraction)" for n in names) + " | latent err |",
             "|---|---|" + "---|" * (len(names) + 1)]
    for rec in result["records"]:
        cells = []
        for n in names:
            r = rec[n]
            if r["us"] is None:
                cells.append(f"refused: {r['refused']}")
                continue
            cells.append(f"{r['us']:.1f} ({r['bound_us']:.1f}, {r['fraction']:.2f})" if r["bound_us"]
                         else f"{r['us']:.1f}")
        lines.append(f"| {rec['batch']} | {rec['context']} | " + " | ".join(cells) + f" | {rec['latent']['error'] or float('nan'):.2e} |")
    per_token, capacity = result["kv_bytes_per_token"], result["max_running_batch"]
    lines += ["", "| KV layout | bytes/token (all layers) | running batch in the budget |", "|---|---|---|"]
    lines += [f"| {n} | {per_token[n]} | {capacity[n]} |" for n in per_token]
    table = "\n".join(lines)
    with open(os.path.join(out_dir, "mla.json"), "w") as f:
        json.dump(result, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping the plot")
        return table
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"B{r['batch']}\nL{r['context']}" for r in result["records"]]
    width = 0.2
    for i, n in enumerate(names):
        ax.bar([x + i * width for x in range(len(labels))], [r[n]["us"] or 0 for r in result["records"]], width,
               label=n)
    ax.set_xticks([x + 1.5 * width for x in range(len(labels))], labels)
    ax.set_yscale("log")
    ax.set_ylabel("µs per decode attention call (one layer)")
    ax.set_title(f"MLA decode attention, {result['meta']['shape']} shape, {result['meta']['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "mla.png"), dpi=120)
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results", help="folder for mla.json / mla.png")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="model shape (default: lite on CUDA, tiny on the CPU)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--batches", type=_ints, default=None, help="default: 1,16,64 (CUDA), 1,4 (CPU)")
    parser.add_argument("--contexts", type=_ints, default=None, help="default: 1024,4096,16384 (CUDA), 64,256 (CPU)")
    parser.add_argument("--reps", type=int, default=None, help="CUDA: do_bench ms (default 100); CPU: runs (5)")
    parser.add_argument("--kv-budget", default="40GiB", help="the KV pool the running-batch figure assumes")
    parser.add_argument("--budget-context", type=int, default=4096, help="tokens per sequence in that figure")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_mla: --device cuda needs a CUDA GPU; pass --device cpu")
        return 1
    cpu = args.device == "cpu"
    args.shape = args.shape or ("tiny" if cpu else "lite")
    args.dtype = args.dtype or ("float32" if cpu else "bfloat16")
    args.batches = args.batches or ([1, 4] if cpu else [1, 16, 64])
    args.contexts = args.contexts or ([64, 256] if cpu else [1024, 4096, 16384])
    args.reps = args.reps or (5 if cpu else 100)
    os.makedirs(args.out, exist_ok=True)
    result = run(args)
    print(render(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
