"""The benchmark harnesses drive the engine the way they will on the GPU (CPU, tiny model, static decode path).

A harness that wraps engine methods can break the path it measures: once, a timing wrapper that dropped a keyword
argument failed every pipelined step of an H100 run, and the benchmark reported the broken run's wall time as a
throughput. So: the harness's own run must engage the pipelined / graph decode path, and it must refuse to report a
run in which a request failed or came back short.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

import hf_paged

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
bench_generate = pytest.importorskip("bench_generate")
bench_beam = pytest.importorskip("bench_beam")
bench_host_step = pytest.importorskip("bench_host_step")


@pytest.fixture
def static_engines(monkeypatch):
    """Every Engine the harness builds runs its decode steps on the static (CUDA-graph path) buffers."""
    original = hf_paged.Engine.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.runner.decode_mode = "static"

    monkeypatch.setattr(hf_paged.Engine, "__init__", init)


def _args(**overrides):
    base = dict(block_size=16, max_num_seqs=64, no_cuda_graph=True, max_num_batched_tokens=512,
                gpu_memory_utilization=0.9, kv_cache_memory="256MiB", device="cpu",
                cuda_graph=False, temperature=0.0, top_p=1.0, top_k=0)
    base.update(overrides)
    return types.SimpleNamespace(**base)


@pytest.mark.slow
def test_generate_harness_measures_the_pipelined_path(static_engines):
    model = bench_generate.build_model("tiny", "cpu", torch.float32)
    workload = bench_generate.make_workload("alpaca", 24, 0)
    result = bench_generate.run_paged(model, workload, _args(), progress=False)
    assert result["pipelined_steps"] > 10 and result["graph_steps"] > 10
    timing = result["timing"]
    assert timing["decode_steps"] > 10  # the timer saw the pipelined steps
    # the host time the parts leave out is accounted for, never negative: parts + rest = the steps' wall time
    assert 0 <= timing["in_step_other_s"] and 0 <= timing["outside_steps_s"] < result["run_s"]
    parts = timing["decode_total_s"] + timing["prefill_total_s"]
    assert parts + timing["in_step_other_s"] + timing["outside_steps_s"] == pytest.approx(result["run_s"], rel=1e-6)
    assert result["gpu"] is None  # CUDA events only on CUDA


class _Clock:
    now = 0.0


class _FakeEvent:
    """A CUDA event's timing interface on a settable clock (ms)."""

    def record(self):
        self.at = _Clock.now

    def elapsed_time(self, other):
        return other.at - self.at


def test_gpu_timeline_brackets_every_step_of_an_engine(static_engines):
    """The timeline's hooks are where the engine's steps go: every step (chunked prefills, whose rows do not all
    sample, mixed and pipelined decode steps) records a start and an end."""
    from gpu_timeline import GpuTimeline

    import hf_paged

    model = bench_generate.build_model("tiny", "cpu", torch.float32)
    engine = hf_paged.Engine(model, num_blocks=256, block_size=16, max_num_seqs=16, max_num_batched_tokens=64)
    timeline = GpuTimeline(engine, event=_FakeEvent, enabled=True)
    for prompt, n in bench_generate.make_workload("alpaca", 12, 0):
        engine.add_request(prompt, max_new_tokens=min(n, 6), ignore_eos=True)
    while engine.has_unfinished():
        engine.step(finished_only=True)
    engine.close()
    assert len(timeline.marks) == engine.stats["steps"] and timeline.marks
    assert all(end is not None for _, end, _, _ in timeline.marks)
    assert any(not decode for *_, decode in timeline.marks) and any(decode for *_, decode in timeline.marks)


def test_gpu_timeline_splits_busy_and_idle_between_steps():
    """Each step's events bracket its GPU work (execute entered .. tokens picked); the gap from one step's end to the
    next one's start is idle time, counted before prefill steps apart, and decode steps average by running rows."""
    import types

    from gpu_timeline import GpuTimeline, describe_gpu

    from hf_paged.core import SchedulerOutput

    def item(n):
        return types.SimpleNamespace(num_tokens=n)

    runner = types.SimpleNamespace(execute=lambda sched: "logits", device=types.SimpleNamespace(type="cuda"))
    engine = types.SimpleNamespace(runner=runner, picker=types.SimpleNamespace(pick=lambda *a: "tokens"))
    timeline = GpuTimeline(engine, event=_FakeEvent)
    # (clock at launch, clock at pick, items): a prefill step, two pipelined decode steps of 20 rows, a mixed step
    # (an admission beside the decodes), a decode step of 40 rows
    steps = [(0.0, 50.0, [item(100), item(30)]), (52.0, 53.5, [item(1)] * 20), (53.5, 55.0, [item(1)] * 20),
             (57.0, 60.0, [item(1)] * 20 + [item(8)]), (61.0, 63.0, [item(1)] * 40)]
    for launch, picked, items in steps:
        _Clock.now = launch
        assert engine.runner.execute(SchedulerOutput(scheduled=items)) == "logits"
        _Clock.now = picked
        assert engine.picker.pick() == "tokens"
    summary = timeline.summary()
    assert summary["gpu_busy_s"] == pytest.approx((50 + 1.5 + 1.5 + 3 + 2) / 1000)
    assert summary["gpu_idle_s"] == pytest.approx((2 + 0 + 2 + 1) / 1000)
    assert summary["gpu_idle_before_prefill_s"] == pytest.approx(2 / 1000)  # the mixed step's
    assert summary["decode_gpu_ms"] == pytest.approx(5 / 3)
    assert summary["decode_gpu_ms_by_rows"] == {"9-32": {"steps": 2, "gpu_ms": pytest.approx(1.5)},
                                                "33-96": {"steps": 1, "gpu_ms": pytest.approx(2.0)}}
    off = GpuTimeline(types.SimpleNamespace(runner=types.SimpleNamespace(device=types.SimpleNamespace(type="cpu"))))
    assert off.summary() is None
    line = describe_gpu("paged", summary)
    assert "GPU busy 0.06 s, idle 0.005 s" in line and "9-32 rows 1.50, 33-96 rows 2.00" in line


