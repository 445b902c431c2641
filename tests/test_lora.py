"""LoRA adapters per request (`hf_paged.engine.lora`, `hf_paged.runner.lora`, `hf_paged.kernels.lora`).

A tiny seeded llama and three random PEFT adapters of different ranks and target modules (saved with
`save_pretrained`); every adapter's greedy tokens through the engine equal those of PEFT's merged model under
transformers' `generate()` (float32), also when requests of several adapters and of none share every step, on the
static decode path, with fewer slots than adapters (eviction, waiting admissions) and through the prefix cache.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import hf_paged
from hf_paged.kernels import lora as lora_kernels
from hf_paged.kernels import reference_lora
from hf_paged.testing import tiny_model

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.xdist_group("lora")

ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "b": dict(r=8, lora_alpha=16, target_modules=["k_proj", "o_proj", "up_proj"], use_rslora=True),
    "c": dict(r=2, lora_alpha=4, target_modules=["gate_proj", "down_proj", "q_proj"]),
}
PROMPTS = [[1, 5, 9, 13, 2, 7, 3, 11, 4, 6], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
NEW = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(base model, adapter directory, {(adapter or None, prompt): reference tokens})."""
    base = tiny_model("llama", seed=0)
    root = tmp_path_factory.mktemp("lora")
    models = {None: base}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        peft_model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **kwargs))
        peft_model.save_pretrained(root / name)
        models[name] = peft_model.merge_and_unload()
    want = {}
    for name, model in models.items():
        for prompt in PROMPTS:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            want[name, tuple(prompt)] = out[0, len(prompt):].tolist()
    return base, root, want


def engine_with(setup, names=tuple(ADAPTERS), **kwargs) -> hf_paged.Engine:
    base, root, _ = setup
    kwargs = {"max_loras": 3, "max_lora_rank": 8, "block_size": 8, "num_blocks": 64, **kwargs}
    engine = hf_paged.Engine(base, **kwargs)
    for name in names:
        engine.add_lora(name, str(root / name))
    return engine


def params(name) -> hf_paged.SamplingParams:
    return hf_paged.SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, lora=name)


def run_mixed(engine, want, names) -> None:
    requests = [(name, prompt) for prompt in PROMPTS for name in names]
    outs = engine.generate([p for _, p in requests], [params(n) for n, _ in requests])
    for (name, prompt), out in zip(requests, outs):
        assert out.outputs[0].token_ids == want[name, tuple(prompt)], (name, prompt)


@pytest.mark.parametrize("decode_mode", ["eager", "static"])
def test_mixed_adapters_in_one_step_equal_peft_merged(setup, decode_mode):
    """Requests of adapters a, b, c and none, all in the same steps: each gets its merged model's greedy tokens."""
    engine = engine_with(setup)
    engine.runner.decode_mode = decode_mode
    run_mixed(engine, setup[2], [None, "a", "b", "c"])
    assert engine.stats["max_running"] == 2 * 4  # every request ran in the same steps
    assert (engine.runner.graph_steps > 0) == (decode_mode == "static")  # the static buffers' path ran
    assert engine.lora_names() == ["a", "b", "c"]
    engine.close()
    assert not any(isinstance(m, hf_paged.runner.lora.LoraLinear) for m in setup[0].modules())  # model given back


def test_fewer_slots_than_adapters_evicts_and_waits(setup):
    """max_loras=1: requests of three adapters (and none) wait for the slot in turn, adapters are evicted and
    loaded again, and every request still gets its own tokens."""
    engine = engine_with(setup, max_loras=1)
    run_mixed(engine, setup[2], ["a", None, "b", "c"])
    assert engine.lora.loads >= 3
    run_mixed(engine, setup[2], ["c", "a"])  # resident adapter reused, then evicted
    engine.close()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_keep_their_adapter(setup, mode):
    """A pool too small for the batch: requests of three adapters and none are preempted (recomputed, or swapped out
    and back) and still get their own tokens."""
    if os.environ.get("HF_PAGED_BACKEND") == "triton":
        pytest.skip("blocks of 4 tokens (growth past the prompts' blocks) are below the Triton kernels' 8")
    engine = engine_with(setup, max_loras=2, block_size=4, num_blocks=12, preemption_mode=mode,
                         swap_space=0.01 if mode == "swap" else 0)
    run_mixed(engine, setup[2], ["a", None, "b", "c"])
    assert sum(engine.scheduler.num_preemptions.values()) > 0
    engine.close()


def test_beam_search_through_an_adapter(setup):
    """Beams of an adapter's request fork within its group: transformers' beams on PEFT's merged model."""
    base, root, _ = setup
    merged = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(root / "b")).merge_and_unload()
    engine = engine_with(setup, names=["b"])  # (after the copy: the engine wraps the model's linears)
    prompt = PROMPTS[1]
    want = merged.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, num_beams=3,
                           num_return_sequences=2, do_sample=False)
    out = engine.generate([prompt], hf_paged.SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, num_beams=3,
                                                            num_return_sequences=2, lora="b"))[0]
    assert [c.token_ids for c in out.outputs] == [row[len(prompt):].tolist() for row in want]
    engine.close()


