"""TP engine with CUDA graphs left open at exit: MODE=open (no close, no destroy) or destroy (destroy_process_group
with the engine open). Prints DONE before exiting."""
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig

import hf_paged
from hf_paged.testing import tiny_model

local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl", device_id=torch.device("cuda", local))
path = f"/tmp/exit_ckpt_{os.environ['MODE']}"
if dist.get_rank() == 0:
    tiny_model("llama", seed=0).save_pretrained(path)
dist.barrier()
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                             distributed_config=DistributedConfig(tp_plan="auto")).eval()
engine = hf_paged.Engine(model, kv_cache_memory="64MiB")
out = engine.generate([[5, 6, 7, 8]] * 3, max_new_tokens=8)
print("rank", dist.get_rank(), "mode", engine.runner.decode_mode, "graph steps", engine.runner.graph_steps,
      "compiled", engine.runner.compile_decode, out[0].outputs[0].token_ids, flush=True)
if os.environ["MODE"] == "destroy":
    dist.destroy_process_group()
print("DONE", dist.get_rank() if os.environ["MODE"] != "destroy" else "", flush=True)
sys.exit(0)