def test_generate_harness_runs_each_engine_system_per_kv_cache_dtype(static_engines):
    """`--kv-cache-dtype auto,fp8`: every hf_paged system twice in one process (the FP8 run labelled), the others once;
    the FP8 engine's pool holds four times a float32 pool's tokens in the same memory."""
    assert bench_generate._runs("paged_compiled,dynamic", ["auto", "fp8"]) == [
        ("paged_compiled", "paged_compiled", "auto"), ("paged_compiled+fp8", "paged_compiled", "fp8"),
        ("dynamic", "dynamic", "auto")]
    model = bench_generate.build_model("tiny", "cpu", torch.float32)
    workload = bench_generate.make_workload("alpaca", 6, 0)
    auto = bench_generate.run_paged(model, workload, _args(kv_cache_memory="16MiB"), progress=False)
    fp8 = bench_generate.run_paged(model, workload, _args(kv_cache_memory="16MiB"), progress=False,
                                   kv_cache_dtype="fp8")
    assert fp8["kv_cache_dtype"] == "fp8" and fp8["graph_steps"] > 0
    assert fp8["kv_capacity_tokens"] == 4 * auto["kv_capacity_tokens"]


def test_generate_harness_refuses_a_run_with_failed_requests(static_engines, monkeypatch):
    model = bench_generate.build_model("tiny", "cpu", torch.float32)
    workload = bench_generate.make_workload("alpaca", 8, 0)
    original = hf_paged.engine.Engine._launch
    calls = {"n": 0}

    def failing_launch(self, sched, logits):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
        return original(self, sched, logits)

    monkeypatch.setattr(hf_paged.engine.Engine, "_launch", failing_launch)
    with pytest.raises(RuntimeError, match="requests failed"):
        bench_generate.run_paged(model, workload, _args(), progress=False)


def test_beam_harness_runs_and_checks_its_outputs(static_engines):
    model = bench_generate.build_model("tiny", "cpu", torch.float32)
    prompts = bench_beam.make_prompts(3, 40, 0, model.config.vocab_size)  # two full blocks the beams share
    args = types.SimpleNamespace(block_size=16, max_tokens=512, gpu_memory_utilization=0.9,
                                 kv_cache_memory="256MiB", new_tokens=5, device="cpu")
    row = bench_beam.run_paged(model, prompts, 2, args)
    assert row["graph_steps"] > 0 and 0 < row["mean_saving_pct"] < 100
    assert row["timing"]["decode_steps"] > 0


@pytest.mark.parametrize("sampled", [False, True])
def test_host_step_harness_times_pipelined_steps_and_restores_the_sampler(sampled):
    """bench_host_step times pipelined steps only (it raises otherwise) and puts the sampling backend back."""
    from hf_paged.kernels import sampling

    saved = sampling._triton_module, sampling.get_backend
    assert bench_host_step.host_ms_per_step(4, 6, sampled=sampled, prefix_caching=True) > 0
    assert bench_host_step.host_ms_per_step(4, 6, sampled=sampled, prefix_caching=True, finishing=True) > 0
    assert bench_host_step.host_ms_per_step(4, 6, sampled=sampled, prefix_caching=False, grouped=True) > 0
    assert (sampling._triton_module, sampling.get_backend) == saved


def test_bound_counts_the_bytes_a_decode_step_reads():
    """An untied input embedding is only gathered (a step reads B rows of it), so the bound leaves it out; a tied one
    is the lm_head too and counts once; every other weight counts once."""
    roofline = pytest.importorskip("roofline")
    untied = bench_generate.build_model("tiny", "cpu", torch.float32)
    embed = untied.get_input_embeddings().weight
    every = sum(p.numel() * p.element_size() for p in untied.parameters())
    assert roofline.model_bytes(untied) == every - embed.numel() * embed.element_size()
    tied = bench_generate.build_model("tiny", "cpu", torch.float32, tie_word_embeddings=True)
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    assert roofline.model_bytes(tied) == sum(p.numel() * p.element_size() for p in tied.parameters())
    # the same on the meta device (no addresses there: bench_grpo_rollouts sizes its bound from a meta model)
    assert roofline.model_bytes(bench_generate.build_model("tiny", "meta", torch.float32)) == roofline.model_bytes(untied)
    # the bound moves by exactly the left-out bytes for each step
    workload = [([1] * 5, 3), ([1] * 2, 1)]
    full = roofline.decode_bound_s(workload, every, 8, 1.0)
    assert roofline.decode_bound_s(workload, roofline.model_bytes(untied), 8, 1.0) == pytest.approx(
        full - 3 * embed.numel() * embed.element_size())


def test_roofline_takes_each_step_at_the_larger_of_its_bytes_and_its_flops():
    """A step is bound by its bytes at few rows and by its matrix FLOPs at many: the roofline is the sum over steps
    of the larger, so it is never below the bytes-only bound and equals it when the matrix units are never the
    limit."""
    roofline = pytest.importorskip("roofline")
    # 3 requests: steps 1-2 run 3 rows, step 3 runs 1; contexts 4,4,4 then 5,5,5 then 6
    workload = [([1] * 4, 3), ([1] * 4, 2), ([1] * 4, 2)]
    step_bytes, rows = roofline.decode_step_bytes(workload, 100, 10)
    assert rows.tolist() == [3, 3, 1]
    assert step_bytes.tolist() == [100 + 10 * 12, 100 + 10 * 15, 100 + 10 * 6]
    bound = roofline.decode_bound_s(workload, 100, 10, 2.0)
    assert bound == pytest.approx(sum(step_bytes) / 2.0)
    # 50 params a token at 1 FLOP/s per 2 bytes/s: 3-row steps take 300 s of FLOPs (> 110 / 125 s of bytes), the
    # 1-row step 100 s (> 80 s of bytes)
    assert roofline.decode_roofline_s(workload, 100, 10, 2.0, 50, 1.0) == pytest.approx(300 + 300 + 100)
    # with fast matrix units every step is bytes-bound: the roofline is the bound
    assert roofline.decode_roofline_s(workload, 100, 10, 2.0, 50, 1e9) == pytest.approx(bound)
    assert roofline.decode_roofline_s(workload, 100, 10, 2.0, 10, 1.0) >= bound


