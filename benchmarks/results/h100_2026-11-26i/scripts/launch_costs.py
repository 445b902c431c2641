"""Host cost of launches that a mixed (ragged, eager) step makes per layer, unprofiled: a cuBLAS GEMM at a token
count seen before vs a new one each call; hf_paged's custom ops vs their bodies; a Triton JIT launch."""
import time

import torch

import hf_paged  # noqa: F401  (registers the ops)
from hf_paged.runner import sibling_linears as sl

dev = "cuda"
torch.manual_seed(0)
w = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
big = torch.randn(20000, 2048, device=dev, dtype=torch.bfloat16)


def host_us(fn, n):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(n):
        fn(i)
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


for k, n_out in ((2048, 2048), (2048, 16384), (8192, 2048)):
    wk = torch.randn(n_out, k, device=dev, dtype=torch.bfloat16)
    xk = torch.randn(20000, k, device=dev, dtype=torch.bfloat16)
    same = host_us(lambda i: torch.nn.functional.linear(xk[:300], wk), 200)
    novel = host_us(lambda i: torch.nn.functional.linear(xk[: 300 + i], wk), 200)
    again = host_us(lambda i: torch.nn.functional.linear(xk[: 300 + i], wk), 200)
    padded = host_us(lambda i: torch.nn.functional.linear(xk[: 64 * ((300 + i + 63) // 64)], wk), 200)
    print(f"linear K={k} N={n_out}: same M {same:.1f} us, new M each call {novel:.1f} us, the same new Ms again "
          f"{again:.1f} us, M padded to 64 {padded:.1f} us")
# custom op dispatch vs body
x = big[:300]
ws = [torch.randn(1024, 2048, device=dev, dtype=torch.bfloat16) for _ in range(2)]
sl._pack(ws)
with torch.inference_mode():
    op = host_us(lambda i: torch.ops.hf_paged.sibling_linear(x, ws, []), 300)
    body = host_us(lambda i: sl.sibling_linear._init_fn(x, ws, []) if hasattr(sl.sibling_linear, "_init_fn") else None, 300)
    stacked = host_us(lambda i: sl._stacked(ws), 300)
    plain = host_us(lambda i: torch.nn.functional.linear(x, sl._stacked(ws)), 300)
print(f"sibling_linear op {op:.1f} us; _stacked {stacked:.1f} us; _stacked + linear {plain:.1f} us; body {body:.1f}")
# Triton JIT launch (write_kv) host cost
from hf_paged import kernels  # noqa: E402

kc = torch.zeros(512, 8, 16, 64, device=dev, dtype=torch.bfloat16)
vc = torch.zeros_like(kc)
kk = torch.randn(300, 8, 64, device=dev, dtype=torch.bfloat16)
slots = torch.arange(300, device=dev)
with torch.inference_mode():
    wkv = host_us(lambda i: kernels.write_kv(kk, kk, kc, vc, slots), 300)
    from hf_paged.kernels import triton_cache
    raw = host_us(lambda i: triton_cache.write_kv(kk, kk, kc, vc, slots), 300)
print(f"kernels.write_kv {wkv:.1f} us (checks + launch); triton_cache.write_kv {raw:.1f} us (launch)")
