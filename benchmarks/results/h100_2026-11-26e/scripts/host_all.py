"""Every `bench_host_step.py` configuration at 256 running requests in one process: the hf_paged on PYTHONPATH,
the harness of the new tree ($BENCH_DIR, so both trees are timed by the same script). Steady (no request stops,
400 steps) and --finishing (ShareGPT-like lengths, until the last request finishes)."""
import json
import os
import sys

import hf_paged  # noqa: E402  (first: the harness puts its own tree's root on sys.path)

print("hf_paged from", os.path.dirname(hf_paged.__file__), flush=True)
sys.path.insert(0, os.environ.get("BENCH_DIR", "benchmarks"))
import bench_host_step as b  # noqa: E402

rows = {}
for finishing in (False, True):
    for sampled in (False, True):
        for caching in (False, True):
            name = ("finishing " if finishing else "steady ") + ("sampled" if sampled else "greedy") + (
                " + prefix caching" if caching else "")
            rows[name] = b.host_ms_per_step(256, 400, sampled, caching, finishing=finishing)
            print(f"{name}: {rows[name]:.3f} ms", flush=True)
print(json.dumps(rows))
