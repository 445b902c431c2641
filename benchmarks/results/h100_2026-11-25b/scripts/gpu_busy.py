"""GPU busy vs wall over an engine run: CUDA events around each step's launch (execute -> _launch)."""
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..")); sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import torch
from bench_generate import build_model, make_workload

import hf_paged

model_name, wl, temp = sys.argv[1], sys.argv[2], float(sys.argv[3])
compile_decode = "--eager" not in sys.argv
workload = make_workload(wl, 256, 0)
model = build_model(model_name, "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=compile_decode)
engine.warm_up()
kw = dict(do_sample=True, temperature=temp, top_p=0.95) if temp > 0 else {}
marks = []  # (E0, E1, batch)
exec_fn, launch_fn = engine.runner.execute, engine._launch
pending = {}
def execute(sched, *a, **k):
    e = torch.cuda.Event(enable_timing=True); e.record(); pending["e0"] = e; pending["n"] = len(sched.scheduled)
    return exec_fn(sched, *a, **k)
def launch(sched, logits):
    out = launch_fn(sched, logits)
    e = torch.cuda.Event(enable_timing=True); e.record(); marks.append((pending.pop("e0"), e, pending["n"]))
    return out
engine.runner.execute, engine._launch = execute, launch
for p, n in workload:
    engine.add_request(p, max_new_tokens=n, ignore_eos=True, **kw)
prof = cProfile.Profile()
t0 = time.perf_counter()
steps = 0
while engine.has_unfinished():
    if steps == 60: prof.enable()
    engine.step(finished_only=True); steps += 1
    if steps == 460: prof.disable()
torch.cuda.synchronize()
wall = time.perf_counter() - t0
busy = [(a.elapsed_time(b), n) for a, b, n in marks]
tot = sum(b for b, _ in busy) / 1e3
print(f"{model_name} {wl} T{temp}: wall {wall:.2f} s, steps {steps}, pipelined-launch steps {len(busy)}, GPU busy (launch->launch end) {tot:.2f} s")
for lo, hi in ((1, 8), (9, 32), (33, 96), (97, 192), (193, 10**6)):
    sel = [b for b, n in busy if lo <= n <= hi]
    if sel: print(f"  batch {lo}-{hi}: {len(sel)} steps, GPU ms/step {sum(sel)/len(sel):.3f}")
s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:6000])
engine.close()
