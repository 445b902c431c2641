"""The `hf_paged` experts implementation in transformers' `ExpertsInterface` (`hf_paged.attention.experts`).

* Every mixture-of-experts architecture that the sweep passes gives, under `generate(cache_implementation="paged")`
  (greedy, float32, CPU), the tokens of transformers' `eager` experts with hf_paged's experts, and really runs them.
* Each module's spec (layout, fused activation) is read right: gpt-oss's transposed, interleaved, biased clamped
  SwiGLU; a gate function no `Activation` spells and an ungated module run unfused, with the module's own function
  between the grouped GEMMs; a module whose weights the kernels cannot read keeps transformers' implementation.
* `enable`, `Engine(experts_implementation=...)` and `disable` switch and restore the implementation; bad names are
  refused naming the argument.
* The Triton kernels (the interpreter without CUDA) run behind the registered function, and the compiled path
  (opaque custom ops) traces with no graph break.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch import nn  # noqa: E402
from transformers import PretrainedConfig  # noqa: E402
from transformers.integrations.moe import use_experts_implementation  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged import kernels  # noqa: E402
from hf_paged.attention import EXPERTS_NAME, experts  # noqa: E402
from hf_paged.kernels import moe as moe_kernels  # noqa: E402
from hf_paged.kernels.moe import Activation  # noqa: E402
from hf_paged.model_zoo import tiny_inputs, tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton cases: on the GPU, else the interpreter
_SWEEP = json.loads((ROOT / "docs" / "architectures.json").read_text())["architectures"]
MOE_PASSING = [r["model_type"] for r in _SWEEP if "mixture_of_experts" in r["features"] and r["verdict"] == "pass"]
# recurrent hybrids: seconds per generate on the CPU (their recurrent layers, not the experts)
# (the slowest to build and run: `make test-fast` leaves them to the full suite)
SLOW = {"qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "gemma4", "gemma4_text"}
POOL = dict(num_blocks=32, block_size=4)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: worker threads only spin
    yield
    torch.set_num_threads(threads)


def _generate(model, **enable_kwargs):
    input_ids, attention_mask = tiny_inputs()
    hf_paged.enable(model, **POOL, **enable_kwargs)
    try:
        with torch.no_grad():
            return model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=6,
                                  do_sample=False, cache_implementation="paged", pad_token_id=0)
    finally:
        hf_paged.disable(model)


def test_the_sweep_lists_the_moe_families_this_file_checks():
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss", "qwen3_5_moe", "qwen3_next",
            "glm4_moe", "minimax_m2", "ernie4_5_moe", "jamba", "granitemoehybrid", "phimoe"} <= set(MOE_PASSING)


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a in SLOW else a for a in MOE_PASSING])
def test_moe_architecture_gives_the_tokens_of_eager_experts(arch, monkeypatch):
    model = tiny_model(arch)
    before = model.get_experts_implementation()
    modules = experts.experts_modules(model)
    if not modules:  # an MoE whose experts transformers does not dispatch (Aria, Llama 4): left as it is
        hf_paged.enable(model, **POOL)
        assert model.get_experts_implementation() == before
        hf_paged.disable(model)
        return
    reference = _generate(model, experts_implementation="eager")
    assert model.get_experts_implementation() == before  # disable restored it
    calls = []
    for name in ("fused_experts", "experts_down"):
        original = getattr(moe_kernels, name)
        monkeypatch.setattr(moe_kernels, name, lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k))
    hf_paged.enable(model, **POOL)
    assert EXPERTS_NAME in model.get_experts_implementation().values()
    assert all(experts.experts_spec(m) is not None for m in modules)
    hf_paged.disable(model)
    ours = _generate(model)
    assert calls, "the hf_paged experts never ran"
    assert torch.equal(ours, reference), (ours.tolist(), reference.tolist())
    assert model.get_experts_implementation() == before


# ------------------------------------------------------------------------------------------------------ the spec
def test_gpt_oss_spec_is_its_clamped_swiglu_on_transposed_interleaved_weights():
    module = next(iter(experts.experts_modules(tiny_model("gpt_oss"))))
    spec = experts.experts_spec(module)
    assert (spec.gated, spec.transposed, spec.has_bias) == (True, True, True)
    assert spec.activation == Activation("silu", interleaved=True, alpha=module.alpha, gate_limit=module.limit,
                                         up_limit=module.limit, up_shift=1.0)
    w_up, up_bias, w_down, down_bias = spec.weights(module)
    assert w_up.data_ptr() == module.gate_up_proj.data_ptr() and w_up.shape[1:] == module.gate_up_proj.shape[1:][::-1]
    assert up_bias is module.gate_up_proj_bias and down_bias is module.down_proj_bias


class _Config(PretrainedConfig):
    model_type = "hf_paged_test_experts"


def _module(cls, num_experts=4, hidden=32, inter=16, seed=0):
    torch.manual_seed(seed)
    config = _Config()
    config._experts_implementation = "eager"
    module = cls(config, num_experts, hidden, inter)
    for p in module.parameters():
        nn.init.normal_(p, std=0.3)
    return module


def _eager_loop(self, hidden_states, top_k_index, top_k_weights, up, gate):
    out = torch.zeros_like(hidden_states)
    for t in range(hidden_states.shape[0]):
        for k in range(top_k_index.shape[1]):
            e = int(top_k_index[t, k])
            y = nn.functional.linear(gate(nn.functional.linear(hidden_states[t], up[e])), self.down_proj[e])
            out[t] += top_k_weights[t, k] * y
    return out


@use_experts_implementation
class _SigmoidGateExperts(nn.Module):
    """Gated, with a gate function no `Activation` spells (a sigmoid gate with the up half shifted)."""

    def __init__(self, config, num_experts, hidden, inter):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.sigmoid(gate) * (up - 0.25)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return _eager_loop(self, hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self._apply_gate)


@use_experts_implementation(has_gate=False)
class _SquaredReluExperts(nn.Module):
    """Ungated (`up_proj` and an activation), as Nemotron-H's experts."""

    def __init__(self, config, num_experts, hidden, inter):
        super().__init__()
        self.num_experts = num_experts
        self.up_proj = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.act_fn = lambda x: torch.relu(x) ** 2

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return _eager_loop(self, hidden_states, top_k_index, top_k_weights, self.up_proj, self.act_fn)


