"""TTGIR of the decode kernel with block ids 1 and 2 tiles ahead (llama-1b heads, 24 rows, new K/V written)."""
import os
import sys

import torch

sys.path.insert(0, "benchmarks/scratch/s23")
import td2  # noqa: E402

out_dir = os.environ.get("OUT", "/tmp")
bs, Hq, Hkv, D, B, mb = 16, 32, 8, 64, 24, 64
kc = torch.randn(B * mb + 1, Hkv, bs, D, device="cuda", dtype=torch.bfloat16)
vc = torch.randn_like(kc)
bt = torch.arange(B * mb, device="cuda", dtype=torch.int32).reshape(B, mb)
seq = torch.full((B,), 900, dtype=torch.int32, device="cuda")
q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
kn = torch.randn(B, Hkv, D, device="cuda", dtype=torch.bfloat16)
vn = torch.randn_like(kn)
slots = torch.arange(B, device="cuda", dtype=torch.long) * 3
counters = torch.zeros(B * Hkv, dtype=torch.int32, device="cuda")
for a in (1, 2):
    k = td2.paged_decode(q, kc, vc, bt, seq, 0.125, max_context=mb * bs, new_kv=(kn, vn, slots),
                         split_counters=counters, table_ahead=a)
torch.cuda.synchronize()
i = 0
for entry in td2._paged_decode_kernel.device_caches.values():
    for e in entry:
        if isinstance(e, dict):
            for key, kern in e.items():
                ptx = kern.asm["ptx"]
                print(i, "regs", kern.n_regs, "spills", kern.n_spills, "shared", kern.metadata.shared,
                      "cp.async", ptx.count("cp.async.ca") + ptx.count("cp.async.cg"), str(key)[-140:])
                open(f"{out_dir}/a{i}.ttgir", "w").write(kern.asm["ttgir"])
                i += 1
