"""Where a prefill step's host time goes: 256 ShareGPT prompts into a warmed-up compiled llama-1b engine; the
prefill steps timed (host wall of execute, GPU time between events), then the same again under cProfile."""
import cProfile
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model, make_workload

import hf_paged

model = build_model(sys.argv[1] if len(sys.argv) > 1 else "llama-1b", "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True)
engine.warm_up()
workload = make_workload("sharegpt", 256, 0)
runner = engine.runner
exec_fn = runner.execute
log = []


def execute(sched, *args, **kwargs):
    torch.cuda.synchronize()
    m0 = torch.cuda.memory_stats()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    s.record()
    out = exec_fn(sched, *args, **kwargs)
    host = time.perf_counter() - t
    e.record()
    torch.cuda.synchronize()
    m1 = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    mem = {k: m1.get(k, 0) - m0.get(k, 0) for k in keys}
    mem["reserved_gib"] = round(m1.get("reserved_bytes.all.current", 0) / 2**30, 2)
    mem["peak_active_gib"] = round(m1.get("active_bytes.all.peak", 0) / 2**30, 2)
    log.append((sum(i.num_tokens for i in sched.scheduled), len(sched.scheduled), host * 1e3, s.elapsed_time(e), mem))
    return out


runner.execute = execute


def run(profile: bool, seed: int):
    # fresh prompts each round (prefix caching would serve repeats)
    for prompt, _n in make_workload("sharegpt", 256, seed):
        engine.add_request(prompt, max_new_tokens=2, ignore_eos=True)
    log.clear()
    prof = cProfile.Profile() if profile else None
    steps = 0
    while len(log) < 3 and steps < 10:
        if prof:
            prof.enable()
        engine.step()
        if prof:
            prof.disable()
        steps += 1
    for tokens, seqs, host, gpu, mem in log:
        print(f"  prefill step: {tokens} tokens, {seqs} seqs: execute host {host:.1f} ms (synced before), GPU {gpu:.1f} ms"
              f" {mem}")
    while engine.has_unfinished():
        engine.step()
    return prof


print("free / total GiB after warm-up:", [round(x / 2**30, 2) for x in torch.cuda.mem_get_info()])
run(False, 1)
run(False, 2)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                            record_shapes=True) as tp:
    run(False, 3)
events = [e for e in tp.events() if e.device_type == torch.autograd.DeviceType.CPU]
events.sort(key=lambda e: -e.time_range.elapsed_us())
print("longest CPU events (us, name, shapes):")
seen = 0
for e in events:
    if e.name.startswith(("ProfilerStep", "## ")):
        continue
    print(f"  {e.time_range.elapsed_us():9.0f}  {e.name[:70]}  {str(e.input_shapes)[:120]}")
    seen += 1
    if seen >= 40:
        break
engine.close()