def _tiny_mixtral():
    """A one-layer mixture of experts on the meta device: 8 experts of 3 x 16 x 32 weights, 2 per token, vocab 64."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, num_local_experts=8,
                                  num_experts_per_tok=2, vocab_size=64)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_bound_reads_a_sliding_window_and_the_routed_experts_only():
    """A sliding-window layer reads at most its window of the context in a step; a mixture of experts reads the
    experts its tokens are routed to (their expected number under uniform routing), so a one-token step of a model
    with 8 experts and 2 per token reads a quarter of the expert weights."""
    roofline = pytest.importorskip("roofline")
    from transformers import AutoConfig

    config = AutoConfig.for_model("gemma2", num_hidden_layers=4, sliding_window=3)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    groups = roofline.kv_read_groups(config, 40)
    assert groups == [(20, 3), (20, None)]
    workload = [([1] * 5, 2)]  # contexts of 5 then 6 tokens: the sliding layers read 3 of them
    assert roofline.decode_bound_s(workload, 0, groups, 1.0) == pytest.approx(20 * (3 + 3) + 20 * (5 + 6))
    assert roofline.kv_read_groups(AutoConfig.for_model("llama", num_hidden_layers=2), 40) == [(40, None)]

    model = _tiny_mixtral()
    expert_bytes, num, top = roofline.expert_weights(model)
    assert (num, top) == (8, 2) and expert_bytes == 4 * 8 * 3 * 16 * 32
    weights = roofline.model_bytes(model)
    one = roofline.decode_bound_s([([1], 1)], weights, 0, 1.0, experts=(expert_bytes, num, top))
    assert one == pytest.approx(weights - expert_bytes * 3 / 4)
    dense = bench_generate.build_model("tiny", "meta", torch.float32)
    assert roofline.expert_weights(dense) == (0, 1, 1)


def test_prefill_flops_count_the_products_a_prompt_runs():
    """A prompt token multiplies the layers' matrices, not the embedding tables (the input one is gathered; the output
    projection runs on each prompt's last token only), and a token of a mixture of experts uses `top / experts` of
    the routed experts."""
    roofline = pytest.importorskip("roofline")
    from transformers import AutoConfig

    untied = bench_generate.build_model("tiny", "meta", torch.float32)
    every = sum(p.numel() for p in untied.parameters())
    embed, head = untied.get_input_embeddings().weight.numel(), untied.get_output_embeddings().weight.numel()
    assert roofline.prefill_params(untied) == (every - embed - head, head)
    tied = bench_generate.build_model("tiny", "meta", torch.float32, tie_word_embeddings=True)
    assert roofline.prefill_params(tied) == (sum(p.numel() for p in tied.parameters()) - embed, embed)
    moe = _tiny_mixtral()
    experts = 8 * 3 * 16 * 32
    dense = sum(p.numel() for p in moe.parameters()) - experts - 2 * 64 * 16
    assert roofline.prefill_params(moe) == (dense + experts // 4, 64 * 16)
    # 2 FLOPs per product; the head once per prompt; attention over the causal square
    flops = roofline.prefill_flops([([1] * 3, 1)], untied.config, 10, 7)
    text = untied.config
    attention = 4.0 * text.num_hidden_layers * text.num_attention_heads * text.head_dim * 3 * 4 / 2
    assert flops == pytest.approx(2 * 10 * 3 + 2 * 7 + attention)
    # a sliding-window layer's queries see at most the window: 5 tokens, window 2 -> 1 + 2 + 2 + 2 + 2 pairs
    gemma = AutoConfig.for_model("gemma2", num_hidden_layers=2, sliding_window=2, num_attention_heads=2, head_dim=4)
    per_pair = 4.0 * 2 * 4
    assert roofline.prefill_flops([([1] * 5, 1)], gemma, 0) == pytest.approx(per_pair * ((1 + 2 + 3 + 4 + 5) + 9))



@pytest.mark.parametrize("name,experts,top", [("olmoe-1b-7b", 64, 8), ("qwen3-moe-30b-a3b", 128, 8),
                                             ("gpt-oss-20b", 32, 4), ("mixtral-8x7b", 8, 2)])
def test_moe_shapes_build_with_their_experts(name, experts, top):
    """The MoE shapes of bench_generate build (on the meta device: no memory) with the experts the bound counts."""
    roofline = pytest.importorskip("roofline")
    model = bench_generate.build_model(name, "meta", torch.bfloat16)
    expert_bytes, num, k = roofline.expert_weights(model)
    assert (num, k) == (experts, top) and expert_bytes > 0.5 * roofline.model_bytes(model)


def test_decode_kernel_bench_builds_a_latent_read_once():
    """bench_decode_kernel's MLA shape: the values are a view of the keys' first 512 columns, counted once, and the
    wide kernel runs it (its GPU check: `--shapes wide`)."""
    bench = pytest.importorskip("bench_decode_kernel")
    shape = dict(B=2, L=32, Hq=16, Hkv=1, D=576, Dv=512, latent=True)
    q, k, v, kc, vc, bt, sl = bench.build(shape, device="cpu")
    assert vc.data_ptr() == kc.data_ptr() and vc.shape[-1] == v.shape[-1] == 512
    assert bench.kv_bytes(shape) == 2 * 32 * 576 * 2
    mod, programs = bench.decode_module(shape)
    assert mod.__name__.endswith("triton_decode_wide") and programs == 1
    assert bench.WIDE_SHAPES == ["B64-L2048-h16/1-d576/512", "B64-L4096-h16/2-d512", "B32-L2048-h128/1-d576/512"]
    assert bench.LLAMA8B_SHAPES == ["B64-L2048-h32/8-d128", "B128-L1024-h32/8-d128", "B256-L2048-h32/8-d128",
                                    "B320-L1024-h32/8-d128", "B128-L3072-h32/8-d128", "B320-L3072-h32/8-d128"]


def test_decode_kernel_bench_times_and_tabulates_each_fp8_read_mode(tmp_path, capsys):
    """`--fp8-read-modes`: the FP8 decode timed once per `triton_fp8.READ_MODE` (the setting restored after), each
    mode's µs, TB/s, speed-up over bf16 and error in the printed table."""
    bench = pytest.importorskip("bench_decode_kernel")
    pytest.importorskip("triton")
    from hf_paged.kernels import triton_fp8

    saved = triton_fp8.READ_MODE
    times = {"cast": 10.0, "fp16": 5.0, "bits": 8.0}

    def fake_bench(fn):
        fn()
        return times[triton_fp8.READ_MODE]

    modes = bench.time_read_modes(["cast", "fp16", "bits"], lambda: torch.full((2,), 1.5), torch.ones(2),
                                  fake_bench, 2e6, 20.0)
    assert triton_fp8.READ_MODE == saved and list(modes) == ["cast", "fp16", "bits"]
    assert modes["fp16"] == pytest.approx(dict(us=5.0, tbps=0.4, speedup=4.0, err=0.5))
    row = dict(name="B1-L16-h32/8-d128", sdpa_us=1.0, sdpa_anchor_us=None, gather_sdpa_us=1.0, paged_us=20.0,
               paged_tbps=1.0, sdpa_tbps=1.0, ratio=1.0, default_splits=1, max_abs_err_vs_sdpa=0.0,
               paged_fp8_us=10.0, paged_fp8_tbps=1.0, fp8_speedup=2.0, fp8_read_modes=modes)
    meta = dict(device="cpu", sms=1, torch="t", triton="t", copy_tbps=1.0)
    bench.render([row], meta, str(tmp_path))
    table = (tmp_path / "decode_kernel.md").read_text()
    assert "| shape | bf16 paged µs | cast | fp16 | bits |" in table
    assert "| B1-L16-h32/8-d128 | 20.0 | 10.0 / 0.20 / 2.00x / 5.0e-01 | 5.0 / 0.40 / 4.00x / 5.0e-01 |" in table


