"""Why Inductor keeps the attention residual add apart when the next GEMM adds into the sum in place: compile one
llama-1b-shaped layer (2 layers) on CUDA with the engine's backend, logs of fusion decisions and output code."""
import os
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged.runner import sibling_linears as sl  # noqa: E402

sl.IN_PLACE_RESIDUAL = os.environ.get("IN_PLACE", "1") == "1"
model = build_model("llama-1b", "cuda", torch.bfloat16, num_hidden_layers=2)
engine = hf_paged.Engine(model, compile_decode=True, max_num_seqs=32, num_blocks=512)
outs = engine.generate([[5, 6, 7, 8]] * 4, max_new_tokens=4)
print("tokens", [o.outputs[0].token_ids for o in outs][:1], sl.FUSED)