def _routing(tokens=9, num_experts=4, top_k=2, hidden=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=g)
    weights, index = torch.softmax(logits, dim=-1).topk(top_k)
    return torch.randn(tokens, hidden, generator=g), index, weights


@pytest.mark.parametrize("cls", [_SigmoidGateExperts, _SquaredReluExperts])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not kernels.triton_available(), reason="triton not installed"))])
def test_a_gate_function_no_activation_spells_runs_unfused_between_the_gemms(cls, backend, monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", backend)
    module = _module(cls).to(DEVICE if backend == "triton" else "cpu")
    spec = experts.experts_spec(module)
    assert spec is not None and spec.activation is None and spec.gated == (cls is _SigmoidGateExperts)
    x, index, weights = (t.to(module.down_proj.device) for t in _routing())
    expected = module(x, index, weights)
    torch.testing.assert_close(experts.experts_forward(module, x, index, weights), expected, atol=2e-5, rtol=2e-5)


def test_weights_the_kernels_cannot_read_keep_transformers_implementation(caplog):
    model = tiny_model("olmoe")
    module = experts.experts_modules(model)[0]
    module.num_experts = module.gate_up_proj.shape[0] + 1  # a layout the spec does not recognise
    before = model.get_experts_implementation()
    with caplog.at_level(logging.DEBUG, logger="hf_paged.attention.experts"):
        hf_paged.enable(model, **POOL)
    assert model.get_experts_implementation() == before
    assert "cannot read the weights of OlmoeExperts" in caplog.text
    hf_paged.disable(model)
    assert model.get_experts_implementation() == before
    transposed = _module(_SigmoidGateExperts)
    transposed.down_proj = nn.Parameter(torch.zeros(4, 16, 32))  # (in, out) where (out, in) is declared
    assert experts.experts_spec(transposed) is None
    x, index, weights = _routing()
    called = []
    grouped = experts.grouped_mm_experts_forward
    try:  # called anyway (set by hand), the function hands the module to transformers' grouped_mm experts
        experts.grouped_mm_experts_forward = lambda *args: called.append(args) or args[1]
        assert experts.experts_forward(transposed, x, index, weights) is x and called
    finally:
        experts.grouped_mm_experts_forward = grouped


# ---------------------------------------------------------------------------------------------- the switch
def test_enable_engine_and_disable_switch_and_restore_the_experts():
    model = tiny_model("qwen3_moe")
    original = model.get_experts_implementation()
    assert original == {"": "grouped_mm"}
    hf_paged.enable(model, **POOL)
    assert model.get_experts_implementation() == {"": EXPERTS_NAME}
    hf_paged.disable(model)
    assert model.get_experts_implementation() == original
    engine = hf_paged.Engine(model, experts_implementation="eager", **POOL)
    assert model.get_experts_implementation() == {"": "eager"}
    engine.close()
    hf_paged.disable(model)
    assert model.get_experts_implementation() == original
    engine = hf_paged.Engine(model, experts_implementation=None, **POOL)  # None: as the model has them
    assert model.get_experts_implementation() == original
    engine.close()
    hf_paged.enable(model, experts_implementation="batched_mm", **POOL)  # kept for the engine behind generate()
    assert model._hf_paged_engine_kwargs["experts_implementation"] == "batched_mm"
    assert model.get_experts_implementation() == {"": "batched_mm"}
    hf_paged.disable(model)
    assert model.get_experts_implementation() == original
    with pytest.raises(ValueError, match="experts_implementation"):
        hf_paged.Engine(model, experts_implementation="fastest", **POOL)
    with pytest.raises(TypeError, match="experts_implementation"):
        hf_paged.enable(model, experts_implementation=True)


# ----------------------------------------------------------------------------------------- Triton and compile
@pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")
@pytest.mark.parametrize("arch", ["olmoe", "gpt_oss"])
def test_the_triton_kernels_behind_the_registered_function_match_eager_experts(arch, monkeypatch):
    model = tiny_model(arch).to(DEVICE)
    input_ids = tiny_inputs((5,))[0].to(DEVICE)
    model.set_experts_implementation("eager")
    with torch.no_grad():
        expected = model(input_ids=input_ids, use_cache=False).logits
    experts.select(model, EXPERTS_NAME)
    monkeypatch.setattr(moe_kernels, "get_backend", lambda device: "triton")
    with torch.no_grad():
        logits = model(input_ids=input_ids, use_cache=False).logits
    experts.restore(model)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("unfused", [False, True], ids=["fused-op", "up-gate-down-ops"])
def test_compiled_experts_are_opaque_ops_with_no_graph_break(unfused):
    module = tiny_model("gpt_oss").model.layers[0].mlp.experts
    spec = experts.experts_spec(module)
    if unfused:  # the module's own gate function between the two ops
        module.__dict__["_hf_paged_experts_spec"] = spec._replace(activation=None)
    x, index, weights = _routing(tokens=5, num_experts=module.num_experts, hidden=module.hidden_size)
    expected = module.forward.__wrapped__(module, x, index, weights)  # transformers' eager loop
    torch._dynamo.reset()
    compiled = torch.compile(experts.experts_forward, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(module, x, index, weights), expected, atol=2e-5, rtol=2e-5)
    torch._dynamo.reset()


@pytest.mark.slow
def test_the_compiled_engine_step_runs_the_experts_ops_and_gives_transformers_tokens():
    from torch._dynamo.utils import counters

    try:
        from tests.helpers import greedy_reference, random_prompts
    except ModuleNotFoundError:
        from helpers import greedy_reference, random_prompts
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("gpt_oss")
    prompts = random_prompts((1, 9, 5, 3), seed=3, vocab=256)
    references = [greedy_reference(model, p, 5) for p in prompts]
    engine = hf_paged.Engine(model, block_size=8, max_num_seqs=4, compile_decode=True, num_blocks=64)
    engine.warm_up(freeze_gc=False)
    results = engine.generate(prompts, [hf_paged.SamplingParams(max_new_tokens=5)] * len(prompts))
    assert [r.outputs[0].token_ids for r in results] == references
    assert engine.runner.graph_steps > 0 and not counters["graph_break"]
    assert model.get_experts_implementation() == {"": EXPERTS_NAME}
    engine.close()
    torch._dynamo.reset()