def test_decode_kernel_tile_sweep_times_each_tile_until_the_budget(capsys):
    """`sweep_tiles` (both `--sweep` and `--fp8-sweep`): one row per tile with the heuristic's splits for its width,
    the error against the reference when given, a tile that fails to compile skipped, and the sweep stopped when the
    budget runs out."""
    bench = pytest.importorskip("bench_decode_kernel")
    tiles = [(32, 1, 2), (64, 4, 2), (128, 8, 3), (16, 2, 3)]

    def run(bn, nw, ns, sp):
        if nw == 8:
            raise RuntimeError("out of shared memory")
        return torch.full((2,), float(bn))

    checks = iter([False, False, False, True])
    rows = bench.sweep_tiles(tiles, run, lambda bn: bn // 32, lambda fn: float(fn()[0]) / 2, lambda: next(checks),
                             "FP8 fp16 ", ref=torch.full((2,), 32.0))
    assert rows == [dict(block_n=32, num_warps=1, num_stages=2, splits=1, us=16.0, err=0.0),
                    dict(block_n=64, num_warps=4, num_stages=2, splits=2, us=32.0, err=32.0)]
    out = capsys.readouterr().out
    assert "FP8 fp16 tile 128,8,3: failed (RuntimeError)" in out and "(FP8 fp16 sweep budget exhausted)" in out
    assert "err" not in bench.sweep_tiles(tiles[:1], run, lambda bn: 1, lambda fn: 1.0, lambda: False, "")[0]


def test_moe_harness_runs_on_the_cpu_and_checks_every_output(tmp_path):
    """bench_moe's CPU smoke run: the table's record, the bound's bytes, and each system checked against eager."""
    bench_moe = pytest.importorskip("bench_moe")
    bench_moe.main(["--device", "cpu", "--tiny", "--shapes", "gpt-oss", "--rows", "3", "--reps", "1",
                    "--systems", "hf_paged,grouped_mm", "--out", str(tmp_path)])
    import json

    record = json.loads((tmp_path / "moe.json").read_text())["records"][0]
    assert record["shape"] == "gpt-oss" and record["rows"] == 3 and 1 <= record["experts_hit"] <= 3 * 4
    module, top_k = bench_moe.build_experts("gpt-oss", "cpu", torch.float32, tiny=True)
    per_expert = sum(p[0].numel() * 4 for p in module.parameters())
    assert record["bytes"] == record["experts_hit"] * per_expert + 2 * 3 * 64 * 4
    for system in ("hf_paged", "grouped_mm"):
        assert record[system]["us"] > 0 and record[system]["error"] < 1e-4

def test_mla_harness_runs_on_the_cpu_and_checks_its_outputs(tmp_path):
    """bench_mla's CPU smoke run: every system agrees with SDPA, the bytes and the KV budget figures add up."""
    bench_mla = pytest.importorskip("bench_mla")
    bench_mla.main(["--device", "cpu", "--batches", "2", "--contexts", "40", "--reps", "1", "--kv-budget", "1MiB",
                    "--budget-context", "64", "--out", str(tmp_path)])
    import json

    result = json.loads((tmp_path / "mla.json").read_text())
    (record,) = result["records"]
    shape = bench_mla.SHAPES["tiny"]
    assert record["latent_kernel"]["bytes"] == 2 * 40 * (shape["rank"] + shape["rope"]) * 4
    assert record["expanded"]["bytes"] == 2 * 40 * shape["heads"] * (shape["nope"] + shape["rope"] + shape["v"]) * 4
    for system in ("latent", "expanded", "sdpa"):
        assert record[system]["us"] > 0 and record[system]["error"] < 1e-4
    per_token = result["kv_bytes_per_token"]
    assert per_token["latent"] == shape["layers"] * (shape["rank"] + shape["rope"]) * 4
    assert per_token["latent_stored_twice"] == 2 * per_token["latent"]
    assert result["max_running_batch"]["latent"] == 1024**2 // (per_token["latent"] * 64)
    assert (tmp_path / "mla.png").exists() or pytest.importorskip("matplotlib") is None


