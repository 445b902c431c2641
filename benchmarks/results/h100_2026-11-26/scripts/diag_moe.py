import sys
import traceback

import torch

import hf_paged
from hf_paged import model_zoo

types = sys.argv[1:]
for t in types:
    for dtype in (torch.float32,):
        for compiled in (False, True):
            try:
                model = model_zoo.tiny_model(t, seed=0).to(dtype).cuda().eval()
                impl = getattr(model.config, "_experts_implementation", None)
                engine = hf_paged.Engine(model, num_blocks=64, block_size=16, max_num_seqs=4, use_cuda_graph=True, compile_decode=compiled)
                engine.warm_up()
                outs = engine.generate([[5, 6, 7, 8], [9, 10, 11]], max_new_tokens=6, ignore_eos=True)
                engine.close()
                print(t, dtype, compiled, impl, "OK", flush=True)
            except Exception as e:
                tb = traceback.extract_tb(e.__traceback__)
                frames = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}:{f.name}" for f in tb[-14:]]
                print(t, dtype, compiled, impl, "FAIL", type(e).__name__, str(e)[:100], " <- ".join(reversed(frames)), flush=True)
