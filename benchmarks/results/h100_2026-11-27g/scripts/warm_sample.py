"""Wall-clock breakdown of an engine's start-up by sampling the main thread's stack every 2 ms (low overhead)."""
import collections
import json
import os
import sys
import threading
import time

sys.path.insert(0, "benchmarks")
import bench_generate
import torch

import hf_paged

MAIN = threading.get_ident()
samples = []
stop = False

def sampler():
    while not stop:
        f = sys._current_frames().get(MAIN)
        stack = []
        mod = None
        while f is not None:
            stack.append((f.f_code.co_filename, f.f_code.co_name))
            if f.f_code.co_name == "_find_and_load":
                try:
                    mod = f.f_locals.get("name")  # the outermost import wins (overwritten going up)
                except Exception:
                    pass
            f = f.f_back
        stack.append(("<import>", str(mod)))
        samples.append((time.perf_counter(), stack))
        time.sleep(0.002)

def classify(stack):
    files = [s[0] for s in stack]  # (ruff: two unused locals removed after the calls ran)
    # the innermost hf_paged function a few levels under warm_up
    chain = [n for fl, n in reversed(stack[:-1]) if "/hf_paged/" in fl]
    top = "/".join(chain[:3])
    if any("importlib" in fl or n == "_find_and_load" for fl, n in stack):
        what = "import " + stack[-1][1].split(".")[0] + "." + ".".join(stack[-1][1].split(".")[1:3])
    elif any("_inductor" in fl for fl in files):
        what = "inductor"
    elif any("_functorch" in fl for fl in files):
        what = "aot"
    elif any("symbolic_convert" in fl or "_dynamo/variables" in fl for fl in files):
        what = "dynamo-trace"
    elif any("_dynamo" in fl for fl in files):
        what = "dynamo-other"
    elif any("triton" in fl for fl in files):
        what = "triton"
    elif any("cuda/graphs.py" in fl for fl in files):
        what = "cuda-graph"
    else:
        what = "rest"
    return top, what

name = os.environ.get("MODEL", "llama-1b")
dev = "cuda" if torch.cuda.is_available() else "cpu"
model = bench_generate.build_model(name, dev, torch.bfloat16 if dev == "cuda" else torch.float32,
                                   **({} if dev == "cuda" else dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1024)))
if dev == "cuda":
    torch.cuda.synchronize()
th = threading.Thread(target=sampler, daemon=True); th.start()
t0 = time.perf_counter()
engine = hf_paged.Engine(model, max_num_seqs=256 if dev == "cuda" else 8, compile_decode=True,
                         **({} if dev == "cuda" else dict(num_blocks=64, block_size=16)))
t1 = time.perf_counter()
engine.warm_up()
if dev == "cuda":
    torch.cuda.synchronize()
t2 = time.perf_counter()
stop = True; th.join()
by = collections.Counter(); by_what = collections.Counter(); by_top = collections.Counter()
prev = None
for t, st in samples:
    if t < t0 or t > t2:
        continue
    dt = (t - prev) if prev else 0.0
    prev = t
    top, what = classify(st)
    by[(top, what)] += dt; by_what[what] += dt; by_top[top] += dt
inner = collections.Counter()
prev = None
for t, st in samples:
    if t < t0 or t > t2:
        continue
    dt = (t - prev) if prev else 0.0
    prev = t
    top, what = classify(st)
    if what in ("inductor", "triton", "rest") or what.startswith("import"):
        frames = [f"{os.path.basename(fl)}:{n}" for fl, n in st[:-1] if "/hf_paged/" not in fl][:4]
        inner[(top.split("/")[-1], what[:20], " < ".join(frames))] += dt
print("capture_retries", engine.runner.capture_retries if hasattr(engine.runner, "capture_retries") else None, "graph_failure", engine.runner.graph_failure, "decode_mode", engine.runner.decode_mode)
print(json.dumps({"construct": t1 - t0, "warm_up": t2 - t1, "phases": engine.warm_up_seconds}))
print("by kind:"); [print(f"  {v:7.3f}  {k}") for k, v in by_what.most_common()]
print("by hf_paged frame:"); [print(f"  {v:7.3f}  {k}") for k, v in by_top.most_common(25)]
print("by both:"); [print(f"  {v:7.3f}  {k}") for k, v in by.most_common(40)]
print("innermost:"); [print(f"  {v:7.3f}  {k}") for k, v in inner.most_common(45)]
engine.close()