def test_lora_harness_runs_on_the_cpu_and_reports_the_fraction(tmp_path):
    """bench_lora's CPU smoke run: every request of each adapter count completes, the fraction is of the base run."""
    bench_lora = pytest.importorskip("bench_lora")
    bench_lora.main(["--device", "cpu", "--model", "tiny", "--adapters", "0,2", "--num-requests", "4", "--new-tokens",
                     "3", "--prompt-len", "8", "--kernel-rows", "1,8", "--kernel-shape", "32,48", "--out", str(tmp_path)])
    import json

    data = json.loads((tmp_path / "lora.json").read_text())
    assert [k["rows"] for k in data["kernel"]] == [1, 8] and all(k["torch_us"] > 0 for k in data["kernel"])
    records = data["records"]
    assert [r["adapters"] for r in records] == [0, 2] and records[0]["fraction"] == 1.0
    assert records[1]["loads"] == 2 and all(r["output_tokens"] == 12 for r in records)

def test_structured_harness_runs_on_the_cpu_and_reports_the_fraction(tmp_path):
    """bench_structured's CPU smoke run: every request of both systems comes back full length, the constrained one
    masked on every row of every step, and the fraction is of the unconstrained run."""
    pytest.importorskip("xgrammar")
    bench_structured = pytest.importorskip("bench_structured")
    bench_structured.main(["--device", "cpu", "--model", "tiny", "--num-requests", "3", "--new-tokens", "5",
                           "--prompt-len", "4", "--repeats", "2", "--out", str(tmp_path)])
    import json

    records = json.loads((tmp_path / "structured.json").read_text())["records"]
    assert [r["system"] for r in records] == ["unconstrained", "json_schema"] and records[0]["fraction"] == 1.0
    assert all(r["output_tokens"] == 15 for r in records)
    assert records[0]["masked_rows"] == 0 and records[1]["masked_rows"] == 15
    assert all(len(r["passes_tok_s"]) == 2 for r in records)
    assert records[0]["grammar_main_ms_step"] == 0 and all(r["grammar_workers_ms_step"] == 0 for r in records)


def test_structured_harness_profiles_the_grammar_host_work_per_thread_count(tmp_path):
    """--decode-mode static pipelines the constrained steps on the CPU, --grammar-threads runs one constrained system
    per worker-thread count: the chunks' accepts and fills are counted, done by workers (2) or, with one thread, by the
    engine thread (inside its own time)."""
    pytest.importorskip("xgrammar")
    bench_structured = pytest.importorskip("bench_structured")
    bench_structured.main(["--device", "cpu", "--model", "tiny", "--num-requests", "16", "--new-tokens", "4",
                           "--prompt-len", "4", "--repeats", "1", "--decode-mode", "static", "--grammar-threads",
                           "1,2", "--out", str(tmp_path)])
    import json

    data = json.loads((tmp_path / "structured.json").read_text())
    records = {r["system"]: r for r in data["records"]}
    assert list(records) == ["unconstrained", "json_schema@1", "json_schema@2"]
    assert data["meta"]["grammar_threads"] == [1, 2]
    for name in ("json_schema@1", "json_schema@2"):
        assert records[name]["pipelined_steps"] > 0 and records[name]["masked_rows"] == 64
        assert records[name]["grammar_main_ms_step"] > 0 and records[name]["grammar_workers_ms_step"] > 0
    inline = records["json_schema@1"]
    assert inline["grammar_main_ms_step"] >= inline["grammar_workers_ms_step"]


