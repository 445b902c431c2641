"""test_dropped_model_gives_its_gpu_pool_back, diagnosed: what holds GPU memory after `del model` (cycle collector
off), then whether a gc.collect() frees it, and who refers to the surviving CUDA tensors."""
import gc
import sys

import torch

import hf_paged
from hf_paged.testing import tiny_model

mode = sys.argv[1] if len(sys.argv) > 1 else "default"
ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]).cuda()
gc.collect()
torch.cuda.synchronize()
before = torch.cuda.memory_allocated()
gc.disable()
model = tiny_model("llama").cuda()
hf_paged.enable(model)
kw = {} if mode == "default" else {"compile_decode": False} if mode == "eager" else {}
model.generate(ids, cache_implementation="paged", max_new_tokens=3, do_sample=False)
eng = model._hf_paged_engine
print(mode, "engine compile_decode", getattr(eng.runner, "compile_decode", None), "graphs", getattr(eng.runner, "decode_mode", None))
print(mode, "after generate MB", (torch.cuda.memory_allocated() - before) / 2**20)
del eng
del model
torch.cuda.synchronize()
left = torch.cuda.memory_allocated() - before
print(mode, "after del (no gc) MB", left / 2**20)
if left > 2**20:
    big = []
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.is_cuda and o.numel() * o.element_size() > 2**16:
                big.append(o)
        except Exception:
            pass
    big.sort(key=lambda t: -t.numel() * t.element_size())
    print(mode, "tracked CUDA tensors > 64 KiB:", len(big))
    for t in big[:4]:
        print("  tensor", tuple(t.shape), t.dtype, t.numel() * t.element_size() / 2**20, "MB")
        chain = [t]
        for depth in range(6):
            refs = [r for r in gc.get_referrers(chain[-1]) if r is not big and r is not chain and not isinstance(r, type(sys._getframe()))]
            if not refs:
                break
            r = refs[0]
            desc = type(r).__name__
            if isinstance(r, dict):
                keys = [k for k, v in r.items() if v is chain[-1]][:3]
                desc += f" keys {keys}"
            elif hasattr(r, "__qualname__"):
                desc += f" {r.__qualname__}"
            print("   " * (depth + 2), "<-", desc, f"({len(refs)} referrers)")
            chain.append(r)
torch.cuda.synchronize()
torch._C._cuda_clearCublasWorkspaces()
print(mode, "after clearing cuBLAS's workspaces MB", (torch.cuda.memory_allocated() - before) / 2**20)
gc.enable()
gc.collect()
torch.cuda.synchronize()
print(mode, "after gc.collect MB", (torch.cuda.memory_allocated() - before) / 2**20)
