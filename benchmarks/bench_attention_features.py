"""Paged kernels with sliding windows / soft-capping / sinks vs dense baselines on realistic shapes (GPU).

Decode (one query per sequence over a long paged context) and prefill (one long prompt), each with:

* ``window``  : sliding window (Gemma-3-like: Hq 8, Hkv 4, D 256, W 1024). Baseline: SDPA over contiguous K/V with a
  boolean window mask (it reads the whole context), and FlexAttention with a sliding block mask when available.
* ``softcap`` : logit soft-capping 50 (Gemma-2-like, D 256, W 4096). Baseline: FlexAttention ``score_mod`` (SDPA
  cannot express it), else eager torch.
* ``sinks``   : gpt-oss-like (Hq 64, Hkv 8, D 64, W 128, one sink per head). Baseline: eager torch (softmax over
  ``[logits, sink]``); FlexAttention cannot add a denominator term.
* ``none``    : the same shape without the option (the option's own cost).

Also prints the KV memory a window bounds on a Gemma-3-27B-shaped model (62 layers, 5 of 6 sliding with W 1024,
16 KV heads, D 128, bf16) at several context lengths: what blocks wholly out of every sliding layer's window would
free. (This round the kernels skip those blocks; returning them to the pool is not done yet.)

Writes ``attention_features.json`` and ``attention_features.png`` under ``--out``. Prints ratio = baseline / paged
(> 1: the paged kernel is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hf_paged import kernels  # noqa: E402
from hf_paged.kernels.reference import masked_attention  # noqa: E402

SHAPES = {
    "window": dict(hq=8, hkv=4, d=256, opts=dict(sliding_window=1024)),
    "softcap": dict(hq=16, hkv=8, d=256, opts=dict(sliding_window=4096, softcap=50.0)),
    "sinks": dict(hq=64, hkv=8, d=64, opts=dict(sliding_window=128, sinks=True)),
}


def _flex():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        return torch.compile(flex_attention, dynamic=False), create_block_mask
    except Exception:  # older torch / no inductor
        return None, None


def build(B, ctx, hq, hkv, d, bs=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk = -(-ctx // bs)
    kc = torch.randn(B * nblk + 1, hkv, bs, d, device="cuda", dtype=dtype, generator=g)
    vc = torch.randn_like(kc)
    perm = torch.randperm(B * nblk, device="cuda", generator=g).to(torch.int32)
    bt = perm.reshape(B, nblk)
    seq = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    return kc, vc, bt, seq


def contiguous(cache, bt, ctx):
    """`[B, Hkv, ctx, D]` copy of each row (the dense baselines' input; not timed)."""
    g = cache[bt.long()]  # [B, n, Hkv, bs, D]
    B, n, h, bs, d = g.shape
    return g.permute(0, 2, 1, 3, 4).reshape(B, h, n * bs, d)[:, :, :ctx].contiguous()


def run_case(name, shape, mode, args, bench, flex):
    hq, hkv, d, opts = shape["hq"], shape["hkv"], shape["d"], dict(shape["opts"])
    B, ctx = (args.batch, args.context) if mode == "decode" else (1, args.prefill_len)
    kc, vc, bt, seq = build(B, ctx, hq, hkv, d)
    if opts.pop("sinks", False):
        opts["sinks"] = torch.randn(hq, device="cuda", dtype=torch.float32)
    scale = d**-0.5
    W = opts.get("sliding_window")
    k, v = contiguous(kc, bt, ctx), contiguous(vc, bt, ctx)
    G = hq // hkv
    if mode == "decode":
        q = torch.randn(B, hq, d, device="cuda", dtype=kc.dtype)
        paged = lambda o=opts: kernels.paged_decode(q, kc, vc, bt, seq, scale, **o)  # noqa: E731
        q4 = q[:, :, None, :]
        qpos = torch.tensor([ctx - 1], device="cuda")
    else:
        q = torch.randn(ctx, hq, d, device="cuda", dtype=kc.dtype)
        cu = torch.tensor([0, ctx], dtype=torch.int32, device="cuda")
        paged = lambda o=opts: kernels.paged_prefill(q, kc, vc, bt, cu, seq, scale, ctx, **o)  # noqa: E731
        q4 = q.transpose(0, 1)[None]
        qpos = torch.arange(ctx, device="cuda")
    kpos = torch.arange(ctx, device="cuda")
    mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - (W or ctx + 1))
    row = dict(feature=name, mode=mode, batch=B, context=ctx, hq=hq, hkv=hkv, d=d,
               paged_ms=bench(paged), paged_plain_ms=bench(lambda: paged({})))
    if "softcap" not in opts and "sinks" not in opts:
        row["baseline"] = "sdpa+mask"
        row["baseline_ms"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(
            q4, k, v, attn_mask=mask, scale=scale, enable_gqa=True))
    elif "sinks" not in opts and flex[0] is not None:
        fa, cbm = flex
        cap = opts["softcap"]
        off = ctx - q4.shape[2]

        def score_mod(s, b, h, qi, ki):
            return cap * torch.tanh(s / cap)

        def mask_mod(b, h, qi, ki):
            return (ki <= qi + off) & (ki > qi + off - W)

        bm = cbm(mask_mod, None, None, q4.shape[2], ctx, device="cuda")
        row["baseline"] = "flex(score_mod+block_mask)"
        row["baseline_ms"] = bench(lambda: fa(q4, k, v, score_mod=score_mod, block_mask=bm, scale=scale,
                                              enable_gqa=True))
    else:
        kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        sink = opts.get("sinks")
        sink_col = sink.reshape(1, hq, 1, 1) if sink is not None else None
        row["baseline"] = "eager torch"
        if mode == "prefill" and ctx * ctx * hq > 2**31:
            row["baseline_ms"] = float("nan")  # the [Hq, L, L] logits would not fit
        else:
            row["baseline_ms"] = bench(lambda: masked_attention(q4, kk, vv, mask, scale, opts.get("softcap"), sink_col))
    row["ratio"] = row["baseline_ms"] / row["paged_ms"]
    return row