# ------------------------------------------------------------------------------------------------ command lines

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# modules the scripts import, with no command line of their own (tested above)
HELPER_MODULES = {"gpu_timeline", "roofline"}
# per script: command lines as the GPU runners (run_h100.sh, run_tp.sh, gpu_*.sh) and the write-ups pass them, and
# the values they must give
COMMAND_LINES = {
    "architecture_report": [([], {"check": False}), (["--check"], {"check": True})],
    "bench_attention_features": [(["--out", "o", "--features", "window"],
                                  {"features": "window", "batch": 32, "context": 8192})],
    "bench_beam": [(["--model", "llama-8b", "--beams", "4,6,8", "--systems", "paged_compiled,paged,transformers",
                     "--out", "r"], {"beams": "4,6,8", "num_prompts": 100, "new_tokens": 256, "out": "r"})],
    "bench_decode_kernel": [(["--out", "r", "--sweep"], {"sweep": True, "rep": 200, "shapes": ""}),
                            (["--fp8-sweep", "--shapes", "a,b"], {"fp8_sweep": True, "sweep": False, "shapes": "a,b"}),
                            (["--cuda-graph", "--shapes", "llama8b", "--fp8-read-modes", "cast,fp16,bits,bits_asm,cast_t,fp16_t,bits_t,bits_asm_t"],
                             {"cuda_graph": True, "shapes": "llama8b", "fp8_read_modes": "cast,fp16,bits,bits_asm,cast_t,fp16_t,bits_t,bits_asm_t"}),
                            ([], {"fp8_read_modes": ""})],
    "bench_decode_splits": [(["--out", "r"], {"splits": "1,2,3,4,6,8,12,16,24,32"})],
    "bench_decode_step": [(["--out", "r"], {"model": "llama-1b", "context": 512, "variants": "graph,compiled"})],
    "bench_generate": [(["--model", "llama-1b", "--workload", "sharegpt", "--num-requests", "256", "--systems",
                         "paged,paged_compiled,generate_batch_graphs,dynamic", "--system-timeout", "260",
                         "--no-progress", "--out", "r"],
                        {"num_requests": 256, "system_timeout": 260, "no_progress": True, "temperature": 0.0}),
                       (["--workload", "uniform", "--temperature", "0.6", "--top-p", "0.95"],
                        {"workload": "uniform", "temperature": 0.6, "top_p": 0.95, "experts_implementation": "hf_paged",
                         "kv_cache_dtype": ["auto"]}),
                       (["--model", "olmoe-1b-7b", "--systems", "paged_compiled", "--experts-implementation",
                         "grouped_mm"], {"model": "olmoe-1b-7b", "experts_implementation": "grouped_mm"}),
                       (["--model", "llama-8b", "--workload", "kvbound", "--num-requests", "512", "--systems",
                         "paged_compiled", "--kv-cache-dtype", "auto,fp8", "--max-num-seqs", "512", "--out", "r"],
                        {"workload": "kvbound", "kv_cache_dtype": ["auto", "fp8"], "max_num_seqs": 512})],
    "bench_kv_fp8_accuracy": [(["--dtype", "bfloat16", "--lm-eval-tasks", "local_lambada", "--lm-eval-limit", "400"],
                               {"dtype": "bfloat16", "lm_eval_tasks": "local_lambada", "lm_eval_limit": 400,
                                "new_tokens": 64, "scales": "calibrate,1.0"})],
    "bench_grpo_rollouts": [(["--model", "llama-1b", "--dtype", "bfloat16", "--prompts", "64", "--generations", "8",
                              "--new-tokens", "256", "--steps", "1", "--out", "o"],
                             {"prompts": 64, "generations": 8, "steps": 1, "prompt_len": "64,256"})],
    "bench_host_step": [(["--running", "256", "--steps", "400", "--sampled"],
                         {"running": "256", "steps": 400, "sampled": True, "finishing": False, "grouped": False}),
                        (["--grouped"], {"grouped": True})],
    "bench_lora": [(["--model", "llama-8b", "--adapters", "0,1,2,4,8", "--out", "r"],
                    {"adapters": "0,1,2,4,8", "rank": 16, "num_requests": 256, "lora_kernel": "auto"}),
                   (["--adapters", "0,8", "--lora-kernel", "torch", "--kernel-rows", "1,256"],
                    {"adapters": "0,8", "lora_kernel": "torch", "kernel_rows": "1,256", "kernel_shape": "4096,4096"})],
    "bench_kv_groups": [(["--contexts", "4096", "32768", "--budget-gib", "40"],
                         {"contexts": [4096, 32768], "budget_gib": 40, "layers": 62, "window": 1024}),
                        (["--out", "r"], {"contexts": [4096, 32768, 131072], "budget_gib": 60.0}),
                        (["--family", "gemma4"], {"family": "gemma4", "window": 1024})],
    "bench_lm_eval": [(["--tokenizer", "t", "--requests", "400", "--out", "o"],
                       {"tokenizer": "t", "requests": 400, "batch_size": 64, "kv_cache_dtype": "auto"}),
                      (["--tokenizer", "t", "--kv-cache-dtype", "fp8"], {"kv_cache_dtype": "fp8"})],
    "bench_mla": [([], {"out": "benchmarks/results", "shape": None, "kv_budget": "40GiB", "budget_context": 4096}),
                  (["--device", "cpu", "--shape", "tiny", "--batches", "1,4", "--contexts", "64,256", "--out", "r"],
                   {"device": "cpu", "shape": "tiny", "batches": [1, 4], "contexts": [64, 256], "out": "r"})],
    "bench_moe": [(["--out", "r"], {"shapes": "olmoe,qwen3-moe,gpt-oss,mixtral", "rows": "1,2,4,8,16,32,64,128,256,512",
                                     "tune": False, "tiny": False}),
                  (["--device", "cpu", "--tiny", "--shapes", "gpt-oss", "--rows", "1,3", "--tune"],
                   {"device": "cpu", "tiny": True, "shapes": "gpt-oss", "rows": "1,3", "tune": True})],
    "bench_prefix": [(["--task-len", "4", "8"], {"task_len": [4, 8], "output_len": (8, 32), "device": "cpu"})],
    "bench_sampling": [(["--out", "o", "--greedy-only"], {"greedy_only": True, "quick": False}),
                       (["--out", "o", "--top-k-only"], {"top_k_only": True, "tiny": False}),
                       (["--tiny"], {"tiny": True, "top_k_only": False, "topk_select": None}),
                       (["--out", "o", "--topk-select", "torch,radix"],
                        {"topk_select": ["torch", "radix"], "top_k_only": False, "radix_sweep": False}),
                       (["--topk-select", "radix", "--radix-sweep"], {"topk_select": ["radix"], "radix_sweep": True})],
    "bench_serving": [(["--model", "llama-1b", "--model-dir", "/tmp/m", "--tokenizer", "t", "--systems", "hf_paged",
                        "--append", "--rates", "1,2,4", "--num-requests", "60", "--rate-timeout", "150", "--out", "o"],
                       {"append": True, "rates": "1,2,4", "num_requests": 60, "rate_timeout": 150.0, "trace": False}),
                      (["--systems", "hf_paged,hf_paged_dp2"], {"systems": "hf_paged,hf_paged_dp2"})],
    "bench_sharing": [(["--model", "tiny-32k", "--widths", "2,4"], {"model": "tiny-32k", "widths": "2,4"})],
    "bench_structured": [(["--model", "llama-1b", "--tokenizer", "t", "--out", "r"],
                          {"model": "llama-1b", "tokenizer": "t", "num_requests": 64, "new_tokens": 512,
                           "repeats": 5, "grammar_threads": None, "decode_mode": None}),
                         (["--grammar-threads", "1,8", "--decode-mode", "static"],
                          {"grammar_threads": [1, 8], "decode_mode": "static", "fill_threads": None}),
                         (["--fill-threads", "1,2,4,8"], {"fill_threads": [1, 2, 4, 8], "grammar_threads": None})],
    "bench_startup": [(["--models", "llama-1b", "--modes", "compiled", "--warm-runs", "3"],
                       {"models": "llama-1b", "modes": "compiled", "warm_runs": 3, "bytecode": "primed"})],
    "bench_sweeps": [(["--parts", "kernel"], {"parts": "kernel", "block_sizes": "8,16,32,64,128"})],
    "bench_weight_watch": [(["--step-ms", "2.5"], {"step_ms": 2.5, "peft": False})],
    "plot_summary": [(["--markdown", "--no-plot"], {"markdown": True, "no_plot": True, "dpi": 120})],
    "probe_architectures": [(["llama", "gemma2"], {"model_types": ["llama", "gemma2"], "timeout": 60})],
    "probe_compiled": [(["--jobs", "2", "--dtype", "bfloat16"], {"jobs": 2, "dtype": "bfloat16", "model_types": []})],
    "profile_decode": [([], {"until_running": [0], "steps": 30, "dtype": None}),
                       (["--compile-decode", "--finished-only", "--until-running", "240,64,8", "--steps", "3"],
                        {"until_running": [240, 64, 8], "compile_decode": True, "steps": 3}),
                       (["--workload", "shared_system", "--prefill", "--no-prefix-caching", "--one-table"],
                        {"workload": "shared_system", "prefill": True, "no_prefix_caching": True, "one_table": True})],
}
# values each parser must refuse (exit 2 with a usage message)
BAD_COMMAND_LINES = {
    "bench_generate": [["--workload", "nope"], ["--num-requests", "many"], ["--kv-cache-dtype", "int4"]],
    "bench_decode_kernel": [["--fp8-read-modes", "cast,fp8"]],
    "bench_kv_fp8_accuracy": [["--dtype", "int8"]],
    "bench_mla": [["--shape", "v3"], ["--batches", "0"], ["--contexts", "a,b"]],
    "bench_lm_eval": [[]],  # --tokenizer is required
    "bench_lora": [["--lora-kernel", "cuda"], ["--rank", "r"]],
    "bench_kv_groups": [["--contexts", "a"], ["--budget-gib", "x"]],
    "bench_startup": [["--bytecode", "compiled"]],
    "bench_structured": [["--num-requests", "many"], ["--dtype", "int8"], ["--grammar-threads", "0"],
                         ["--grammar-threads", "a,b"], ["--decode-mode", "cuda"], ["--fill-threads", "0"],
                         ["--fill-threads", "1,x"]],
    "probe_compiled": [["--dtype", "float16"]],
    "profile_decode": [["--until-running", "-1"], ["--until-running", "a,b"], ["--model", "gpt5"]],
}


