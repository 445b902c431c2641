"""GPU microbenchmark: paged decode attention vs SDPA on a contiguous cache.

For each shape (bf16, block_size 16, shuffled physical blocks) it times, with
``triton.testing.do_bench`` (median, L2 flushed between repetitions):

* ``sdpa``: ``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` on a contiguous
  ``[B, Hkv, L, D]`` cache (the baseline a dense cache would give),
* ``gather+sdpa``: gather the paged K/V through the block table into contiguous tensors, then SDPA,
* ``paged``: ``hf_paged.kernels.paged_decode`` (Triton, default heuristics),
* ``paged FP8``: the same kernel on the cache stored as float8_e4m3fn with one scale per KV head (half the bytes),

Wide heads (over 256 values) run the wide kernel (`hf_paged.kernels.triton_decode_wide`): a DeepSeek-V2-Lite MLA
step (one 576-value latent per token, 16 query heads, the values the latent's first 512 columns: a view, read once)
a DeepSeek-V3 one (128 query heads) and a Gemma 4 global layer (head dim 512, GQA 8:1). ``--shapes wide`` runs those
alone, which is the GPU check of the wide kernel: every line must print (no compile error for shared memory or
registers) with a small max|err|; ``--sweep`` adds the wide tiles and, with more than 16 query heads per KV head,
blocks of 32 heads per program.

``--fp8-read-modes cast,fp16,bits`` times the FP8 cache once per way of reading its tiles (`triton_fp8.READ_MODE`, a
compile-time choice: "cast" converts a tile to bf16, "fp16" to fp16 with both dots in fp16, "bits" moves the e4m3 bits
into bf16 ones with integer ops, "bits_asm" likewise in inline PTX; "_t" loads the value tile transposed), each with its
µs, TB/s of its bytes, speed-up over bf16 and max|err| against SDPA, so that one GPU call picks the fastest; with
``--fp8-sweep`` each mode sweeps the tiles (within ``--budget-s``). ``--shapes llama8b`` runs the llama-8b-like shapes
alone (32 query heads, 8 KV heads, head dim 128, contexts 1k-3k, batches 64-320: issue 55's KV-bound FP8 workload).

``--cuda-graph`` times each call replayed from a CUDA graph instead (the engine's decode steps are; an eager call
also pays the wrapper's host time, which small shapes may not hide). ``--sweep`` adds a small sweep of the decode
kernel's launch configuration (BLOCK_N, num_warps, num_stages, then the split count) to fill the tuning table in
``hf_paged/kernels/triton_decode.py``; ``--fp8-sweep`` sweeps the tile for the FP8 cache; ``--tiles 64x2x3,...``
names the tiles to sweep instead of the built-in list.

Prints a markdown table (µs, TB/s of KV read, ratio to SDPA), writes ``decode_kernel.json``
and ``decode_kernel.png`` (if matplotlib is installed) under ``--out``.

    PYTHONPATH=. python benchmarks/bench_decode_kernel.py --out /tmp/bench [--sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch
import torch.nn.functional as F

SHAPES = [
    dict(name="B64-L2048-h32/8-d128", B=64, L=2048, Hq=32, Hkv=8, D=128, sdpa_anchor_us=190.6),
    dict(name="B256-L512-h32/8-d64", B=256, L=512, Hq=32, Hkv=8, D=64, sdpa_anchor_us=104.0),
    dict(name="B8-L8192-h32/8-d128", B=8, L=8192, Hq=32, Hkv=8, D=128, sdpa_anchor_us=108.7),
    dict(name="B128-L1024-h32/8-d128", B=128, L=1024, Hq=32, Hkv=8, D=128, sdpa_anchor_us=191.5),
    # a KV-bound llama-8b step (issue 55's FP8 workload) and a Gemma-3-1B global layer (head dim 256, one KV head)
    dict(name="B256-L2048-h32/8-d128", B=256, L=2048, Hq=32, Hkv=8, D=128, sdpa_anchor_us=None),
    dict(name="B240-L1024-h4/1-d256", B=240, L=1024, Hq=4, Hkv=1, D=256, sdpa_anchor_us=None),
    # multi-query attention (32 query heads on one KV head): an FP8 cache keeps the bf16 tile there
    # (`triton_decode.FP8_MAX_GROUP`), the check that it still gains
    dict(name="B128-L2048-h32/1-d128", B=128, L=2048, Hq=32, Hkv=1, D=128, sdpa_anchor_us=None),
    # more of issue 55's llama-8b steps (`--shapes llama8b`): the FP8 pool runs 1.5x the bf16 pool's batch
    dict(name="B320-L1024-h32/8-d128", B=320, L=1024, Hq=32, Hkv=8, D=128, sdpa_anchor_us=None),
    dict(name="B128-L3072-h32/8-d128", B=128, L=3072, Hq=32, Hkv=8, D=128, sdpa_anchor_us=None),
    dict(name="B320-L3072-h32/8-d128", B=320, L=3072, Hq=32, Hkv=8, D=128, sdpa_anchor_us=None),
    # wide heads: DeepSeek-V2-Lite's latent (values = the keys' first 512 columns) and a Gemma 4 global layer
    dict(name="B64-L2048-h16/1-d576/512", B=64, L=2048, Hq=16, Hkv=1, D=576, Dv=512, latent=True, sdpa_anchor_us=None),
    dict(name="B64-L4096-h16/2-d512", B=64, L=4096, Hq=16, Hkv=2, D=512, sdpa_anchor_us=None),
    # DeepSeek-V3's 128 query heads over the latent: 8 head blocks of 16 (the sweep also tries blocks of 32)
    dict(name="B32-L2048-h128/1-d576/512", B=32, L=2048, Hq=128, Hkv=1, D=576, Dv=512, latent=True,
         sdpa_anchor_us=None),
]
WIDE_SHAPES = [s["name"] for s in SHAPES if s["D"] > 256]
LLAMA8B_SHAPES = [s["name"] for s in SHAPES
                  if (s["Hq"], s["Hkv"], s["D"]) == (32, 8, 128) and s["B"] >= 64 and 1024 <= s["L"] <= 3072]
# triton_fp8.READ_MODES (checked in main: the parser needs no triton)
FP8_READ_MODES = ("cast", "fp16", "bits", "bits_asm", "cast_t", "fp16_t", "bits_t", "bits_asm_t")
BLOCK_SIZE = 16
DTYPE = torch.bfloat16

WIDE_TILE_SWEEP = [(16, 4, 2), (16, 8, 2), (32, 4, 1), (32, 4, 2), (32, 8, 1), (32, 8, 2), (64, 4, 1), (64, 8, 1)]
TILE_SWEEP = [  # (BLOCK_N, num_warps, num_stages)
    (32, 4, 2),
    (32, 4, 3),
    (32, 4, 4),
    (64, 4, 2),
    (64, 4, 3),
    (64, 4, 4),
    (64, 8, 2),
    (64, 8, 3),
    (128, 4, 2),
    (128, 4, 3),
    (128, 8, 2),
    (128, 8, 3),
    (16, 2, 3),
    (64, 2, 3),
]
SPLIT_SWEEP = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]


def build(shape, device="cuda", seed=0):
    """q ``[B, Hq, 1, D]``, contiguous k / v, paged caches, block tables, lengths. A `latent` shape's values are its
    keys' first `Dv` columns, in both layouts (views, as the MLA adapter passes them)."""
    B, L, Hq, Hkv, D = (shape[k] for k in ("B", "L", "Hq", "Hkv", "D"))
    Dv = shape.get("Dv", D)
    g = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(B, Hkv, L, D, device=device, dtype=DTYPE, generator=g)
    v = torch.randn(B, Hkv, L, Dv, device=device, dtype=DTYPE, generator=g)
    q = torch.randn(B, Hq, 1, D, device=device, dtype=DTYPE, generator=g)
    nbps = L // BLOCK_SIZE
    nb = B * nbps
    bt = torch.randperm(nb, device=device, generator=g).to(torch.int32).view(B, nbps)
    kc = torch.empty(nb, Hkv, BLOCK_SIZE, D, device=device, dtype=DTYPE)
    vc = torch.empty(nb, Hkv, BLOCK_SIZE, Dv, device=device, dtype=DTYPE)
    idx = bt.flatten().long()
    kc[idx] = k.view(B, Hkv, nbps, BLOCK_SIZE, D).permute(0, 2, 1, 3, 4).reshape(nb, Hkv, BLOCK_SIZE, D)
    vc[idx] = v.view(B, Hkv, nbps, BLOCK_SIZE, Dv).permute(0, 2, 1, 3, 4).reshape(nb, Hkv, BLOCK_SIZE, Dv)
    if shape.get("latent"):
        v, vc = k[..., :Dv], kc[..., :Dv]
    sl = torch.full((B,), L, device=device, dtype=torch.int32)
    return q, k, v, kc, vc, bt, sl


