import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__)); sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import torch

mod = importlib.import_module(sys.argv[1])
V = 151936
x = torch.randn(1, V, device="cuda", dtype=torch.bfloat16)
col = lambda v, d: torch.full((1,), v, dtype=d, device="cuda")
args = (col(1.0, torch.float32), col(2, torch.int32), col(0.5, torch.float32), col(-float("inf"), torch.float32), col(0, torch.long), col(0, torch.long))
torch.cuda.synchronize()
t = time.perf_counter(); mod.sample_tokens(x, *args); torch.cuda.synchronize()
print(sys.argv[1], "first call (cold compile) s", round(time.perf_counter() - t, 2))