def _scripts() -> list[str]:
    return sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in HELPER_MODULES)


def test_every_benchmark_script_says_what_it_measures_and_has_its_command_lines_tested():
    import ast

    assert set(COMMAND_LINES) == set(_scripts()), "add the new script's command lines to COMMAND_LINES"
    for name in _scripts():
        tree = ast.parse((BENCHMARKS / f"{name}.py").read_text())
        doc = ast.get_docstring(tree)
        assert doc and len(doc) > 100, f"benchmarks/{name}.py needs a docstring saying what it measures"
        functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert "build_parser" in functions, f"benchmarks/{name}.py: its argparse parser comes from build_parser()"
        assert [a.arg for a in functions["main"].args.args] == ["argv"], f"benchmarks/{name}.py: main(argv=None)"


@pytest.mark.parametrize("name", sorted(COMMAND_LINES))
def test_benchmark_command_lines_parse(name, capsys):
    module = pytest.importorskip(name)
    for argv, expected in COMMAND_LINES[name]:
        args = module.build_parser().parse_args(argv)
        assert {key: getattr(args, key) for key in expected} == expected, (name, argv)
    with pytest.raises(SystemExit) as help_exit:
        module.build_parser().parse_args(["--help"])
    assert help_exit.value.code == 0 and "usage:" in capsys.readouterr().out
    for argv in [["--no-such-option"], *BAD_COMMAND_LINES.get(name, [])]:
        with pytest.raises(SystemExit) as bad:
            module.build_parser().parse_args(argv)
        assert bad.value.code == 2 and "usage:" in capsys.readouterr().err, (name, argv)


def test_serving_benchmark_gives_data_parallel_speedups(tmp_path):
    bench_serving = pytest.importorskip("bench_serving")
    systems = ("hf_paged", "hf_paged_dp2", "hf_paged_x2", "hf_paged_dp1", "hf_paged_thread", "transformers")
    assert [bench_serving.layout(s) for s in systems] == [(1, 1), (1, 2), (2, 1), (1, 1), (1, 1), None]

    def row(rate, p99, tok_s, e2e=500):
        return {"rate": rate, "failed": 0, "ttft_ms": {"p99": p99}, "output_tok_s": tok_s, "e2e_ms": {"p50": e2e}}

    results = {"hf_paged": [row(8, 100, 800), row(12, 300, 900, e2e=1500), row(16, 2000, 1000)],
               "hf_paged_dp2": [row(8, 90, 800), row(16, 300, 1600, e2e=900), row(32, 5000, 1900)],
               "hf_paged_x2": [row(8, 90, 800), row(16, 300, 2000)]}
    summary = bench_serving.write_results(tmp_path / "r.json", results, {})
    # hf_paged answers its first tokens in time at 12/s but no longer keeps pace (median latency 3x): 8 is its rate
    assert summary["hf_paged"]["max_rate_p99_ttft_under_1s"] == 12 and summary["hf_paged"]["sustainable_rate"] == 8
    assert summary["hf_paged_dp2"]["dp_speedup"] == 2.0 and summary["hf_paged_dp2"]["dp_throughput_ratio"] == 1.9
    assert summary["hf_paged_x2"]["dp_throughput_ratio"] == 2.0 and "dp_speedup" not in summary["hf_paged"]


def test_startup_benchmark_refuses_zero_warm_runs_before_measuring(capsys):
    bench_startup = pytest.importorskip("bench_startup")
    with pytest.raises(SystemExit) as bad:
        bench_startup.main(["--warm-runs", "0"])
    assert bad.value.code == 2 and "--warm-runs must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.sh")))
def test_gpu_runner_scripts_parse_and_ask_for_their_output_folder(script):
    """The GPU runners are bash: each must parse, and without its OUT argument stop with its usage line before running
    anything."""
    import subprocess

    path = BENCHMARKS / script
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    run = subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=30, cwd=BENCHMARKS.parent)
    assert run.returncode != 0 and f"usage: {script}" in run.stderr, run.stderr