def kv_memory(contexts, layers=62, sliding_every=6, window=1024, hkv=16, d=128, bytes_per=2, block=16):
    """KV bytes per sequence: all layers full vs sliding layers bounded by the window (block-rounded)."""
    out = []
    per_tok_layer = 2 * hkv * d * bytes_per
    n_sliding = layers - layers // sliding_every
    for ctx in contexts:
        full = layers * ctx * per_tok_layer
        bounded_tokens = min(ctx, (-(-window // block) + 1) * block)  # window plus the partly used block
        win = (layers - n_sliding) * ctx * per_tok_layer + n_sliding * bounded_tokens * per_tok_layer
        out.append(dict(context=ctx, full_gib=full / 2**30, windowed_gib=win / 2**30, saved=1 - win / full))
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--features", default="window,softcap,sinks")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    import triton.testing

    def bench(fn):
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=100)

    flex = _flex()
    rows = []
    print(f"{'feature':8} {'mode':7} {'B':>3} {'ctx':>6} {'paged ms':>9} {'no-opt ms':>9} {'baseline':>26} "
          f"{'base ms':>9} {'ratio':>6}")
    for name in args.features.split(","):
        for mode in ("decode", "prefill"):
            try:
                r = run_case(name, SHAPES[name], mode, args, bench, flex)
            except Exception as e:  # keep the other rows
                print(f"{name} {mode}: failed: {type(e).__name__}: {e}")
                continue
            rows.append(r)
            print(f"{name:8} {mode:7} {r['batch']:>3} {r['context']:>6} {r['paged_ms']:9.3f} {r['paged_plain_ms']:9.3f} "
                  f"{r['baseline']:>26} {r['baseline_ms']:9.3f} {r['ratio']:6.2f}")
    mem = kv_memory([4096, 8192, 32768, 131072])
    print("\nKV per sequence, Gemma-3-27B shape (62 layers, 5:1 sliding W=1024, 16 KV heads, D 128, bf16)")
    for m in mem:
        print(f"  ctx {m['context']:>6}: full {m['full_gib']:7.2f} GiB  window-bounded {m['windowed_gib']:7.2f} GiB"
              f"  saved {100 * m['saved']:5.1f} %")
    os.makedirs(args.out, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    with open(os.path.join(args.out, "attention_features.json"), "w") as f:
        json.dump(dict(meta=meta, kernels=rows, kv_memory=mem), f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        labels = [f"{r['feature']}\n{r['mode']}" for r in rows]
        x = range(len(rows))
        ax[0].bar([i - 0.2 for i in x], [r["paged_ms"] for r in rows], 0.4, label="hf_paged")
        ax[0].bar([i + 0.2 for i in x], [r["baseline_ms"] for r in rows], 0.4, label="baseline")
        ax[0].set_xticks(list(x), labels)
        ax[0].set_ylabel("ms")
        ax[0].legend()
        ax[1].plot([m["context"] for m in mem], [m["full_gib"] for m in mem], "o-", label="all layers full")
        ax[1].plot([m["context"] for m in mem], [m["windowed_gib"] for m in mem], "o-", label="sliding layers bounded")
        ax[1].set_xscale("log", base=2)
        ax[1].set_xlabel("context")
        ax[1].set_ylabel("KV GiB / sequence")
        ax[1].legend()
        fig.suptitle(meta["device"])
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "attention_features.png"), dpi=110)
    except ImportError:
        print("matplotlib missing: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
