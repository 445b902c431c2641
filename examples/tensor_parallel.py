"""Tensor-parallel serving: transformers shards the model over the ranks, hf_paged runs one engine per rank.

    torchrun --standalone --nproc-per-node 3 examples/tensor_parallel.py          # SmolLM2-135M (9 / 3 heads)
    torchrun --standalone --nproc-per-node 2 examples/tensor_parallel.py --model tiny
    torchrun --standalone --nproc-per-node 2 examples/tensor_parallel.py --model tiny-mla   # DeepSeek-V2's latent
    python examples/tensor_parallel.py                                              # one process: the same text

Every rank loads its shard (`DistributedConfig(tp_plan="auto")`: q/k/v column-parallel, o_proj row-parallel), builds
an `hf_paged.Engine` (its pool holds this rank's KV heads; the block tables are the same everywhere) and runs the
same requests. Rank 0 prints the answers; `--json DIR` makes every rank write what it generated, to check that no
rank diverged. The number of ranks must divide the model's query and KV heads; a multi-head latent attention model's
latent (`tiny-mla`: a tiny DeepSeek-V2) is kept whole on every rank, its query heads split. On GPUs (one per local rank) the
ranks talk over NCCL; on CPUs, or with fewer GPUs than local ranks, over gloo (`--device` picks).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, DistributedConfig

import hf_paged
from hf_paged.model_zoo import tiny_model as zoo_model
from hf_paged.testing import smollm2_checkpoint, tiny_model

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colours.",
    "Write a haiku about the sea.",
]


def setup(choice: str = "auto") -> tuple[int, int, torch.device]:
    """(rank, world size, device) from torchrun's environment; one process without it.

    `choice` "auto" runs on CUDA when there is a GPU for every local rank (NCCL), else on the CPU (gloo): two ranks on
    a one-GPU machine would otherwise both ask for a device that does not exist. "cuda" insists, with a clear error
    when the GPUs are too few; "cpu" always runs on the CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    gpus = torch.cuda.device_count()  # 0 without CUDA
    if choice == "cuda" and gpus < local_world:
        raise SystemExit(f"--device cuda needs a GPU for each of the {local_world} local rank(s); this machine has "
                         f"{gpus}")
    use_cuda = choice != "cpu" and gpus >= local_world
    if choice == "auto" and world > 1 and gpus and not use_cuda and int(os.environ.get("RANK", "0")) == 0:
        print(f"{local_world} local ranks but {gpus} GPU(s): running on the CPU over gloo (--device cuda insists)")
    if world == 1:
        return 0, 1, torch.device("cuda" if use_cuda else "cpu")
    if use_cuda:
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), world, device


TINY = {"tiny": lambda: tiny_model("llama", seed=0), "tiny-mla": lambda: zoo_model("deepseek_v2", seed=0)}


def checkpoint(name: str, rank: int, world: int) -> Path:
    """A local checkpoint directory, prepared by rank 0 while the others wait."""
    if name in TINY:  # a tiny random llama (4 query / 2 KV heads) or DeepSeek-V2 (4 heads, a latent), on every rank
        path = Path(tempfile.gettempdir()) / f"hf_paged_tp_{name}_{os.environ.get('TORCHELASTIC_RUN_ID', 'single')}"
        if rank == 0:
            TINY[name]().save_pretrained(path)
    elif name == "smollm2":
        path = smollm2_checkpoint() if rank == 0 else None
    else:
        path = Path(name)
    if world > 1:
        box = [str(path) if path is not None else None]
        dist.broadcast_object_list(box, src=0)
        path = Path(box[0])
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help="smollm2, tiny, tiny-mla (latent attention) or a local checkpoint directory")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-memory", default="128MiB")
    parser.add_argument("--num-blocks", type=int, default=None, help="a small pool forces preemption")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    parser.add_argument("--json", default=None, help="folder: every rank writes rank<N>.json with its outputs")
    parser.add_argument("--cuda-graph", action="store_true", help="replay decode steps as CUDA graphs (GPU only)")
    parser.add_argument("--compile-decode", action="store_true", help="compile the decode step (torch.compile)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: CUDA when there is a GPU for every local rank, else the CPU")
    parser.add_argument("--static", action="store_true", help="run decode steps on the static buffers (CPU check of "
                        "the graph path's host logic)")
    return parser


