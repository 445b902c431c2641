"""CPU cProfile of compiled prefill steps (tiny 8-layer Qwen3): where the host time of a ragged step goes."""
import cProfile
import pstats

import torch

from hf_paged.engine import Engine
from hf_paged.engine.params import SamplingParams
from hf_paged.model_zoo import tiny_model

torch.manual_seed(0)
model = tiny_model("qwen3", num_hidden_layers=8, layer_types=["full_attention"] * 8)
eng = Engine(model, compile_decode=True, use_cuda_graph=False, num_blocks=2048, block_size=16,
             enable_prefix_caching=False)
eng.warm_up()
g = torch.Generator().manual_seed(0)
prompts = [[torch.randint(0, 100, (n,), generator=g).tolist() for n in (37, 81, 120, 9, 64, 50, 90, 33)] for _ in range(40)]
for p in prompts[:5]:
    eng.generate(p, SamplingParams(max_new_tokens=1), use_tqdm=False)
prof = cProfile.Profile()
prof.enable()
for p in prompts[5:]:
    eng.generate(p, SamplingParams(max_new_tokens=1), use_tqdm=False)
prof.disable()
st = pstats.Stats(prof)
st.sort_stats("tottime").print_stats(25)
st.print_callers("named_modules|_named_members")