@pytest.mark.slow
def test_compiled_decode_step_with_adapters(setup):
    """The compiled decode step (the GPU's default) traces the wrapped linears and the LoRA op: same tokens."""
    engine = engine_with(setup, names=["a", "c"], compile_decode=True)
    run_mixed(engine, setup[2], [None, "a", "c"])
    assert engine.runner.compile_decode and engine.runner.graph_steps > 0
    engine.close()


def test_prefix_cache_keys_include_the_adapter(setup):
    """The same prompt through another adapter (or none) computes its own K/V; through the same adapter it hits."""
    engine = engine_with(setup, names=["a", "b"])
    prompt, want = PROMPTS[1], setup[2]
    for name, hit in ((None, False), ("a", False), ("b", False), ("a", True), (None, True)):
        before = engine.prefix_cache_stats().hit_tokens
        out = engine.generate([prompt], params(name))[0]
        assert out.outputs[0].token_ids == want[name, tuple(prompt)], name
        assert (engine.prefix_cache_stats().hit_tokens > before) == hit, name
    engine.close()


def test_bad_input_names_the_argument(setup, tmp_path):
    base, root, _ = setup
    engine = engine_with(setup, names=["a"], max_lora_rank=4)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'zz'"):
        engine.add_request([1, 2, 3], lora="zz")
    with pytest.raises(TypeError, match="lora"):
        hf_paged.SamplingParams(lora=3)
    with pytest.raises(ValueError, match="max_lora_rank=4"):
        engine.add_lora("b", str(root / "b"))  # rank 8
    with pytest.raises(ValueError, match="already loaded"):
        engine.add_lora("a", str(root / "a"))
    with pytest.raises(ValueError, match="path"):
        engine.add_lora("x", str(tmp_path / "missing"))
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        engine.add_lora("x", str(tmp_path / "dora"))
    with pytest.raises(ValueError, match="max_loras"):
        hf_paged.Engine(base, max_loras=0, num_blocks=8)
    rid = engine.add_request([1, 2, 3], lora="a", max_new_tokens=2)
    with pytest.raises(ValueError, match="unfinished requests"):
        engine.remove_lora("a")
    engine.abort(rid)
    list(engine.stream())
    first = engine.lora.resolve("a")
    engine.remove_lora("a")
    engine.add_lora("a", str(root / "a"))
    assert engine.lora.resolve("a") != first  # a new id: blocks of the old one are never served for it
    engine.close()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_lora_kernel_matches_reference(monkeypatch, backend):
    """The dispatcher on each backend (Triton under its interpreter on the CPU) against a token-by-token float64 sum:
    padded ranks, tokens without an adapter, out-of-range slots, odd widths, several token tiles of mixed slots."""
    monkeypatch.setenv("HF_PAGED_BACKEND", backend)
    generator = torch.Generator().manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (the CPU runs Triton under its interpreter)
    cases = ((5, 24, 40, 3, 8, torch.float32), (3, 70, 33, 2, 5, torch.float32), (70, 40, 24, 4, 16, torch.float32),
             (70, 40, 24, 4, 16, torch.bfloat16), (5, 300, 24, 3, 8, torch.float32))
    triton_lora = pytest.importorskip("hf_paged.kernels.triton_lora") if backend == "triton" else None
    for tokens, width, out, slots, rank, dtype in cases:
        x = torch.randn(tokens, width, generator=generator).to(device, dtype)
        a = (torch.randn(slots, rank, width, generator=generator) / width ** 0.5).to(device, dtype)
        b = torch.randn(slots, out, rank, generator=generator).to(device, dtype)
        index = torch.randint(-1, slots + 1, (tokens,), generator=generator, dtype=torch.int32).to(device)
        want = reference_lora.naive_lora_delta(x, a, b, index)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        # the Triton shrink's runs of input columns (split-K, chosen per GPU): one, and several of uneven widths
        for splits in (None, 3) if backend == "triton" else (None,):
            got = lora_kernels.lora_delta(x, a, b, index) if splits is None else \
                triton_lora.lora_delta(x, a, b, index, splits=splits)
            assert got.dtype == dtype and got.shape == (tokens, out)
            assert (got.double() - want).abs().max() <= tol * want.abs().max() + 1e-5, (tokens, dtype, splits)
    with pytest.raises(ValueError, match="index"):
        lora_kernels.lora_delta(x, a, b, index[:1])
    with pytest.raises(TypeError, match="index"):
        lora_kernels.lora_delta(x, a, b, index.float())
