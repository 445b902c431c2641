"""End-to-end generation throughput: hf_paged's engine vs transformers `generate()` with `DynamicCache` and
transformers' own continuous batching (`generate_batch`), in one process.

Workloads come from a seeded generator (ShareGPT-like or Alpaca-like lognormal lengths) or a JSONL file of prompts;
EOS is ignored so every system produces exactly the requested number of tokens. Models are random-init named shapes
in bf16 (or a local checkpoint). Prints a markdown table, writes a JSON file and a PNG plot.

hf_paged is reported twice: `output_tok_s` counts its start-up (KV pool, memory profiling, CUDA-graph capture) in
the wall time, `steady_tok_s` does not (an engine is built once and serves for its lifetime, as vLLM's throughput
benchmark times it). transformers' `generate_batch` warms up (captures its graphs) inside its own timed run.
On CUDA each paged run also reports how long the GPU was busy with steps and idle between them (`gpu_timeline.py`),
which tells a run bound by its kernels from one bound by the host. `--dynamic-max-batches N` times DynamicCache on
its first N batches only (its full run is minutes) and reports its rate on that subset. Every system runs under
`--system-timeout` seconds; the JSON is rewritten after each one.

`--kv-cache-dtype auto,fp8` runs each hf_paged system once per KV cache dtype, in one process (an FP8 run is
reported as `SYSTEM+fp8`): the FP8 cache's throughput against the model-dtype cache's. A KV-bound workload shows the
gain (`kvbound`: 1-3k-token prompts, 256-768 new tokens, so the pool, not the batch limit, bounds the running batch):

    python benchmarks/bench_generate.py --model llama-1b --workload sharegpt --num-requests 256 --out results/
    python benchmarks/bench_generate.py --model llama-8b --workload kvbound --num-requests 512 \
        --systems paged_compiled --kv-cache-dtype auto,fp8 --max-num-seqs 512 --out results/
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gpu_timeline import BATCH_RANGES, GpuTimeline, describe_gpu
from roofline import (
    copy_bandwidth,
    decode_bound_s,
    decode_roofline_s,
    expert_weights,
    kv_read_groups,
    latency_stats,
    matmul_flops,
    model_bytes,
    prefill_flops,
    prefill_params,
)
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hf_paged.model_zoo import TimeLimitExceeded, time_limit  # noqa: E402

SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=False),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936,
                         tie_word_embeddings=True),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
    # shapes beyond llama's: head_dim 256 with softcaps and alternating sliding windows; one KV head and a 512-token
    # window; multi-head attention at head_dim 96; a mixture of experts (64 experts, 8 per token)
    "gemma2-2b": dict(model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                      sliding_window=4096, tie_word_embeddings=True),
    "gemma3-1b": dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                      sliding_window=512, tie_word_embeddings=True),
    "phi3-mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32064, tie_word_embeddings=False),
    "olmoe-1b-7b": dict(model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                        vocab_size=50304, tie_word_embeddings=False),
    # a hybrid: transformers' default Qwen3.5 text config (a 9B dense shape): 24 gated-DeltaNet layers and 8 full
    # attention layers (3 : 1), head_dim 256 with 4 KV heads, a 248k vocabulary
    "qwen3.5-9b": dict(model_type="qwen3_5_text", hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=256, vocab_size=248320,
                       linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, tie_word_embeddings=False),
    # a Mamba 2 hybrid: Granite-4.0-H-Tiny's shape (36 Mamba 2 layers, 48 heads of 64 with 128-wide states, and 4
    # attention layers; 64 experts, 6 per token, and a shared expert)
    "granite4-h-tiny": dict(model_type="granitemoehybrid", hidden_size=1536, num_hidden_layers=40,
                            num_attention_heads=12, num_key_value_heads=4, intermediate_size=512,
                            shared_intermediate_size=1024, num_local_experts=64, num_experts_per_tok=6,
                            vocab_size=100352, tie_word_embeddings=True, mamba_d_state=128, mamba_n_groups=1,
                            mamba_n_heads=48, mamba_d_head=64, mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=256,
                            layer_types=(["mamba"] * 5 + ["attention"] + (["mamba"] * 9 + ["attention"]) * 3
                                         + ["mamba"] * 4)),
    # the other MoE shapes of issue 55 (bf16: 61, 42 and 93 GB of weights; GPU only, initialised on the device)
    "qwen3-moe-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                              moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                              num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                              norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False),
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                        num_experts_per_tok=4, sliding_window=128, vocab_size=201088, tie_word_embeddings=False),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         sliding_window=None, vocab_size=32000, tie_word_embeddings=False),
    # multi-head latent attention (issue 54): DeepSeek-V2-Lite (the 576-wide latent in the pool; 64 experts, 6 per
    # token, 2 shared; 31 GB of weights in bf16: GPU only, initialised on the device)
    "deepseek-v2-lite": dict(model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944,
                             moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                             num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6,
                             n_shared_experts=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                             vocab_size=102400, tie_word_embeddings=False),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=32000, tie_word_embeddings=False),
    "tiny-hybrid": dict(model_type="qwen3_5_text", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=32000,
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                        linear_value_head_dim=32, tie_word_embeddings=False),
}
# lognormal (sigma 1) with these means, clipped to [4, 1024]; or uniform in [lo, hi] for prompts and outputs
WORKLOADS = {"sharegpt": (161, 338), "alpaca": (19, 58)}
UNIFORM_WORKLOADS = {"uniform": ((100, 1024), (100, 1024)), "long": ((2048, 8192), (32, 256)),
                     "kvbound": ((1024, 3072), (256, 768)), "longctx": ((96_000, 104_000), (64, 128)),
                     "prefill32k": ((32_000, 32_768), (16, 32))}
# every prompt starts with the same 300-token system prompt, then a ShareGPT-like user turn (lognormal, mean 64) and a
# ShareGPT-like reply (mean 128): the prefix cache serves the system prompt
SHARED_SYSTEM = {"shared_system": (300, 64, 128)}


def make_workload(kind: str, n: int, seed: int, max_len: int = 1024, jsonl: str | None = None):
    """[(prompt_ids, output_len)]: lognormal lengths (sigma 1) with the given means, clipped to [4, max_len]."""
    rng = np.random.default_rng(seed)
    if jsonl:
        rows = [json.loads(line) for line in Path(jsonl).read_text().splitlines() if line.strip()][:n]
        return [(list(r["prompt_ids"]), int(r.get("output_len", 128))) for r in rows]
    if kind in UNIFORM_WORKLOADS:
        (in_lo, in_hi), (out_lo, out_hi) = UNIFORM_WORKLOADS[kind]
        ins, outs = rng.integers(in_lo, in_hi + 1, n), rng.integers(out_lo, out_hi + 1, n)
        return [(rng.integers(100, 30000, int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]
    sigma = 1.0

    def lengths(mean):
        mu = math.log(mean) - sigma**2 / 2
        return np.clip(rng.lognormal(mu, sigma, n).astype(int), 4, max_len)

    if kind in SHARED_SYSTEM:
        shared, mean_in, mean_out = SHARED_SYSTEM[kind]
        system = rng.integers(100, 30000, shared).tolist()
        ins, outs = lengths(mean_in), lengths(mean_out)
        return [(system + rng.integers(100, 30000, int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]
    mean_in, mean_out = WORKLOADS[kind]

    ins, outs = lengths(mean_in), lengths(mean_out)
    return [(rng.integers(100, 30000, int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]


def init_tensor_parallel(device: str) -> tuple[int, int]:
    """(rank, world size) under torchrun (process group initialised, one GPU per rank), else (0, 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if device.startswith("cuda"):
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), world


