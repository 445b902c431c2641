"""Why call a's harness showed output differences: its slots come from layer 0's block table while every layer has
its own. The committed kernel writes the new K/V there and reads its cache at the new position (another block); the
prototype takes the new K/V from registers. With each layer's own slots the two agree (interpreter, float32)."""
import sys

import torch

sys.path.insert(0, "benchmarks/scratch/s8")
import td_stream

from hf_paged.kernels import triton_decode

torch.manual_seed(0)
B, Hq, Hkv, D, bs = 4, 8, 2, 32, 16
lens = [300, 17, 129, 64]
need = sum((x + bs) // bs for x in lens) + 1
mb = 24
def layer(seed):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(need, Hkv, bs, D, generator=g); vc = torch.randn(need, Hkv, bs, D, generator=g)
    perm = torch.randperm(need - 1, generator=g)
    bt = torch.zeros(B, mb, dtype=torch.int32); at = 0
    for r, x in enumerate(lens):
        k = (x + bs) // bs; bt[r, :k] = perm[at:at + k]; at += k
    return kc, vc, bt
seq = torch.tensor(lens, dtype=torch.int32) + 1
q = torch.randn(B, Hq, D); kn = torch.randn(B, Hkv, D); vn = torch.randn(B, Hkv, D)
L0, L1 = layer(1), layer(2)
for name, (kc, vc, bt) in (("slots from own table", L1), ("slots from layer 0's table", L1)):
    src_bt = bt if name.startswith("slots from own") else L0[2]
    slots = torch.tensor([int(src_bt[r, x // bs]) * bs + x % bs for r, x in enumerate(lens)])
    a = triton_decode.paged_decode(q, kc.clone(), vc.clone(), bt, seq, 0.125, new_kv=(kn, vn, slots), num_splits=3,
                                   split_counters=torch.zeros(B * Hkv, dtype=torch.int32))
    t = td_stream.build_table(seq.numpy(), None, 64, "cpu")
    b_ = td_stream.paged_decode(q, kc.clone(), vc.clone(), bt, seq, 0.125, new_kv=(kn, vn, slots), table=t,
                                split_counters=torch.zeros(B * Hkv, dtype=torch.int32), programs_per_sm=3, min_per=1)
    print(name, "max diff", (a - b_).abs().max().item())
