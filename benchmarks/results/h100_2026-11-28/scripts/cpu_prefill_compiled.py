"""CPU: does a compiled Qwen3 engine run its ragged (prefill) steps through the compiled layers? Counts Dynamo frames
and the compiled-call route per step, for whichever hf_paged is on the path."""
import sys
import time

import torch
import torch._dynamo.utils as du

from hf_paged.engine import Engine
from hf_paged.engine.params import SamplingParams
from hf_paged.model_zoo import tiny_model

fam = sys.argv[1] if len(sys.argv) > 1 else "qwen3"
model = tiny_model(fam)
eng = Engine(model, compile_decode=True, use_cuda_graph=False, num_blocks=512, block_size=16)
eng.warm_up()
print("after warm-up", dict(du.counters["stats"]))
runner = eng.runner if hasattr(eng, "runner") else None
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (37, 81, 120, 9, 64)]
t = time.perf_counter()
outs = eng.generate(prompts, SamplingParams(max_new_tokens=4), use_tqdm=False)
print("generate", round(time.perf_counter() - t, 2), "s")
print("after generate", dict(du.counters["stats"]))
print("recompiles/graph breaks", dict(du.counters["graph_break"]) or "none")
from torch.profiler import profile

prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (33, 70, 15)]
with profile() as prof:
    eng.generate(prompts, SamplingParams(max_new_tokens=1), use_tqdm=False)
names = {}
for e in prof.events():
    if "Compiled" in e.name or "compiled" in e.name.lower():
        names[e.name] = names.get(e.name, 0) + 1
print("compiled regions in a prefill-only generate:", names)