def load(args: argparse.Namespace, rank: int, world: int, device: torch.device):
    """(model, tokenizer) of this rank: transformers loads its shard of the checkpoint (`tp_plan="auto"`); no
    tokenizer for the tiny model."""
    path = checkpoint(args.model, rank, world)
    options = {"distributed_config": DistributedConfig(tp_plan="auto")} if world > 1 else {}
    if world > 1 and device.type == "cpu" and torch.cuda.device_count():
        # transformers builds its mesh on the machine's accelerator (and sets the CUDA device to the local rank) unless
        # given one: ranks kept on the CPU bring a CPU mesh
        options["device_mesh"] = dist.init_device_mesh("cpu", (world,))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True, **options)
    model = model.to(device) if world == 1 else model
    model.eval()
    tokenizer = None
    if args.model not in TINY:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


def run(model, tokenizer, args: argparse.Namespace, rank: int, world: int) -> None:
    """Build this rank's engine over the (sharded) model, generate the example's requests, print them on rank 0 and,
    with ``--json``, write what this rank generated."""
    engine = hf_paged.Engine(
        model, tokenizer, block_size=args.block_size, num_blocks=args.num_blocks,
        kv_cache_memory=None if args.num_blocks else args.kv_cache_memory, preemption_mode=args.preemption_mode,
        swap_space=0.05 if args.preemption_mode == "swap" else 0.0,
        use_cuda_graph=True if args.cuda_graph else None, compile_decode=args.compile_decode,
    )
    if args.static and engine.runner.decode_mode == "eager":
        engine.runner.decode_mode = "static"
    if tokenizer is not None:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"] for q in QUESTIONS]
    else:
        gen = torch.Generator().manual_seed(1)
        top = min(380, model.config.get_text_config().vocab_size)
        prompts = [torch.randint(3, top, (n,), generator=gen).tolist() for n in (5, 23, 11, 37, 2, 17)]
    greedy = hf_paged.SamplingParams(max_new_tokens=args.max_new_tokens)
    params = [greedy] * len(prompts)
    # one request of each other kind: their picks are broadcast from rank 0 like the greedy ones
    prompts += [prompts[0], prompts[1]]
    params += [hf_paged.SamplingParams(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=0.8,
                                       num_return_sequences=2, seed=7),
               hf_paged.SamplingParams(max_new_tokens=args.max_new_tokens, num_beams=3)]
    results = engine.generate(prompts, params)
    outputs = [[o.token_ids for o in r.outputs] for r in results]
    if rank == 0:
        print(f"{world} rank(s), {engine.cache.num_kv_heads} KV head(s) per rank, {engine.block_manager.num_blocks} "
              f"blocks, {sum(engine.scheduler.num_preemptions.values())} preemption(s)")
        for prompt, result in zip(prompts, results):
            for out in result.outputs:
                text = tokenizer.decode(out.token_ids, skip_special_tokens=True) if tokenizer else out.token_ids
                print(f"[{len(prompt)} prompt tokens] -> {text!r}")
    if args.json:
        Path(args.json).mkdir(parents=True, exist_ok=True)
        record = {"world": world, "kv_heads": engine.cache.num_kv_heads, "num_blocks": engine.block_manager.num_blocks,
                  "preemptions": engine.scheduler.num_preemptions, "outputs": outputs, "prompts": prompts,
                  "greedy": len(prompts) - 2,
                  "errors": [repr(r.error) for r in results if r.error is not None]}
        (Path(args.json) / f"rank{rank}.json").write_text(json.dumps(record))
    # before the process group goes: the engine's CUDA graphs recorded its collectives, and NCCL does not destroy a
    # communicator that a live graph recorded (the process would hang in destroy_process_group)
    engine.close()


def main() -> None:
    args = build_parser().parse_args()
    rank, world, device = setup(args.device)
    model, tokenizer = load(args, rank, world, device)
    run(model, tokenizer, args, rank, world)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