def shape_checkpoint(name: str, dtype: torch.dtype, device: str = "cpu") -> str:
    """A named shape's checkpoint directory, random-initialised (seed 0) and saved on first use.

    Initialising on a GPU (`device`) takes seconds where an 8B model takes minutes on the CPU. The two draw different
    numbers from the same distributions, which is all a throughput benchmark needs."""
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"hf_paged_bench_{name}_{str(dtype).split('.')[-1]}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = build_model(name, device, dtype)
            model.save_pretrained(path)
            del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return path


def build_tp_model(name: str, dtype: torch.dtype, rank: int, device: str, max_len: int = 4096):
    """Tensor parallel (under torchrun): every rank loads its shard of a checkpoint with transformers' plan.

    A named shape is saved by rank 0 (`shape_checkpoint`) while the others wait. `max_len` sets the config's
    `max_position_embeddings` as `build_model` does for one process (llama's default rotary embedding does not
    depend on it)."""
    import torch.distributed as dist
    from transformers import DistributedConfig

    path = name
    if name in SHAPES:
        if rank == 0:
            path = shape_checkpoint(name, dtype, f"cuda:{torch.cuda.current_device()}" if device.startswith("cuda")
                                    else "cpu")
        box = [path]
        dist.broadcast_object_list(box, src=0)
        path = box[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                 distributed_config=DistributedConfig(tp_plan="auto"))
    if name in SHAPES:
        model.config.max_position_embeddings = max_len
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def build_model(name: str, device: str, dtype: torch.dtype, max_len: int = 4096, **overrides):
    """A random-weight model of a named shape (`overrides` change its config, e.g. `vocab_size`), or a local one."""
    if name in SHAPES:
        shape = dict(SHAPES[name], **overrides)
        model_type = shape.pop("model_type", "llama")
        config = AutoConfig.for_model(model_type, max_position_embeddings=max_len, **shape)
        config.eos_token_id = None
        # sdpa for the baselines where the family has it (gpt-oss has not: eager); hf_paged switches to its own
        attn = "sdpa" if getattr(AutoModelForCausalLM._model_mapping[type(config)], "_supports_sdpa", True) else "eager"
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    else:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa").to(device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def sampling_kwargs(args) -> dict:
    """The workload's sampling settings as `SamplingParams` / `GenerationConfig` fields (greedy when temperature 0)."""
    if not args.temperature:
        return {}
    return {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}