def kv_bytes(shape) -> int:
    """Bytes of K/V one step reads: a latent shape's values are its keys (read once)."""
    per_token = shape["D"] + (0 if shape.get("latent") else shape.get("Dv", shape["D"]))
    return shape["B"] * shape["Hkv"] * shape["L"] * per_token * torch.tensor([], dtype=DTYPE).element_size()


def decode_module(shape):
    """The kernel module a shape runs (`triton_decode`, or `triton_decode_wide` for heads over 256) and the
    (sequence, head) programs per split its split rule counts."""
    from hf_paged.kernels import triton_decode, triton_decode_wide

    if max(shape["D"], shape.get("Dv", shape["D"])) <= 256:
        return triton_decode, shape["Hkv"]
    blocks = -(-(shape["Hq"] // shape["Hkv"]) // triton_decode_wide.BLOCK_H)
    return triton_decode_wide, shape["Hkv"] * blocks


def copy_bandwidth(bench, dev) -> float:
    """TB/s of a 512 MiB device-to-device copy, counting bytes read and written."""
    src = torch.randint(0, 255, (1 << 29,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t_us = bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (t_us * 1e-6) / 1e12


def run_shape(shape, args, bench, t_start, budget_s):
    from hf_paged import kernels
    from hf_paged.kernels import triton_decode as td

    mod, programs = decode_module(shape)
    q4, k, v, kc, vc, bt, sl = build(shape)
    dev = q4.device
    q = q4[:, :, 0, :].contiguous()
    D = shape["D"]
    scale = D**-0.5
    nbytes = kv_bytes(shape)

    def sdpa():
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    def gather_sdpa():
        kg = kc[bt.long()].permute(0, 2, 1, 3, 4).reshape(k.shape)
        vg = vc[bt.long()].permute(0, 2, 1, 3, 4).reshape(v.shape)
        return F.scaled_dot_product_attention(q4, kg, vg, scale=scale, enable_gqa=True)

    def paged():
        return kernels.paged_decode(q, kc, vc, bt, sl, scale)

    # the same cache in FP8 (e4m3, one scale per KV head, as `hf_paged.cache.kv_quant` keeps it): half the bytes
    k_scale = kc.float().abs().amax(dim=(0, 2, 3)).clamp(min=1e-6) / 448.0
    v_scale = vc.float().abs().amax(dim=(0, 2, 3)).clamp(min=1e-6) / 448.0
    kc8 = (kc.float() / k_scale[None, :, None, None]).to(torch.float8_e4m3fn)
    vc8 = (vc.float() / v_scale[None, :, None, None]).to(torch.float8_e4m3fn)
    if shape.get("latent"):  # one FP8 latent, its scale for keys and values alike
        v_scale, vc8 = k_scale, kc8[..., :vc.shape[-1]]

    def paged_fp8():
        return kernels.paged_decode(q, kc8, vc8, bt, sl, scale, k_scale=k_scale, v_scale=v_scale)

    ref = sdpa()[:, :, 0, :].float()
    err = (paged().float() - ref).abs().max().item()
    err_g = (gather_sdpa()[:, :, 0, :].float() - ref).abs().max().item()
    block_n = mod._config(D, vc.shape[-1])[1] if mod is not td else td.launch_config(D)[0]

    def splits_of(block_n: int) -> int:  # the heuristic's split count for a tile of `block_n` keys
        return td.choose_num_splits(shape["B"], programs, bt.shape[1] * BLOCK_SIZE, block_n, dev)

    splits = splits_of(block_n)
    r = dict(shape, kv_bytes=nbytes, max_abs_err_vs_sdpa=err, gather_err=err_g, default_splits=splits)
    r["sdpa_us"] = bench(sdpa)
    r["gather_sdpa_us"] = bench(gather_sdpa)
    r["paged_us"] = bench(paged)
    r["fp8_err_vs_sdpa"] = (paged_fp8().float() - ref).abs().max().item()
    r["paged_fp8_us"] = bench(paged_fp8)
    for key in ("sdpa", "gather_sdpa", "paged"):
        r[f"{key}_tbps"] = nbytes / (r[f"{key}_us"] * 1e-6) / 1e12
    r["paged_fp8_tbps"] = nbytes / 2 / (r["paged_fp8_us"] * 1e-6) / 1e12
    r["fp8_speedup"] = r["paged_us"] / r["paged_fp8_us"]
    r["ratio"] = r["paged_us"] / r["sdpa_us"]
    print(
        f"{shape['name']}: sdpa {r['sdpa_us']:.1f} us, gather+sdpa {r['gather_sdpa_us']:.1f} us, "
        f"paged {r['paged_us']:.1f} us ({r['paged_tbps']:.2f} TB/s, x{r['ratio']:.3f}, splits={splits}), "
        f"max|err| {err:.2e}; FP8 cache {r['paged_fp8_us']:.1f} us ({r['paged_fp8_tbps']:.2f} TB/s of its bytes, "
        f"x{r['fp8_speedup']:.2f} over bf16, max|err| {r['fp8_err_vs_sdpa']:.2e})",
        flush=True,
    )

    if args.fp8_read_modes:
        r["fp8_read_modes"] = time_read_modes(args.fp8_read_modes.split(","), paged_fp8, ref, bench, nbytes / 2,
                                              r["paged_us"])
    tiles = args.tiles or (WIDE_TILE_SWEEP if mod is not td else TILE_SWEEP)

    if args.sweep or args.fp8_sweep:
        # the FP8 cache's tiles hold half the bytes of bf16 ones: is a wider tile (more bytes in flight) what it needs?
        # with --fp8-read-modes, every tile in each mode (`triton_fp8.READ_MODE`, restored after)
        from hf_paged.kernels import triton_fp8

        fp8_sweep, saved = [], triton_fp8.READ_MODE
        for mode in (args.fp8_read_modes.split(",") if args.fp8_read_modes else [saved]):
            triton_fp8.READ_MODE = mode
            rows = sweep_tiles(
                tiles, lambda bn, nw, ns, sp: mod.paged_decode(q, kc8, vc8, bt, sl, scale, num_splits=sp, block_n=bn,
                                                               num_warps=nw, num_stages=ns, k_scale=k_scale,
                                                               v_scale=v_scale),
                splits_of, bench, lambda: bool(args.fp8_read_modes) and time.time() - t_start > budget_s,
                f"FP8 {mode} ")
            fp8_sweep += [dict(mode=mode, **row) for row in rows]
        triton_fp8.READ_MODE = saved
        if fp8_sweep:
            r["fp8_sweep"] = fp8_sweep
            r["fp8_best"] = min(fp8_sweep, key=lambda x: x["us"])
            print(f"  FP8 best: {r['fp8_best']}", flush=True)
    if args.sweep:
        sweep = sweep_tiles(
            tiles, lambda bn, nw, ns, sp: mod.paged_decode(q, kc, vc, bt, sl, scale, num_splits=sp, block_n=bn,
                                                           num_warps=nw, num_stages=ns),
            splits_of, bench, lambda: time.time() - t_start > budget_s, "", ref=ref)
        if sweep:
            best = min(sweep, key=lambda x: x["us"])
            for sp in SPLIT_SWEEP:
                if time.time() - t_start > budget_s:
                    break
                if sp == best["splits"]:
                    continue

                def fn(sp=sp, best=best):
                    return mod.paged_decode(
                        q,
                        kc,
                        vc,
                        bt,
                        sl,
                        scale,
                        num_splits=sp,
                        block_n=best["block_n"],
                        num_warps=best["num_warps"],
                        num_stages=best["num_stages"],
                    )

                e = (fn().float() - ref).abs().max().item()
                us = bench(fn)
                sweep.append(
                    dict(
                        block_n=best["block_n"],
                        num_warps=best["num_warps"],
                        num_stages=best["num_stages"],
                        splits=sp,
                        us=us,
                        err=e,
                    )
                )
                print(f"  splits={sp} (best tile): {us:.1f} us", flush=True)
            if mod is not td and shape["Hq"] // shape["Hkv"] > 16:  # wider head blocks read the latent fewer times
                sweep += sweep_head_blocks(shape, mod, min(sweep, key=lambda x: x["us"]), bench, ref,
                                           (q, kc, vc, bt, sl, scale))
            best = min(sweep, key=lambda x: x["us"])
            r["sweep"] = sweep
            r["best"] = best
            r["best_tbps"] = nbytes / (best["us"] * 1e-6) / 1e12
            r["best_ratio"] = best["us"] / r["sdpa_us"]
    return r


def time_read_modes(modes: list[str], fn, ref: torch.Tensor, bench, nbytes: float, bf16_us: float) -> dict:
    """The FP8 decode `fn` timed with each of `modes` as `triton_fp8.READ_MODE` (each compiles its own kernel): per
    mode µs, TB/s of its `nbytes`, speed-up over the bf16 cache's `bf16_us`, max|err| against `ref` (SDPA). A mode
    that fails to compile is printed and left out; the setting is restored after."""
    from hf_paged.kernels import triton_fp8

    saved, out = triton_fp8.READ_MODE, {}
    try:
        for mode in modes:
            triton_fp8.READ_MODE = mode
            try:
                err = (fn().float() - ref).abs().max().item()
                us = bench(fn)
            except Exception as exc:  # a compile error (shared memory, registers, an unsupported conversion)
                print(f"  FP8 read {mode}: failed ({type(exc).__name__}: {str(exc)[:200]})", flush=True)
                continue
            out[mode] = dict(us=us, tbps=nbytes / (us * 1e-6) / 1e12, speedup=bf16_us / us, err=err)
            print(f"  FP8 read {mode}: {us:.1f} us ({out[mode]['tbps']:.2f} TB/s of its bytes, x{bf16_us / us:.2f} "
                  f"over bf16, max|err| {err:.2e})", flush=True)
    finally:
        triton_fp8.READ_MODE = saved
    return out


def sweep_tiles(tiles, run, splits_of, bench, out_of_time, label: str, ref: torch.Tensor | None = None) -> list[dict]:
    """Time ``run(block_n, num_warps, num_stages, splits)`` at each tile of `tiles` (splits: ``splits_of(block_n)``)
    until ``out_of_time()``; with `ref`, each row also records the max abs error against it. A tile that does not
    compile (shared memory, registers) is reported and skipped. `label` prefixes the printed lines."""
    rows = []
    for bn, nw, ns in tiles:
        if out_of_time():
            print(f"  ({label}sweep budget exhausted)")
            break
        sp = splits_of(bn)

        def fn(bn=bn, nw=nw, ns=ns, sp=sp):
            return run(bn, nw, ns, sp)

        try:
            err = None if ref is None else (fn().float() - ref).abs().max().item()
            us = bench(fn)
        except Exception as exc:  # out of shared memory / registers
            print(f"  {label}tile {bn},{nw},{ns}: failed ({type(exc).__name__})")
            continue
        rows.append(dict(block_n=bn, num_warps=nw, num_stages=ns, splits=sp, us=us))
        if err is not None:
            rows[-1]["err"] = err
        print(f"  {label}tile BLOCK_N={bn} warps={nw} stages={ns} splits={sp}: {us:.1f} us"
              + ("" if err is None else f" (err {err:.1e})"), flush=True)
    return rows


def sweep_head_blocks(shape, mod, tile, bench, ref, call) -> list[dict]:
    """The wide kernel's best tile with 32 and 64 query heads per program (16 by default): fewer programs read each
    latent tile, but each holds a wider accumulator (registers)."""
    from hf_paged.kernels import triton_decode as td

    out = []
    group = shape["Hq"] // shape["Hkv"]
    for bh in (32, 64):
        if bh >= 2 * group:
            break
        programs = shape["Hkv"] * -(-group // bh)
        sp = td.choose_num_splits(shape["B"], programs, call[3].shape[1] * BLOCK_SIZE, tile["block_n"], call[0].device)

        def fn(bh=bh, sp=sp):
            return mod.paged_decode(*call, num_splits=sp, block_n=tile["block_n"], num_warps=tile["num_warps"],
                                    num_stages=tile["num_stages"], block_h=bh)

        try:
            e = (fn().float() - ref).abs().max().item()
            us = bench(fn)
        except Exception as exc:  # out of shared memory / registers
            print(f"  block_h={bh}: failed ({type(exc).__name__})")
            continue
        out.append(dict(block_n=tile["block_n"], num_warps=tile["num_warps"], num_stages=tile["num_stages"],
                        splits=sp, block_h=bh, us=us, err=e))
        print(f"  block_h={bh} (best tile) splits={sp}: {us:.1f} us (err {e:.1e})", flush=True)
    return out


def render(results, meta, out_dir) -> int:
    """Markdown table (printed and written), JSON, PNG plot."""
    lines = [
        f"Paged decode vs SDPA on {meta['device']} ({meta['sms']} SMs), bf16, block_size {BLOCK_SIZE}, "
        f"shuffled blocks; torch {meta['torch']}, triton {meta['triton']}; do_bench median, L2 flushed; "
        f"copy ceiling {meta['copy_tbps']:.2f} TB/s",
        "",
        "| shape | SDPA µs (anchor) | gather+SDPA µs | paged µs | paged TB/s | SDPA TB/s | paged/SDPA | splits | max abs err "
        "| FP8 paged µs | FP8 TB/s (its bytes) | FP8 speed-up |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['name']} | {r['sdpa_us']:.1f} ({r['sdpa_anchor_us'] or '-'}) | {r['gather_sdpa_us']:.1f} | "
            f"{r['paged_us']:.1f} | {r['paged_tbps']:.2f} | {r['sdpa_tbps']:.2f} | {r['ratio']:.3f} | "
            f"{r['default_splits']} | {r['max_abs_err_vs_sdpa']:.1e} | {r['paged_fp8_us']:.1f} | "
            f"{r['paged_fp8_tbps']:.2f} | {r['fp8_speedup']:.2f}x |"
        )
    modes = list(dict.fromkeys(m for r in results for m in r.get("fp8_read_modes", {})))
    if modes:
        lines += [
            "",
            "FP8 cache by read mode (`triton_fp8.READ_MODE`): µs, TB/s of its bytes, speed-up over bf16, max abs err "
            "vs SDPA",
            "",
            "| shape | bf16 paged µs | " + " | ".join(modes) + " |",
            "|---|---|" + "---|" * len(modes),
        ]
        for r in results:
            cells = []
            for m in modes:
                x = r.get("fp8_read_modes", {}).get(m)
                cells.append(f"{x['us']:.1f} / {x['tbps']:.2f} / {x['speedup']:.2f}x / {x['err']:.1e}" if x else "-")
            lines.append(f"| {r['name']} | {r['paged_us']:.1f} | " + " | ".join(cells) + " |")
    if any("best" in r for r in results):
        lines += [
            "",
            "Best swept configuration per shape:",
            "",
            "| shape | BLOCK_N | warps | stages | splits | µs | TB/s | /SDPA |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            if "best" in r:
                b = r["best"]
                lines.append(
                    f"| {r['name']} | {b['block_n']} | {b['num_warps']} | {b['num_stages']} | {b['splits']} | "
                    f"{b['us']:.1f} | {r['best_tbps']:.2f} | {r['best_ratio']:.3f} |"
                )
    table = "\n".join(lines)
    print()
    print(table)
    with open(os.path.join(out_dir, "decode_kernel.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out_dir, "decode_kernel.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping the plot")
        return 0
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [r["name"] for r in results]
    xs = range(len(results))
    w = 0.27
    ax.bar([x - w for x in xs], [r["sdpa_us"] for r in results], w, label="SDPA (contiguous cache)")
    ax.bar(list(xs), [r["gather_sdpa_us"] for r in results], w, label="gather + SDPA")
    ax.bar([x + w for x in xs], [r["paged_us"] for r in results], w, label="paged_decode (Triton)")
    for x, r in zip(xs, results):
        ax.text(x + w, r["paged_us"], f"{r['paged_tbps']:.2f}\nTB/s", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, fontsize=8)
    ax.set_ylabel("µs (lower is better)")
    ax.set_title(f"Decode attention, bf16, block_size {BLOCK_SIZE} ({meta['device']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "decode_kernel.png"), dpi=120)
    print(f"wrote {os.path.join(out_dir, 'decode_kernel.png')}")
    return 0


def _read_modes(text: str) -> str:
    """`--fp8-read-modes`: a comma-separated list of `FP8_READ_MODES` (an argparse error names an unknown one)."""
    unknown = [m for m in text.split(",") if m not in FP8_READ_MODES]
    if text and unknown:
        raise argparse.ArgumentTypeError(f"unknown FP8 read mode(s) {unknown}: choose from {','.join(FP8_READ_MODES)}")
    return text


def _tiles(text: str) -> list[tuple[int, int, int]]:
    """`--tiles`: comma-separated ``BLOCK_NxWARPSxSTAGES`` (e.g. ``64x2x3``), each a power of two but the stages."""
    tiles = []
    for item in filter(None, text.split(",")):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"--tiles: {item!r} is not BLOCK_NxWARPSxSTAGES (e.g. 64x2x3)")
        bn, nw, ns = map(int, parts)
        if bn & (bn - 1) or nw & (nw - 1):
            raise argparse.ArgumentTypeError(f"--tiles: {item!r}: BLOCK_N and WARPS must be powers of two")
        tiles.append((bn, nw, ns))
    return tiles


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results", help="folder for decode_kernel.json / .png")
    ap.add_argument("--sweep", action="store_true", help="also sweep the decode kernel's launch configuration")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="time every call replayed from a CUDA graph (no host time; L2 not flushed between replays)")
    ap.add_argument("--fp8-sweep", action="store_true", help="sweep the launch configuration for the FP8 cache only")
    ap.add_argument("--fp8-read-modes", default="", type=_read_modes, metavar="cast,fp16,bits",
                    help="time the FP8 cache once per tile read mode (triton_fp8.READ_MODE), comma-separated")
    ap.add_argument("--tiles", type=_tiles, default=[], metavar="64x2x3,128x4x2",
                    help="the tiles (BLOCK_N x warps x stages) --sweep / --fp8-sweep try, instead of the built-in list")
    ap.add_argument("--rep", type=int, default=200, help="do_bench repetition time (ms)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="sweep time budget (s), split evenly over the shapes")
    ap.add_argument("--shapes", default="",
                    help="comma-separated subset of shape names; 'wide' for the heads over 256 (the wide kernel), "
                         "'llama8b' for the llama-8b-like ones")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_decode_kernel: needs a CUDA GPU; nothing measured.")
        return 0
    import triton
    import triton.testing

    from hf_paged.kernels import triton_decode as td

    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    meta = dict(
        device=props.name,
        sms=props.multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        dtype=str(DTYPE),
        block_size=BLOCK_SIZE,
        default_configs={str(k): v for k, v in td._CONFIGS.items()},
        fp8_configs={str(k): v for k, v in td._FP8_CONFIGS.items()},
    )
    print(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")

    def bench(fn):
        if args.cuda_graph:  # replayed from a CUDA graph, as the engine's decode steps run: no host time in it
            fn()  # compile outside the capture
            return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=args.rep, return_mode="median")
        return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=args.rep, return_mode="median")

    # copy-bandwidth ceiling (read + write), for context
    meta["copy_tbps"] = copy_bandwidth(bench, dev)
    print(f"# device-to-device copy: {meta['copy_tbps']:.2f} TB/s (read+write)")

    from hf_paged.kernels import triton_fp8

    assert FP8_READ_MODES == triton_fp8.READ_MODES, "bench_decode_kernel.FP8_READ_MODES is out of date"
    names = (args.shapes.replace("wide", ",".join(WIDE_SHAPES)).replace("llama8b", ",".join(LLAMA8B_SHAPES))
             .split(",") if args.shapes else None)
    shapes = [s for s in SHAPES if names is None or s["name"] in names]
    results = []
    for shape in shapes:
        results.append(run_shape(shape, args, bench, time.time(), args.budget_s / len(shapes)))
        torch.cuda.empty_cache()
        with open(os.path.join(args.out, "decode_kernel.json"), "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)

    return render(results, meta, args.out)


if __name__ == "__main__":
    sys.exit(main())
