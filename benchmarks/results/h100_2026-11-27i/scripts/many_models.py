"""Ten llama shapes in one process, each through a compile_decode engine (CPU): does the compiled step keep
compiling, or does Dynamo's recompile limit (8 per code object) turn the later engines' layers eager?"""
import time
import warnings

import torch
from torch._dynamo.utils import counters

import hf_paged
from hf_paged.runner.regional import CompiledLayers
from hf_paged.testing import tiny_model

warnings.simplefilter("default")
torch._dynamo.config.recompile_limit  # noqa: B018 (exists)
print("recompile_limit", torch._dynamo.config.recompile_limit)
prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
for i in range(11):
    model = tiny_model("llama", seed=i, hidden_size=32 + 16 * i, intermediate_size=64 + 16 * i)
    ref = model.generate(torch.tensor([prompts[0]]), max_new_tokens=6, do_sample=False)[0, 7:].tolist()
    before = counters["stats"]["unique_graphs"]
    t = time.time()
    engine = hf_paged.Engine(model, block_size=8, max_num_seqs=4, compile_decode=True)
    out = engine.generate(prompts, max_new_tokens=6)
    ok = out[0].outputs[0].token_ids == ref
    compiled = engine.runner._compiled
    print(i, "hidden", 32 + 16 * i, "same tokens", ok, "regional", isinstance(compiled, CompiledLayers),
          "new graphs", counters["stats"]["unique_graphs"] - before, f"{time.time() - t:.1f} s", flush=True)
    engine.close()
    del engine, model