def run_dynamic(model, workload, batch_size: int, device: str, progress: bool, max_batches: int = 0):
    """transformers generate() + DynamicCache: fixed batches in arrival order, left padding, run to the longest."""
    from tqdm.auto import tqdm

    computed = 0
    batches = [workload[i : i + batch_size] for i in range(0, len(workload), batch_size)]
    if max_batches:
        batches = batches[:max_batches]
    for batch in tqdm(batches, desc="DynamicCache", disable=not progress):
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        longest = max(o for _, o in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=longest,
                           min_new_tokens=longest, do_sample=False, pad_token_id=0)
        computed += longest * len(batch)
    return {"computed_tokens": computed, "batches": len(batches),
            "output_tokens": sum(o for batch in batches for _, o in batch)}


def run_generate_batch(model, workload, use_cuda_graph: bool, progress: bool, sampling: dict | None = None):
    """transformers' own continuous batching (paged sdpa), each request with its own max_new_tokens."""
    sampling = dict(sampling or {})
    from tqdm.auto import tqdm
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                              max_new_tokens=max(o for _, o in workload), **sampling)
    cb_config = ContinuousBatchingConfig(use_cuda_graph=use_cuda_graph)
    hints = {}
    try:  # what generate_batch itself passes: lets it size its cache for the workload
        from transformers.generation.continuous_batching.continuous_api import WorkloadHints

        hints["workload_hints"] = WorkloadHints(max_prompt_length=max(len(p) for p, _ in workload),
                                                max_generated_length=max(o for _, o in workload),
                                                num_requests=len(workload))
    except (ImportError, TypeError):
        pass
    done = 0
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb_config, block=True, timeout=5, **hints
    ) as manager:
        for prompt, out_len in workload:
            manager.add_request(prompt, max_new_tokens=out_len)
        bar = tqdm(total=len(workload), desc="generate_batch", disable=not progress)
        while done < len(workload):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
                bar.update(1)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
        bar.close()
    return {"finished": done}


