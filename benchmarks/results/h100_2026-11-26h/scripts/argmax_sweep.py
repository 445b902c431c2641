"""Greedy pick over [rows, 128256] bf16 logits, CUDA-graph timed: torch's argmax, the committed Triton pick, and
Triton variants (programs per SM, BLOCK, warps). Checks every variant against torch.argmax."""
import json
import os
import sys

import torch
import triton

sys.path.insert(0, "benchmarks")
from bench_decode_splits import graph_time_us  # noqa: E402

from hf_paged.kernels import triton_argmax as ta  # noqa: E402

V = int(os.environ.get("VOCAB", 128256))
sms = torch.cuda.get_device_properties(0).multi_processor_count
pick = ta.GreedyPick(torch.device("cuda"))
variants = {"pps4_b1024_w4": (4, 1024, 4), "pps8_b1024_w4": (8, 1024, 4), "pps16_b1024_w4": (16, 1024, 4),
            "pps8_b2048_w8": (8, 2048, 8), "pps16_b2048_w8": (16, 2048, 8), "pps32_b1024_w4": (32, 1024, 4),
            "pps8_b4096_w8": (8, 4096, 8), "pps4_b4096_w16": (4, 4096, 16)}
res = {}
for rows in (1, 8, 24, 64, 96, 128, 132, 160, 200, 256):
    x = torch.randn(rows, V, device="cuda", dtype=torch.bfloat16)
    ref = x.argmax(-1)
    row = {"bytes_us": rows * V * 2 / 2.95e12 * 1e6, "torch": graph_time_us(lambda: x.argmax(-1), calls=20)}
    row["committed"] = graph_time_us(lambda: pick(x), calls=20)
    for name, (pps, block, warps) in variants.items():
        want = max(1, min(ta.MAX_CHUNKS, triton.cdiv(pps * sms, rows), triton.cdiv(V, block)))
        chunk = triton.cdiv(triton.cdiv(V, want), block) * block
        nc = triton.cdiv(V, chunk)
        vals = torch.empty(rows * nc, dtype=torch.float32, device="cuda")
        idx = torch.empty(rows * nc, dtype=torch.int32, device="cuda")
        cnt = torch.zeros(rows, dtype=torch.int32, device="cuda")
        out = torch.empty(rows, dtype=torch.int64, device="cuda")

        def call():
            ta._argmax_kernel[(rows, nc)](x, x.stride(0), V, chunk, vals, idx, cnt, out, nc, BLOCK=block,
                                          MAX_C=ta.MAX_CHUNKS, NONE=ta._NONE, num_warps=warps)
        row[name] = graph_time_us(call, calls=20)
        assert torch.equal(out, ref), name
    res[rows] = row
    print(f"rows {rows:4d} bytes {row['bytes_us']:6.1f} us  " + "  ".join(f"{k} {v:6.1f}" for k, v in row.items()
                                                                            if k != "bytes_us"), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "argmax_sweep.json"), "w"), indent=1)
