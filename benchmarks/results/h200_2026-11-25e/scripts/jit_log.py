"""Which compilations happen when, in one cold (or warm) engine start-up: Triton JIT calls of hf_paged's kernels,
Inductor's kernel compilations, Dynamo recompiles. Run with fresh TRITON_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR."""
import sys, time, threading, logging
sys.path.insert(0, "benchmarks")
import torch
import bench_generate
import hf_paged
from hf_paged.kernels import parallel_jit
from triton.runtime.jit import JITFunction

T0 = time.perf_counter()
events = []
def ev(*a):
    events.append((time.perf_counter() - T0, threading.current_thread().name[:14]) + a)

orig = JITFunction._do_compile
def do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
    t = time.perf_counter()
    r = orig(self, key, signature, device, constexprs, options, attrs, warmup)
    ev("triton", self.fn.__name__, f"warmup={warmup} dry={parallel_jit.compiling_only()}", f"{time.perf_counter()-t:.3f}s", str(attrs)[:80])
    return r
JITFunction._do_compile = do_compile
try:
    from torch._inductor import async_compile
    o_tr = async_compile.AsyncCompile.triton
    def tr(self, kernel_name, source_code, *a, **k):
        ev("inductor", kernel_name)
        return o_tr(self, kernel_name, source_code, *a, **k)
    async_compile.AsyncCompile.triton = tr
except Exception as e:
    print("no inductor hook", e)
torch._logging.set_logs(recompiles=True, graph_breaks=True)

model = bench_generate.build_model(sys.argv[1] if len(sys.argv) > 1 else "llama-1b", "cuda", torch.bfloat16)
torch.cuda.synchronize()
ev("mark", "engine construct")
engine = hf_paged.Engine(model, max_num_seqs=256, kv_cache_memory="8GiB", compile_decode=True)
runner = engine.runner
oc = runner.capture_all
def cap():
    ev("mark", "capture_all start"); oc(); ev("mark", "capture_all end")
runner.capture_all = cap
ev("mark", "warm_up start")
engine.warm_up()
ev("mark", "warm_up end")
engine.generate([[1, 2, 3, 4]], hf_paged.SamplingParams(max_new_tokens=4, ignore_eos=True))
torch.cuda.synchronize()
ev("mark", "first request end")
engine.generate([[5, 6, 7, 8, 9, 10, 11], [3, 4]], hf_paged.SamplingParams(max_new_tokens=4, ignore_eos=True))
torch.cuda.synchronize()
ev("mark", "second request end")
print(engine.warm_up_seconds)
inductor = [e for e in events if e[2] == "inductor"]
print(f"inductor kernels: {len(inductor)} first {inductor[0][0] if inductor else 0:.2f} last {inductor[-1][0] if inductor else 0:.2f}")
for e in events:
    if e[2] != "inductor":
        print(f"{e[0]:8.3f} {e[1]:14s} " + " ".join(str(x) for x in e[2:]))
late = [e for e in inductor if e[0] > [x for x in events if x[3:4] == ("warm_up start",)][0][0]]
for e in inductor:
    print(f"{e[0]:8.3f} inductor {e[3]}")