class StepTimer:
    """Host-side time of the parts of every engine step (schedule, execute, sample+update) and its batch size.

    `execute` returns once the decode graph is launched (the GPU runs on), so for decode steps `sample` holds the
    wait for the GPU plus the host update: `schedule + execute` is the host time the GPU waits for. Pipelined steps
    (scheduled by the fast path and launched before the previous step's tokens arrive) are timed at `execute` and at
    `_apply` (their wait + update). The wrappers pass every argument through: the engine calls `execute` with a
    keyword for pipelined steps (a wrapper that dropped it broke every pipelined step of one H100 run)."""

    def __init__(self, engine):
        self.rows: list[tuple[int, bool, float, float, float]] = []  # batch, decode-only, schedule, execute, sample
        self._parts = [0.0, 0.0, 0.0]
        self._batch, self._decode = 0, True
        sched_fn, exec_fn = engine.scheduler.schedule, engine.runner.execute
        sample_fn, apply_fn = engine._sample_and_update, engine._apply

        def schedule(*args, **kwargs):
            t = time.perf_counter()
            out = sched_fn(*args, **kwargs)
            self._parts[0] = time.perf_counter() - t
            return out

        def execute(sched, *args, **kwargs):
            if kwargs.get("input_tokens") is not None:
                self._parts[0] = 0.0  # scheduled by the pipeline's fast path, inside the previous step
            self._batch = len(sched.scheduled)
            self._decode = sched.one_token_each
            t = time.perf_counter()
            out = exec_fn(sched, *args, **kwargs)
            self._parts[1] = time.perf_counter() - t
            return out

        def timed(function):
            def wrapper(*args, **kwargs):
                t = time.perf_counter()
                out = function(*args, **kwargs)
                self._parts[2] = time.perf_counter() - t
                self.rows.append((self._batch, self._decode, *self._parts))
                return out

            return wrapper

        engine.scheduler.schedule, engine.runner.execute = schedule, execute
        engine._sample_and_update, engine._apply = timed(sample_fn), timed(apply_fn)
        self.step_wall_s = 0.0  # whole engine.step() calls: what the parts above leave out is host time between them
        step_fn = engine.step

        def step(*args, **kwargs):
            t = time.perf_counter()
            try:
                return step_fn(*args, **kwargs)
            finally:
                self.step_wall_s += time.perf_counter() - t

        engine.step = step

    def summary(self) -> dict:
        decode = [r for r in self.rows if r[1]]
        prefill = [r for r in self.rows if not r[1]]

        def mean_ms(rows, i):
            return 1000 * float(np.mean([r[i] for r in rows])) if rows else float("nan")

        bins = {}
        for lo, hi in BATCH_RANGES:
            sel = [r for r in decode if lo <= r[0] <= hi]
            if sel:
                bins[f"{lo}-{hi}"] = {"steps": len(sel), "schedule_ms": mean_ms(sel, 2), "execute_ms": mean_ms(sel, 3),
                                      "sample_ms": mean_ms(sel, 4),
                                      "step_ms": mean_ms(sel, 2) + mean_ms(sel, 3) + mean_ms(sel, 4)}
        return {
            "decode_steps": len(decode), "prefill_steps": len(prefill),
            "prefill_total_s": float(sum(r[2] + r[3] + r[4] for r in prefill)),
            "decode_total_s": float(sum(r[2] + r[3] + r[4] for r in decode)),
            "decode_step_ms": mean_ms(decode, 2) + mean_ms(decode, 3) + mean_ms(decode, 4),
            "decode_host_ms": mean_ms(decode, 2) + mean_ms(decode, 3),
            "prefill_step_ms": mean_ms(prefill, 2) + mean_ms(prefill, 3) + mean_ms(prefill, 4),
            # planning a prefill step: the GPU waits through it (the step before ended in its tokens' sync)
            "prefill_schedule_ms": mean_ms(prefill, 2),
            # engine.step() time outside schedule / execute / sample+update (outputs, bookkeeping, the first step's
            # pipeline fill), and the caller's time between steps
            "in_step_other_s": self.step_wall_s - float(sum(r[2] + r[3] + r[4] for r in self.rows)),
            "decode_by_batch": bins,
        }


def run_paged(model, workload, args, progress: bool, compile_decode: bool = False, compile_prefill: bool = True,
              prefix_caching: bool = True, kv_cache_dtype: str = "auto", window_groups: bool = True,
              fast_paths: bool = True):
    """hf_paged's engine; the caller's wall time includes its start-up (memory profiling, pool, kernel compilation,
    CUDA graph capture; with `compile_decode`, Dynamo + Inductor compiling the decode step). `compile_prefill=False`
    keeps a compiled engine's prefill steps on the model's own code (system `paged_compiled_eager_prefill`);
    `prefix_caching=False` runs without the prefix cache (systems `paged_nocache`, `paged_compiled_nocache`).
    `kv_cache_dtype`: the engine's ("fp8": an FP8 KV pool). `window_groups=False` keeps one block table for every
    layer (systems `*_onetable`), so sliding-window layers hold their whole context as before block groups.
    `fast_paths=False` runs every recurrent layer through the generic adapter, one call per prefill chunk (systems
    `*_generic`: `hf_paged.attention.varlen.FAST_PATHS` off while the engine is built and runs)."""
    from hf_paged.attention import varlen

    varlen.FAST_PATHS = fast_paths
    try:
        return _run_paged(model, workload, args, progress, compile_decode, compile_prefill, prefix_caching,
                          kv_cache_dtype, window_groups)
    finally:
        varlen.FAST_PATHS = True


def _run_paged(model, workload, args, progress: bool, compile_decode: bool, compile_prefill: bool,
               prefix_caching: bool, kv_cache_dtype: str, window_groups: bool):
    import hf_paged

    setup_start = time.perf_counter()
    experts = getattr(args, "experts_implementation", "hf_paged")
    experts = None if experts == "model" else experts
    engine = hf_paged.Engine(model, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                             experts_implementation=experts,
                             use_cuda_graph=False if args.no_cuda_graph else (True if args.cuda_graph else None),
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             gpu_memory_utilization=args.gpu_memory_utilization,
                             kv_cache_memory=args.kv_cache_memory, compile_decode=compile_decode,
                             enable_prefix_caching=prefix_caching, kv_cache_dtype=kv_cache_dtype,
                             release_window_blocks=window_groups)
    engine.runner.compile_prefill = compile_decode and compile_prefill
    try:
        return _run_engine(engine, workload, args, progress, setup_start, kv_cache_dtype)
    finally:  # a failing or timed-out run gives its pool and graphs back before the next system is built
        engine.close()