def test_profile_decode_lists_a_steps_kernels_by_total_time():
    """`profile_decode.kernel_table`: per kernel name, its time and launches per step and its mean, largest first."""
    profile_decode = pytest.importorskip("profile_decode")
    rows = [("gemm", 0.0, 10.0), ("norm", 10.0, 2.0), ("gemm", 12.0, 30.0), ("norm", 42.0, 2.0), ("copy", 44.0, 5.0),
            ("add", 49.0, 4.0)]
    assert profile_decode.kernel_table(rows, 2) == [("gemm", 20.0, 1.0, 20.0), ("copy", 2.5, 0.5, 5.0),
                                                    ("add", 2.0, 0.5, 4.0), ("norm", 2.0, 1.0, 2.0)]  # ties: by name
def test_plot_summary_arguments():
    """The summary plot's command line: defaults point at the committed data and PNG; nonsense is refused."""
    plot_summary = pytest.importorskip("plot_summary")
    args = plot_summary.parse_args([])
    assert args.data == plot_summary.DEFAULT_DATA and args.data.is_file()
    assert args.out == plot_summary.DEFAULT_OUT and args.out.suffix == ".png"
    assert not args.markdown and not args.no_plot and args.dpi > 0
    args = plot_summary.parse_args(["--data", "x.json", "--out", "y.png", "--dpi", "80", "--markdown", "--no-plot"])
    assert (str(args.data), str(args.out), args.dpi, args.markdown, args.no_plot) == ("x.json", "y.png", 80, True, True)
    for bad in (["--dpi", "0"], ["--no-plot"], ["--dpi", "many"]):
        with pytest.raises(SystemExit):
            plot_summary.parse_args(bad)


def test_plot_summary_table(capsys):
    """Ratios come out of the data (throughputs: ours / theirs; latencies: theirs / ours); the table prints without
    matplotlib (`--markdown --no-plot`), and the README and docs/performance.md show exactly that table."""
    plot_summary = pytest.importorskip("plot_summary")
    assert plot_summary.speedup({"hf_paged": 300.0, "transformers": 100.0, "higher_is_better": True}) == 3.0
    assert plot_summary.speedup({"hf_paged": 1.0, "transformers": 2.5, "higher_is_better": False}) == 2.5
    assert plot_summary.speedup({"hf_paged": 1.0, "transformers": None, "higher_is_better": True}) is None
    assert plot_summary.main(["--markdown", "--no-plot"]) == 0
    table = capsys.readouterr().out.strip()
    data = plot_summary.load(plot_summary.DEFAULT_DATA)
    assert table == plot_summary.markdown_table(data) and len(table.splitlines()) == len(data["rows"]) + 2
    root = Path(__file__).resolve().parents[1]
    for doc in ("README.md", "docs/performance.md"):  # the current figures, shown from this data and nowhere else
        assert table in (root / doc).read_text(), f"{doc}'s table is stale: python benchmarks/plot_summary.py --markdown"


def test_plot_summary_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    plot_summary = pytest.importorskip("plot_summary")
    out = plot_summary.plot(plot_summary.load(plot_summary.DEFAULT_DATA), tmp_path / "summary.png", dpi=40)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kv_groups_bench_arguments_and_tiny_run(capsys, tmp_path):
    """bench_kv_groups drives the real block managers: a grouped mixed stack holds less and runs a larger batch."""
    bench_kv_groups = pytest.importorskip("bench_kv_groups")
    with pytest.raises(SystemExit):
        bench_kv_groups.parse_args(["--chunk", "0"])
    rows = bench_kv_groups.main(["--tiny", "--out", str(tmp_path)])
    assert (tmp_path / "kv_groups.json").exists()
    assert "| context |" in capsys.readouterr().out
    for row in rows:
        today, grouped = row["today"], row["grouped"]
        assert grouped["bytes_per_seq"] < today["bytes_per_seq"] and grouped["max_batch"] > today["max_batch"] > 0
        assert grouped["bytes_per_block"] * len(row["groups"]["windows"]) >= today["bytes_per_block"]  # (padding)
    assert rows[-1]["saving"] > 0.6
    rows = bench_kv_groups.main(["--tiny", "--family", "gemma4"])  # layers of two shapes: pages
    assert all(r["grouped"]["bytes_per_seq"] < r["today"]["bytes_per_seq"] for r in rows)
    assert rows[-1]["saving"] > 0.6


def test_sampling_bench_times_the_candidate_selections_on_the_cpu(monkeypatch, capsys):
    """bench_sampling's selection table (`--topk-select`) at a tiny shape, the Triton backend under the interpreter:
    both selections give torch.topk's values and the full kernel's tokens (the table refuses otherwise)."""
    bench_sampling = pytest.importorskip("bench_sampling")
    pytest.importorskip("hf_paged.kernels.triton_topk_sampling")
    if torch.cuda.is_available():
        pytest.skip("the GPU runs the real table")
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    rows = bench_sampling.time_topk_select(["torch", "radix"], [2], {"tiny": (256, 0.8, 8, 0.9)}, [torch.bfloat16],
                                           1e11, device="cpu")
    assert [(r["logits"], r["select"], r["rows"], r["candidates"]) for r in rows] == [
        ("flat", "torch", 2, 40), ("flat", "radix", 2, 40), ("masked", "torch", 2, 40), ("masked", "radix", 2, 40)]
    assert all(r["select_us"] > 0 and r["bound_us"] > 0 and 0 <= r["fallback_rows"] <= 2 for r in rows)
    assert [r["overflow_rows"] for r in rows][::2] == [-1, -1]
    assert "| top-k selection |" in capsys.readouterr().out


def test_sampling_bench_times_the_top_k_fast_path_on_the_cpu(capsys):
    """bench_sampling's top-k table at a tiny shape on the CPU (torch backend): both paths run, give the same tokens
    (the table refuses otherwise) and are reported with the rows that fell back."""
    bench_sampling = pytest.importorskip("bench_sampling")
    rows = bench_sampling.time_top_k([2], {"tiny": (256, 0.8, 8, 0.9)}, "cpu")
    assert [(r["rows"], r["logits"], r["candidates"]) for r in rows] == [(2, "flat", 40), (2, "peaked", 40)]
    assert all(r["kernel_us"] > 0 and r["fast_us"] > 0 and 0 <= r["fallback_rows"] <= 2 for r in rows)
    assert "| top-k fast path |" in capsys.readouterr().out
