"""Which compilations happen when, in one engine start-up (`compile_decode=True`): Triton JIT calls of hf_paged's
kernels (dry or real), Inductor's kernel compilations, Dynamo recompiles, and the warm-up's phase marks.

Run with fresh TRITON_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR for a cold start, again with the same ones for a warm one
(`call3.sh`, `call5.sh`): `python jit_log.py llama-1b`.
"""

import sys
import threading
import time

sys.path.insert(0, "benchmarks")

import bench_generate  # noqa: E402
import torch  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged.kernels import parallel_jit  # noqa: E402

T0 = time.perf_counter()
events = []


def event(*fields):
    events.append((time.perf_counter() - T0, threading.current_thread().name[:14]) + fields)


original_do_compile = JITFunction._do_compile


def do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
    start = time.perf_counter()
    result = original_do_compile(self, key, signature, device, constexprs, options, attrs, warmup)
    event("triton", self.fn.__name__, f"warmup={warmup} dry={parallel_jit.compiling_only()}",
          f"{time.perf_counter() - start:.3f}s", str(attrs)[:80])
    return result


JITFunction._do_compile = do_compile
try:
    from torch._inductor import async_compile

    original_triton = async_compile.AsyncCompile.triton

    def inductor_triton(self, kernel_name, source_code, *args, **kwargs):
        event("inductor", kernel_name)
        return original_triton(self, kernel_name, source_code, *args, **kwargs)

    async_compile.AsyncCompile.triton = inductor_triton
except Exception as error:  # a private API: its absence must not stop the timeline
    print("no inductor hook", error)
torch._logging.set_logs(recompiles=True, graph_breaks=True)

model = bench_generate.build_model(sys.argv[1] if len(sys.argv) > 1 else "llama-1b", "cuda", torch.bfloat16)
torch.cuda.synchronize()
event("mark", "engine construct")
engine = hf_paged.Engine(model, max_num_seqs=256, kv_cache_memory="8GiB", compile_decode=True)
runner = engine.runner
original_capture_all = runner.capture_all


def capture_all():
    event("mark", "capture_all start")
    original_capture_all()
    event("mark", "capture_all end")


runner.capture_all = capture_all
event("mark", "warm_up start")
engine.warm_up()
event("mark", "warm_up end")
engine.generate([[1, 2, 3, 4]], hf_paged.SamplingParams(max_new_tokens=4, ignore_eos=True))
torch.cuda.synchronize()
event("mark", "first request end")
engine.generate([[5, 6, 7, 8, 9, 10, 11], [3, 4]], hf_paged.SamplingParams(max_new_tokens=4, ignore_eos=True))
torch.cuda.synchronize()
event("mark", "second request end")
print(engine.warm_up_seconds)
inductor = [e for e in events if e[2] == "inductor"]
first, last = (inductor[0][0], inductor[-1][0]) if inductor else (0.0, 0.0)
print(f"inductor kernels: {len(inductor)} first {first:.2f} last {last:.2f}")
for e in events:
    if e[2] != "inductor":
        print(f"{e[0]:8.3f} {e[1]:14s} " + " ".join(str(x) for x in e[2:]))
for e in inductor:
    print(f"{e[0]:8.3f} inductor {e[3]}")