def _run_engine(engine, workload, args, progress: bool, setup_start: float, kv_cache_dtype: str) -> dict:
    import hf_paged

    engine.warm_up()
    sync(args.device)
    setup_s = time.perf_counter() - setup_start  # profiling, pool allocation, graph capture (inside wall_s too)
    timer = StepTimer(engine)
    timeline = GpuTimeline(engine)  # on CUDA: the GPU's busy and idle time between the steps
    params = [hf_paged.SamplingParams(max_new_tokens=o, ignore_eos=True, **sampling_kwargs(args)) for _, o in workload]
    waste = []
    run_start = time.perf_counter()
    ids = [engine.add_request(p, params=sp) for (p, _), sp in zip(workload, params)]
    done = 0
    from tqdm.auto import tqdm

    bar = tqdm(total=len(ids), desc="hf_paged", disable=not progress)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step(finished_only=True):
            if out.finished:
                outputs[out.request_id] = out
                done += 1
                bar.update(1)
        if engine.stats["steps"] % 16 == 0:
            s = engine.kv_stats()
            if s.allocated_slots:
                waste.append(s.waste_slots / s.allocated_slots)
    sync(args.device)
    run_s = time.perf_counter() - run_start
    bar.close()
    # a throughput is only a throughput if every request produced exactly its tokens
    failed = [o for o in outputs.values() if o.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(ids)} requests failed, first: {failed[0].error!r}")
    wrong = [i for i, (rid, (_, n)) in enumerate(zip(ids, workload))
             if rid not in outputs or len(outputs[rid].outputs[0].token_ids) != n]
    if wrong:
        raise RuntimeError(f"{len(wrong)} requests did not return exactly their output length (first: #{wrong[0]})")
    steps = max(1, engine.stats["steps"])
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outputs.values()]
    tpot = [(o.metrics["finished_time"] - o.metrics["first_token_time"]) / (len(o.outputs[0].token_ids) - 1)
            for o in outputs.values() if len(o.outputs[0].token_ids) > 1]
    result = {
        "ttft": latency_stats(ttft),
        "tpot": latency_stats(tpot),
        "setup_s": setup_s,
        "run_s": run_s,
        "steady_tok_s": sum(o for _, o in workload) / run_s,
        "num_blocks": engine.block_manager.num_blocks,
        "kv_cache_dtype": kv_cache_dtype,
        "kv_capacity_tokens": engine.block_manager.num_blocks * engine.cache.block_size,
        "steps": engine.stats["steps"],
        "mean_running_batch": engine.stats["running_sum"] / steps,
        "max_running_batch": engine.stats["max_running"],
        "kv_waste_pct": 100 * float(np.mean(waste)) if waste else 0.0,
        "preemptions": sum(engine.scheduler.num_preemptions.values()),
        "graph_steps": engine.runner.graph_steps,
        "eager_steps": engine.runner.eager_steps,
        "ragged_graph_steps": engine.runner.ragged_graph_steps,
        "ragged_graph_replays": engine.runner.ragged_graph_replays,
        "ragged_capture_s": sum(engine.runner.ragged_capture_seconds.values()),
        "table_rows_uploaded": engine.runner.table_rows_uploaded,
        "pipelined_steps": engine.pipelined_steps,
        "prefix_hit_tokens": engine.stats["prefix_hit_tokens"],
        "prefix_hit_rate": engine.stats["prefix_hit_rate"],
        "prefill_tokens": engine.stats["prefill_tokens"],
        "state_slots": engine.kv_stats().state_slots,
        "state_checkpoint_hits": engine.block_manager.state.checkpoint_hits if engine.block_manager.state else 0,
        "timing": {**timer.summary(), "outside_steps_s": run_s - timer.step_wall_s},
        "gpu": timeline.summary(),
    }
    return result


def _kv_dtypes(text: str) -> list[str]:
    """`--kv-cache-dtype`: a comma-separated list of hf_paged's KV cache dtypes."""
    from hf_paged.cache import KV_CACHE_DTYPES

    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in KV_CACHE_DTYPES]
    if bad or not dtypes:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(KV_CACHE_DTYPES)}, got {text!r}")
    return dtypes


