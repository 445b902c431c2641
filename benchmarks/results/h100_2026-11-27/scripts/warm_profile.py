"""Cold start-up, then warm start-ups (one under cProfile) of llama-1b compiled; prints where the warm one goes."""
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

def child(profile_path):
    import bench_startup
    if profile_path:
        pr = cProfile.Profile(); pr.enable()
    row = bench_startup.measure_once(os.environ.get("MODEL", "llama-1b"), True, 256, "8GiB")
    if profile_path:
        pr.disable(); pr.dump_stats(profile_path)
    print(json.dumps(row, default=str))

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2] if len(sys.argv) > 2 else None); sys.exit()
    out = os.environ.get("OUT", "/tmp")
    cache = tempfile.mkdtemp(prefix="su_")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor", TRITON_CACHE_DIR=f"{cache}/triton",
               TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    for label, prof in (("cold", None), ("warm", None), ("warm-prof", f"{out}/warm.prof"), ("warm2", None)):
        t = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--child"] + ([prof] if prof else []), env=env,
                           capture_output=True, text=True)
        if p.returncode:
            print(p.stderr[-3000:]); break
        row = json.loads(p.stdout.strip().splitlines()[-1])
        print(label, f"process {time.perf_counter()-t:.1f}s", f"warm_up {row['warm_up_s']:.2f}",
              f"total {row['total_s']:.2f}", row["warm_up_phases_s"], flush=True)
        print("   ", str(row.get("dynamo_compile_times"))[:1500], flush=True)
        if prof:
            s = io.StringIO(); st = pstats.Stats(prof, stream=s)
            st.sort_stats("cumulative").print_stats(70); st.sort_stats("tottime").print_stats(40)
            print(s.getvalue(), flush=True)
