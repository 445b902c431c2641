"""Dump the decode kernel's TTGIR / PTX as the device's Triton compiles it, with resource usage."""
import os
import sys

import torch

sys.path.insert(0, "benchmarks/scratch/s23")
from hf_paged.kernels import triton_decode as td  # noqa: E402

out_dir = os.environ.get("OUT", "/tmp")
bs, Hq, Hkv, D = 16, 32, 8, 64
for B, ahead, stages in ((24, True, 2), (24, False, 2), (24, True, 3), (256, False, 2)):
    mb = 64
    kc = torch.randn(B * mb + 1, Hkv, bs, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.arange(B * mb, device="cuda", dtype=torch.int32).reshape(B, mb)
    seq = torch.full((B,), 900, dtype=torch.int32, device="cuda")
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    kn = torch.randn(B, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vn = torch.randn_like(kn)
    slots = torch.arange(B, device="cuda", dtype=torch.long) * 3
    counters = torch.zeros(B * Hkv, dtype=torch.int32, device="cuda")
    td.PREFETCH_TABLE = ahead
    td._paged_decode_kernel.device_caches.clear() if hasattr(td._paged_decode_kernel, "device_caches") else None
    td.paged_decode(q, kc, vc, bt, seq, 0.125, max_context=mb * bs, new_kv=(kn, vn, slots), split_counters=counters,
                    num_stages=stages)
    torch.cuda.synchronize()
cache = td._paged_decode_kernel.device_caches
for _dev, entry in cache.items():
    kernels = next(e for e in entry if isinstance(e, dict))
    for i, (key, k) in enumerate(kernels.items()):
        ptx = k.asm["ptx"]
        tag = f"k{i}"
        print(tag, "regs", k.n_regs, "spills", k.n_spills, "shared", k.metadata.shared, "stages", k.metadata.num_stages,
              "cp.async", ptx.count("cp.async.ca") + ptx.count("cp.async.cg"), "ld.global", ptx.count("ld.global"),
              )
        with open(f"{out_dir}/{tag}.ttgir", "w") as f:
            f.write(k.asm["ttgir"])
        with open(f"{out_dir}/{tag}.ptx", "w") as f:
            f.write(ptx)
        with open(f"{out_dir}/{tag}.key", "w") as f:
            f.write(str(key))