def _paged_base(system: str) -> str:
    """An hf_paged system's name without its options: `_nocache` (no prefix cache), `_onetable` (one block table
    for every layer: sliding-window layers keep their blocks, `release_window_blocks=False`) and `_generic` (the
    recurrent layers' generic adapter, no fast path), in any order."""
    return system.replace("_nocache", "").replace("_onetable", "").replace("_generic", "")


def _runs(systems: str, kv_dtypes: list[str]) -> list[tuple[str, str, str]]:
    """(label, system, KV cache dtype) of every run: each hf_paged system once per dtype (labelled `SYSTEM+fp8`
    for a dtype other than "auto"), the others once."""
    runs = []
    for system in systems.split(","):
        for kv_dtype in (kv_dtypes if system.startswith("paged") else ["auto"]):
            runs.append((system if kv_dtype == "auto" else f"{system}+{kv_dtype}", system, kv_dtype))
    return runs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--workload", default="sharegpt",
                        choices=sorted(WORKLOADS) + sorted(UNIFORM_WORKLOADS) + sorted(SHARED_SYSTEM))
    parser.add_argument("--jsonl", default=None, help="prompts as JSON lines {prompt_ids: [...], output_len: N}")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", default="paged,generate_batch_graphs,dynamic",
                        help="comma list of: paged, paged_compiled, paged_compiled_eager_prefill (each may end in "
                             "_nocache: no prefix cache, _onetable: one block table for every layer, _generic: recurrent layers "
                             "without their fast path), "
                             "generate_batch, generate_batch_graphs, dynamic")
    parser.add_argument("--dynamic-batch-size", type=int, default=64)
    parser.add_argument("--dynamic-max-batches", type=int, default=0,
                        help="time DynamicCache on its first N batches only (0: all) and report its rate there")
    parser.add_argument("--system-timeout", type=int, default=0, help="seconds per system (0: no limit)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="default: the engine's (hf_paged.engine.default_max_num_batched_tokens)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-dtype", default="auto", type=_kv_dtypes,
                        help="comma-separated KV cache dtypes (auto, fp8): each hf_paged system runs once per dtype")
    parser.add_argument("--no-cuda-graph", action="store_true")
    parser.add_argument("--cuda-graph", action="store_true", help="force CUDA graphs on (the default on CUDA)")
    parser.add_argument("--profile", action="store_true", help="cProfile the hf_paged run into OUT/profile_paged.txt")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled (with --top-p/--top-k)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--experts-implementation", default="hf_paged",
                        help="mixture-of-experts layers of the paged systems: hf_paged (the fused Triton experts), "
                             "grouped_mm, batched_mm, eager, or model (as transformers loaded them)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    dtype = getattr(torch, args.dtype)
    workload = make_workload(args.workload, args.num_requests, args.seed, jsonl=args.jsonl)
    output_tokens = sum(o for _, o in workload)
    rank, world = init_tensor_parallel(args.device)
    longest = max(len(p) + o for p, o in workload)
    max_len = max(4096, 1 << (longest - 1).bit_length())
    if world > 1:  # the same launch under torchrun: one shard of the model and one engine per rank
        unsupported = set(args.systems.split(",")) - {"paged", "paged_compiled", "paged_compiled_eager_prefill",
                                                      "dynamic"}
        if unsupported:
            raise SystemExit(f"under tensor parallelism only paged, paged_compiled(_eager_prefill) and dynamic run, "
                             f"not {unsupported}")
        model = build_tp_model(args.model, dtype, rank, args.device, max_len=max_len)
        if rank != 0:
            args.no_progress = True
    else:
        model = build_model(args.model, args.device, dtype, max_len=max_len)
    progress = not args.no_progress
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = (f"generate_{Path(args.model).name}_{args.workload}_{len(workload)}" + (f"_tp{world}" if world > 1 else "")
            + (f"_t{args.temperature:g}" if args.temperature else "")
            + "".join(f"_{d}" for d in args.kv_cache_dtype if d != "auto"))
    meta = {
        "model": args.model, "workload": args.workload, "num_requests": len(workload),
        "mean_input": float(np.mean([len(p) for p, _ in workload])), "mean_output": output_tokens / len(workload),
        "output_tokens": output_tokens, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__, "python": platform.python_version(), "command": " ".join(sys.argv),
        "tensor_parallel": world, "kv_cache_dtypes": args.kv_cache_dtype,
    }
    import transformers

    import hf_paged

    meta["transformers"] = transformers.__version__
    meta["sampling"] = sampling_kwargs(args) or "greedy"
    if args.device.startswith("cuda"):  # the ceilings of this GPU, measured now (METHOD.md), and the workload's bound
        meta["copy_tb_s"] = copy_bandwidth(args.device) / 1e12
        meta["matmul_tflop_s"] = matmul_flops(args.device) / 1e12
        weights, experts = model_bytes(model), expert_weights(model)
        # a hybrid model's recurrent states: each decode step reads and writes every running sequence's
        state = sum(spec.nbytes for spec in hf_paged.attention.profile_state_specs(model).values())
        meta["state_bytes_per_seq"] = state
        # FLOPs per rank: the whole model's (its shards times the ranks) over the ranks
        token_params, prompt_params = prefill_params(model)
        for kv_name in args.kv_cache_dtype:  # per KV cache dtype (an FP8 cache reads one byte an element)
            kv_token = hf_paged.cache.kv_bytes_per_token(
                model.config, hf_paged.cache.resolve_kv_cache_dtype(kv_name) or dtype) // world
            groups = kv_read_groups(model.config, kv_token)
            suffix = "" if kv_name == "auto" else f"_{kv_name}"
            meta[f"decode_bound_s{suffix}"] = decode_bound_s(workload, weights, groups, meta["copy_tb_s"] * 1e12,
                                                             experts=experts, state_bytes=state)
            # the bound with each step also at least its matrix FLOPs' time (every decode row runs the output
            # projection)
            meta[f"decode_roofline_s{suffix}"] = decode_roofline_s(
                workload, weights, groups, meta["copy_tb_s"] * 1e12, token_params + prompt_params,
                meta["matmul_tflop_s"] * 1e12, experts=experts, state_bytes=state)
        meta["prefill_tflop"] = prefill_flops(workload, model.config, token_params * world, prompt_params * world) \
            / 1e12 / world
    for label, system, kv_dtype in _runs(args.systems, args.kv_cache_dtype):
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        sync(args.device)
        start = time.perf_counter()
        tokens = output_tokens
        try:
            # no per-rank alarm under tensor parallelism: one rank leaving a collective would hang the others
            with time_limit(args.system_timeout if world == 1 else 0):
                if system == "dynamic":
                    extra = run_dynamic(model, workload, args.dynamic_batch_size, args.device, progress,
                                        args.dynamic_max_batches)
                    tokens = extra["output_tokens"]
                elif system in ("generate_batch", "generate_batch_graphs"):
                    extra = run_generate_batch(model, workload, system.endswith("graphs"), progress, sampling_kwargs(args))
                elif system == "paged" and args.profile:
                    import cProfile
                    import io
                    import pstats

                    profiler = cProfile.Profile()
                    extra = profiler.runcall(run_paged, model, workload, args, progress, kv_cache_dtype=kv_dtype)
                    text = io.StringIO()
                    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
                    (out / "profile_paged.txt").write_text(text.getvalue())
                elif _paged_base(system) in ("paged", "paged_compiled", "paged_compiled_eager_prefill"):
                    extra = run_paged(model, workload, args, progress, compile_decode=system.startswith("paged_comp"),
                                      compile_prefill=_paged_base(system) != "paged_compiled_eager_prefill",
                                      prefix_caching="_nocache" not in system, kv_cache_dtype=kv_dtype,
                                      window_groups="_onetable" not in system, fast_paths="_generic" not in system)
                else:
                    raise SystemExit(f"unknown system {system!r}")
                sync(args.device)
        except (TimeLimitExceeded, RuntimeError) as error:  # a stuck or failing system: record it, go on
            print(f"{label}: {type(error).__name__}: {error}", flush=True)
            rows.append({"system": label, "error": f"{type(error).__name__}: {error}",
                         "elapsed_s": time.perf_counter() - start})
            continue
        finally:
            if system.startswith("paged"):
                import hf_paged

                hf_paged.disable(model)
                model._hf_paged_engine = None
        wall = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else float("nan")
        rows.append({"system": label, "wall_s": wall, "output_tok_s": tokens / wall,
                     "req_s": extra.get("batches", 0) * args.dynamic_batch_size / wall if system == "dynamic"
                     and args.dynamic_max_batches else len(workload) / wall, "peak_gib": peak, **extra})
        if rank == 0:
            print(f"{label}: {tokens / wall:,.0f} output tok/s", flush=True)
            (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    if rank != 0:
        return
    rows_ok = [r for r in rows if "error" not in r]
    base = {r["system"]: r["output_tok_s"] for r in rows_ok}
    print(f"\n{meta}\n")
    print("| system | wall s | output tok/s | req/s | x dynamic | x generate_batch | peak GiB | mean batch | KV waste % |")
    print("|---|---|---|---|---|---|---|---|---|")
    cb = base.get("generate_batch_graphs", base.get("generate_batch"))
    table = []
    for r in rows_ok:
        table.append((r["system"], r["wall_s"], r["output_tok_s"], r))
        if r["system"].startswith("paged"):  # the same run without the engine's start-up
            table.append((f"{r['system']} (steady, start-up excluded)", r["run_s"], r["steady_tok_s"], r))
    for name, wall, tok_s, r in table:
        ratio = tok_s / base["dynamic"] if "dynamic" in base else float("nan")
        ratio_cb = tok_s / cb if cb else float("nan")
        print(f"| {name} | {wall:.1f} | {tok_s:,.0f} | {r['req_s']:.2f} | {ratio:.2f} | {ratio_cb:.2f} | "
              f"{r['peak_gib']:.1f} | {r.get('mean_running_batch', float('nan')):.1f} | "
              f"{r.get('kv_waste_pct', float('nan')):.2f} |")
    for r in rows:
        if "error" in r:
            print(f"| {r['system']} | failed: {r['error']} |")
    if any(key.startswith("decode_bound_s") for key in meta):
        bound_of = {name: "" if name == "auto" else f"_{name}" for name in args.kv_cache_dtype}
        print(f"\nbound: decode {meta['decode_bound_s' + bound_of[args.kv_cache_dtype[0]]]:.2f} s at {meta['copy_tb_s']:.2f} TB/s (the weights a step reads "
              f"+ every running sequence's KV per step, all requests at once); bf16 matmul {meta['matmul_tflop_s']:.0f} TFLOP/s; "
              f"roofline {meta['decode_roofline_s' + bound_of[args.kv_cache_dtype[0]]]:.2f} s (each step also at least its matrix "
              "FLOPs' time; each run's own KV cache dtype's below)")
        print("| system | run s (steady) | bound / run | roofline / run | decode step ms (host ms) | steps | prefill s | "
              "prefill MFU | TTFT mean / p50 / p99 ms | TPOT mean / p50 / p99 ms |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows_ok:
            if not r["system"].startswith("paged"):
                continue
            t = r["timing"]
            mfu = meta["prefill_tflop"] / max(t["prefill_total_s"], 1e-9) / meta["matmul_tflop_s"]
            suffix = bound_of.get(r.get("kv_cache_dtype", "auto"), "")
            r["bound_fraction"], r["prefill_mfu"] = meta["decode_bound_s" + suffix] / r["run_s"], mfu
            r["roofline_fraction"] = meta["decode_roofline_s" + suffix] / r["run_s"]
            ttft, tpot = r["ttft"], r["tpot"]
            print(f"| {r['system']} | {r['run_s']:.2f} | {r['bound_fraction']:.0%} | {r['roofline_fraction']:.0%} | "
                  f"{t['decode_step_ms']:.2f} "
                  f"({t['decode_host_ms']:.2f}) | {r['steps']} | {t['prefill_total_s']:.2f} | {mfu:.0%} | "
                  f"{ttft['mean_ms']:.0f} / {ttft['p50_ms']:.0f} / {ttft['p99_ms']:.0f} | "
                  f"{tpot['mean_ms']:.1f} / {tpot['p50_ms']:.1f} / {tpot['p99_ms']:.1f} |")
        for r in rows_ok:
            t = r.get("timing", {})
            if r["system"].startswith("paged") and "in_step_other_s" in t:
                print(f"{r['system']}: {t['in_step_other_s']:.2f} s of host time in steps outside schedule / execute / "
                      f"sample+update (overlaps the GPU when pipelined), {t['outside_steps_s']:.2f} s between steps")
                if t.get("prefill_steps"):
                    print(f"{r['system']}: {t['prefill_steps']} prefill steps of {t['prefill_step_ms']:.1f} ms, "
                          f"{t['prefill_schedule_ms']:.2f} ms of each planning it (the GPU idle)")
            if r["system"].startswith("paged") and r.get("gpu"):
                print(describe_gpu(r["system"], r["gpu"]))
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        colors = ["#2a7" if name.startswith("paged") else "#999" for name, *_ in table]
        ax.bar([name.replace(" (steady, start-up excluded)", "\n(steady)").replace("_compiled", "\n+compile")
                for name, *_ in table],
               [tok_s for _, _, tok_s, _ in table], color=colors)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"{args.model}, {args.workload}, {len(workload)} requests")
        fig.tight_layout()
        fig.savefig(out / f"{stem}.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
