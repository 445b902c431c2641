"""Tensor parallelism: `examples/tensor_parallel.py`'s requests under `torchrun` with 2 processes (gloo on the CPU, also
on a host with one GPU; NCCL on 2 GPUs, where the CUDA-graph variants run too), every case in one launch of
`tests/tp_cases.py` (the example's `load` and `run`).

transformers shards a tiny llama (4 query / 2 KV heads) over the two ranks; each rank's engine holds one KV head and
the same block tables. A tiny DeepSeek-V2 (multi-head latent attention) keeps its latent whole on each rank and
splits the query heads. Every rank must generate exactly what one process generates (greedy, a seeded parallel-sampling
request, a beam-search request), also when a small pool forces preemption by recompute or by swap, and the greedy
outputs must equal transformers' own `generate()` with DynamicCache.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_paged.testing import tiny_model

try:
    from tests import tp_cases
    from tests.helpers import greedy_reference
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    import tp_cases
    from helpers import greedy_reference

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tensor_parallel.py"
CASES_SCRIPT = Path(__file__).resolve().parent / "tp_cases.py"
# NCCL and the CUDA-graph variants need a GPU for each of the two ranks; with fewer, both sides run on the CPU
TWO_GPUS = torch.cuda.device_count() >= 2

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


CASES = {"roomy": [], "recompute": ["--num-blocks", "20", "--block-size", "8"],
         "swap": ["--num-blocks", "20", "--block-size", "8", "--preemption-mode", "swap"],
         "static-decode": ["--num-blocks", "20", "--block-size", "8", "--static"],
         "compiled-decode": ["--compile-decode"],
         # multi-head latent attention (a tiny DeepSeek-V2): the latent whole on each rank, the query heads split
         "latent": ["--model", "tiny-mla", "--num-blocks", "20", "--block-size", "8"]}
if TWO_GPUS:
    CASES.update({"cuda-graph": ["--num-blocks", "20", "--block-size", "8", "--cuda-graph"],
                  "cuda-graph-compiled": ["--cuda-graph", "--compile-decode"]})


def run_cases(out: Path, nproc: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[dict]]:
    """Every case of `CASES` in one launch of `tests/tp_cases.py` (the example's requests, one engine per case over
    one loaded model): {case: [record of each rank]}. One process runs in this one (a new interpreter would spend
    seconds importing torch and transformers again); two ranks under `torchrun`."""
    # a run id of its own (the example names its checkpoint after it): test cases may run side by side
    run_id = f"{out.parent.name}_{out.name}"
    # one device for the single process and the ranks alike (on a one-GPU host the single process would otherwise
    # take the GPU while the two ranks, too many for it, run on the CPU)
    device = "cuda" if TWO_GPUS else "cpu"
    arguments = [str(out), json.dumps(CASES), "--model", "tiny", "--max-new-tokens", "14", "--device", device]
    if nproc == 1:
        for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        tp_cases.main(arguments)
    else:
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHELASTIC_RUN_ID=run_id)
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
             str(CASES_SCRIPT), *arguments], capture_output=True, text=True, timeout=900, env=env)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {case: [json.loads((out / case / f"rank{r}.json").read_text()) for r in range(nproc)] for case in CASES}


@pytest.mark.slow
def test_two_ranks_generate_what_one_process_generates(tmp_path, monkeypatch):
    """Each case of `CASES` (a roomy pool; a small one preempting by recompute, by swap; the static decode path; the
    compiled decode step; with two GPUs, CUDA graphs) on two ranks against one process."""
    singles = run_cases(tmp_path / "single", 1, monkeypatch)
    tp = run_cases(tmp_path / "tp2", 2, monkeypatch)
    for case, extra in CASES.items():
        single = singles[case][0]
        for rank in tp[case]:
            assert rank["errors"] == [] and rank["world"] == 2, case
            if case == "latent":  # every rank holds the whole latent (one KV head)
                assert rank["kv_heads"] == single["kv_heads"] == 1, case
            else:  # each rank holds half of the KV heads
                assert rank["kv_heads"] * 2 == single["kv_heads"] == 2, case
            assert rank["outputs"] == single["outputs"], case
            assert rank["preemptions"] == single["preemptions"], case
        if "--num-blocks" in extra:
            assert sum(single["preemptions"].values()) > 0, case
        elif not extra:  # the same KV memory per rank holds twice the blocks: twice the tokens of a single process's
            assert tp[case][0]["num_blocks"] == 2 * single["num_blocks"]
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
def test_example_insisting_on_cuda_without_gpus_says_why(monkeypatch):
    """`python examples/tensor_parallel.py --device cuda`, run as `__main__` in this process."""
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--model", "tiny", "--device", "cuda"])
    with pytest.raises(SystemExit, match=r"--device cuda needs a GPU for each of the 1 local rank\(s\); this machine "
                                         r"has 0"):
        runpy.run_path(str(EXAMPLE), run_name="__main__")
