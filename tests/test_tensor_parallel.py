"""Tensor parallelism: `examples/tensor_parallel.py` under `torchrun` with 2 processes (gloo on the CPU, also on a
host with one GPU; NCCL on 2 GPUs, where the CUDA-graph variants run too).

transformers shards a tiny llama (4 query / 2 KV heads) over the two ranks; each rank's engine holds one KV head and
the same block tables. Every rank must generate exactly what one process generates (greedy, a seeded parallel-sampling
request, a beam-search request), also when a small pool forces preemption by recompute or by swap, and the greedy
outputs must equal transformers' own `generate()` with DynamicCache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_paged.testing import tiny_model

try:
    from tests.helpers import greedy_reference
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import greedy_reference

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tensor_parallel.py"
# NCCL and the CUDA-graph variants need a GPU for each of the two ranks; with fewer, both sides run on the CPU
TWO_GPUS = torch.cuda.device_count() >= 2

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def run_example(out: Path, nproc: int, *extra: str) -> list[dict]:
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc-per-node={nproc}"]
    # a run id of its own (the example names its checkpoint after it): test cases may run side by side
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHELASTIC_RUN_ID=f"{out.parent.name}_{out.name}")
    # one device for the single process and the ranks alike (on a one-GPU host the single process would otherwise
    # take the GPU while the two ranks, too many for it, run on the CPU)
    device = "cuda" if TWO_GPUS else "cpu"
    result = subprocess.run(
        [*launcher, str(EXAMPLE), "--model", "tiny", "--max-new-tokens", "14", "--json", str(out), "--device", device,
         *extra],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.parametrize(
    "extra",
    [(), ("--num-blocks", "20", "--block-size", "8"),
     ("--num-blocks", "20", "--block-size", "8", "--preemption-mode", "swap"),
     ("--num-blocks", "20", "--block-size", "8", "--static"), ("--compile-decode",),
     pytest.param(("--num-blocks", "20", "--block-size", "8", "--cuda-graph"),
                  marks=pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA GPUs")),
     pytest.param(("--cuda-graph", "--compile-decode"),
                  marks=pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA GPUs"))],
    ids=["roomy", "recompute", "swap", "static-decode", "compiled-decode", "cuda-graph", "cuda-graph-compiled"],
)
@pytest.mark.slow
def test_two_ranks_generate_what_one_process_generates(tmp_path, extra):
    single = run_example(tmp_path / "single", 1, *extra)[0]
    ranks = run_example(tmp_path / "tp2", 2, *extra)
    for rank in ranks:
        assert rank["errors"] == [] and rank["world"] == 2
        assert rank["kv_heads"] * 2 == single["kv_heads"] == 2  # each rank holds half of the KV heads
        assert rank["outputs"] == single["outputs"]
        assert rank["preemptions"] == single["preemptions"]
    if "--num-blocks" in extra:
        assert sum(single["preemptions"].values()) > 0
    elif not extra:  # the same KV memory per rank holds twice the blocks: twice the tokens of a single process's pool
        assert ranks[0]["num_blocks"] == 2 * single["num_blocks"]
        model = tiny_model("llama", seed=0)
        greedy = single["greedy"]
        references = [[greedy_reference(model, p, 14)] for p in single["prompts"][:greedy]]
        assert single["outputs"][:greedy] == references


def test_engine_refuses_a_tensor_parallel_size_that_does_not_divide_the_heads(monkeypatch):
    import hf_paged
    from hf_paged.runner.distributed import TensorParallel

    model = tiny_model("llama")  # 4 query / 2 KV heads
    fake = TensorParallel(size=4, rank=0, group=None, src=0)
    monkeypatch.setattr(TensorParallel, "of", classmethod(lambda cls, m: fake))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        hf_paged.Engine(model, num_blocks=8)


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks the message of a machine without GPUs")
@pytest.mark.slow
def test_example_insisting_on_cuda_without_gpus_says_why():
    result = subprocess.run([sys.executable, str(EXAMPLE), "--model", "tiny", "--device", "cuda"], capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode != 0
    assert "--device cuda needs a GPU for each of the 1 local rank(s); this machine has 0" in result.stderr
