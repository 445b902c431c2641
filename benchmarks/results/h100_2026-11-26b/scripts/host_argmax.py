import time

import torch

from hf_paged.kernels.sampling import argmax_rows, argmax_workspace

ws = argmax_workspace("cuda")
for rows in (24, 256):
    x = torch.randn(rows, 128256, device="cuda")
    for name, fn in (("torch.argmax", lambda: x.argmax(-1)), ("argmax_rows+ws", lambda: argmax_rows(x, ws)), ("argmax_rows", lambda: argmax_rows(x))):
        for _ in range(50): fn()
        torch.cuda.synchronize()
        best = 1e9
        for _rep in range(5):
            t = time.perf_counter()
            for _ in range(200): fn()
            best = min(best, (time.perf_counter() - t) / 200)
            torch.cuda.synchronize()
        print(f"host per call rows {rows} {name}: {best*1e6:.1f} us")
