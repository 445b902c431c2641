"""Tensor parallelism: transformers shards the model, hf_paged keeps one logical KV manager on every rank.

A model loaded with `from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))` under `torchrun`
(or the older `tp_plan="auto"`) splits its attention heads over the ranks of its tensor-parallel mesh: q/k/v are
column-parallel, so each rank's attention sees `num_heads / tp` query heads and `num_key_value_heads / tp` KV heads,
and o_proj is row-parallel (an all-reduce), so every rank ends a layer with the same hidden states. The paper's §4.6
layout follows: each rank's `PagedCache` holds only its KV heads, while the block manager, the scheduler and every
block table are the same on all ranks, because

* every rank makes the same calls (the same requests in the same order: the script runs on every rank);
* the scheduler is deterministic (pure Python, FCFS, no clocks);
* the pool has the same number of blocks everywhere (the smallest any rank can afford);
* every token a step picks (greedy, sampled, or a beam step's decisions) is broadcast from the group's first rank
  before any rank acts on it, so no random state, no rounding difference and no tie can make a rank diverge, also
  through preemption and swapping.

Requests must be added and aborted identically on every rank; an abort from another thread on one rank only is not
supported under tensor parallelism (the ranks' schedules would diverge).

CUDA graphs and the compiled step are on by default under tensor parallelism, as in one process: the graphs record
the row-parallel all-reduces, so a decode step makes no host round trip per layer (transformers' eager TP layers cost
~43 ms of host time in a llama-8b step on 2 H200s). NCCL does not destroy a communicator that a live graph recorded,
so `Engine.close()` must come before `destroy_process_group()`; `hf_paged.runner.model_runner` drops every live
runner's graphs at interpreter exit for engines left open. `examples/tensor_parallel.py` is the example, and
`tests/test_tensor_parallel.py` runs it with 2 processes (gloo on the CPU, NCCL on 2 GPUs). Measured:
`benchmarks/results/h200x2_2026-11-26/README.md`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import latent_kv_width

__all__ = ["TensorParallel"]


@dataclass
class TensorParallel:
    """The tensor-parallel group of a sharded model, seen from one rank."""

    size: int
    rank: int
    group: object  # torch.distributed.ProcessGroup
    src: int  # global rank of the group's rank 0: the rank whose decisions every rank follows

    @classmethod
    def of(cls, model) -> TensorParallel | None:
        """The group of a model sharded by transformers' tensor parallelism, or None (one process holds it all)."""
        size = getattr(model, "tp_size", None) or 1
        if size <= 1:
            return None
        import torch.distributed as dist

        mesh = getattr(model, "_device_mesh", None)
        if mesh is None or not dist.is_initialized():
            raise ValueError(f"the model reports tp_size={size} but has no initialized device mesh")
        if mesh.ndim > 1:
            mesh = mesh["tp"]
        group = mesh.get_group()
        return cls(size=size, rank=dist.get_rank(group), group=group, src=dist.get_global_rank(group, 0))

    def local_heads(self, num_heads: int, name: str) -> int:
        if num_heads % self.size:
            raise ValueError(f"tensor parallel size {self.size} must divide {name} ({num_heads})")
        return num_heads // self.size

    def local_kv_heads(self, config, num_kv_heads: int) -> int:
        """This rank's KV heads in the pool: its share of the config's, except a multi-head latent attention model's
        latent (one "head" every query head reads), which every rank keeps whole, as vLLM does: transformers' TP plan
        leaves `kv_a_proj_with_mqa` unsplit (`mla_kv_a_proj`) and splits the query heads and `kv_b_proj` by head, so
        each rank absorbs its own heads' up-projections (`attention.adapters.mla`) over the same latent."""
        if latent_kv_width(config) is not None:
            return num_kv_heads
        return self.local_heads(num_kv_heads, "num_key_value_heads")

    def share(self, tensor: torch.Tensor) -> torch.Tensor:
        """Make every rank hold the first rank's `tensor` (in place; returned for chaining)."""
        import torch.distributed as dist

        dist.broadcast(tensor, self.src, group=self.group)
        return tensor

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest `value` over the ranks (e.g. the KV blocks every rank can hold)."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())
