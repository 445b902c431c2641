"""Current vs per-sequence-split decode kernel, heuristic variants, graph-timed over 16 layers' caches (device).

    python sweep_split.py [SHAPES [VARIANTS [BATCHES]]]
SHAPES "Hq/Hkv/d,...", VARIANTS "no_split/target/min_tokens,...", BATCHES "4,8,...". `decode_cur` is the kernel
before the change: `git show 43a6245:hf_paged/kernels/triton_decode.py > decode_cur.py` beside this script.
split/sweep_split.log ran the defaults below; split_d128/sweep_d128.log ran
    sweep_split.py 16/8/128 4/6/128,8/8/128,8/8/256,6/8/128 4,8,16,32,48,64,96,128,160,192
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import decode_cur as cur  # noqa: E402
import torch  # noqa: E402

from hf_paged.kernels import triton_decode as new  # noqa: E402

LAYERS = 16
WIDTH = 8192  # the engine's static table width (tokens)
BW = 3.0e12


def time_layers(fn, replays=15):
    for i in range(LAYERS):
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(LAYERS):
            fn(i)
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / LAYERS * 1e3)
    return sorted(ts)[len(ts) // 2]


def _arg(i, default):
    return sys.argv[i] if len(sys.argv) > i else default


SHAPES = [tuple(int(v) for v in s.split("/")) for s in _arg(1, "32/8/64,16/8/128").split(",")]
VARIANTS = {s: tuple(int(v) for v in s.split("/")) for s in _arg(2, "2/3/256,4/6/256,4/6/128,8/8/256").split(",")}
BATCHES = [int(b) for b in _arg(3, "4,8,16,24,32,48,64,96,128,192").split(",")]
DEFAULTS = new.NO_SPLIT_PROGRAMS_PER_SM, new.TARGET_PROGRAMS_PER_SM, new.MIN_TOKENS_PER_SPLIT
torch.manual_seed(0)
for hq, hkv, d in SHAPES:
    print(f"\n## Hq {hq} / Hkv {hkv} / d {d}, table {WIDTH} tokens, us per layer (bound = KV bytes at 3.0 TB/s)")
    print("| B | contexts | bound us | cur | " + " | ".join(VARIANTS) + " | splits cur / new |")
    print("|---" * (5 + len(VARIANTS)) + "|")
    bs = 16
    for lo_len, hi_len in ((100, 1100), (500, 2500), (1000, 4000)):
        for B in BATCHES:
            nblk = WIDTH // bs
            lens = torch.randint(lo_len, hi_len, (B,), device="cuda", dtype=torch.int32)
            need = int(sum(-(-int(n) // bs) for n in lens.tolist()))
            caches = []
            for _ in range(LAYERS):
                kc = torch.randn(need + 1, hkv, bs, d, device="cuda", dtype=torch.bfloat16)
                caches.append((kc, torch.randn_like(kc)))
            bt = torch.zeros(B, nblk, dtype=torch.int32, device="cuda")
            perm = torch.randperm(need, device="cuda").to(torch.int32) + 1
            k = 0
            for r, n in enumerate(lens.tolist()):
                m = -(-n // bs)
                bt[r, :m] = perm[k:k + m]
                k += m
            q = torch.randn(B, hq, d, device="cuda", dtype=torch.bfloat16)
            kv_bytes = int(lens.sum()) * hkv * d * 2 * 2
            ref = cur.paged_decode(q, caches[0][0], caches[0][1], bt, lens, d ** -0.5)
            t_cur = time_layers(lambda i: cur.paged_decode(q, caches[i][0], caches[i][1], bt, lens, d ** -0.5))
            row = []
            for _name, (ns, tgt, mn) in VARIANTS.items():
                new.NO_SPLIT_PROGRAMS_PER_SM, new.TARGET_PROGRAMS_PER_SM, new.MIN_TOKENS_PER_SPLIT = ns, tgt, mn
                out = new.paged_decode(q, caches[0][0], caches[0][1], bt, lens, d ** -0.5)
                assert (out.float() - ref.float()).abs().max().item() < 2e-2
                row.append(time_layers(lambda i: new.paged_decode(q, caches[i][0], caches[i][1], bt, lens, d ** -0.5)))
            new.NO_SPLIT_PROGRAMS_PER_SM, new.TARGET_PROGRAMS_PER_SM, new.MIN_TOKENS_PER_SPLIT = DEFAULTS
            sc = cur.choose_num_splits(B, hkv, WIDTH, 64, q.device)
            sn = new.choose_num_splits(B, hkv, WIDTH, 64, q.device)
            print(f"| {B} | {lo_len}-{hi_len} | {kv_bytes / BW * 1e6:.1f} | {t_cur:.1f} | "
                  + " | ".join(f"{t:.1f}" for t in row) + f" | {sc} / {sn} |", flush=True)
