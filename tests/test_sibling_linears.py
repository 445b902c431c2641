"""Sibling projections (q/k/v, gate/up) stacked in one buffer and run as one GEMM in the compiled step."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.runner import sibling_linears as sl
from hf_paged.testing import tiny_model

try:
    from tests.helpers import greedy_reference
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import greedy_reference


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles afresh (Dynamo's cache would serve a layer class compiled by an earlier test, and the
    backend that fuses would not run)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _prompts() -> list[list[int]]:
    return [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(20, 60))]


def _reference(model, prompts, n=10):
    return [greedy_reference(model, p, n) for p in prompts]


def test_pack_keeps_parameters_and_values_and_is_idempotent():
    model = tiny_model("qwen2", dtype=torch.float32)  # q/k/v with biases
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    params = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.q_proj.bias, mlp.up_proj.weight]
    before = [p.detach().clone() for p in params]
    assert sl.pack_siblings([model]) == 2 * len(model.model.layers)
    after = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.q_proj.bias, mlp.up_proj.weight]
    assert all(a is p for a, p in zip(after, params))  # the same Parameter objects (optimizers, hooks keep them)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    stacked = sl._stacked([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert stacked is not None and stacked.shape[0] == sum(m.out_features for m in (attn.q_proj, attn.k_proj,
                                                                                     attn.v_proj))
    assert sl._stacked([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]) is not None
    assert sl.pack_siblings([model]) == 0  # packed already


def test_pack_leaves_unlike_or_hooked_siblings_alone():
    model = tiny_model("llama", dtype=torch.float32)
    attn = model.model.layers[0].self_attn
    attn.k_proj.register_forward_hook(lambda *a: None)  # a hooked projection runs its own forward
    mlp = model.model.layers[1].mlp
    mlp.up_proj.weight.data = mlp.up_proj.weight.data.to(torch.float64)  # unlike dtypes
    gate = model.model.layers[0].mlp.gate_proj
    gate.forward = gate.forward  # replaced on the instance (accelerate's hooks do that): someone else's module
    assert sl.pack_siblings([model]) == 2 * len(model.model.layers) - 3
    assert sl._stacked([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) is None
    assert sl._stacked([mlp.gate_proj.weight, mlp.up_proj.weight]) is None


@pytest.mark.parametrize("bias", [False, True])
def test_sibling_linear_op_one_gemm_or_one_per_weight(bias):
    gen = torch.Generator().manual_seed(0)
    linears = [torch.nn.Linear(16, n, bias=bias) for n in (8, 4, 4)]
    x = torch.randn(3, 5, 16, generator=gen)
    expected = torch.cat([lin(x) for lin in linears], dim=-1)
    weights = [lin.weight for lin in linears]
    biases = [lin.bias for lin in linears] if bias else []
    with torch.no_grad():
        apart = torch.ops.hf_paged.sibling_linear(x, weights, biases)  # separate storages: one GEMM each
        sl._pack(weights)
        if bias:
            sl._pack(biases)
        assert sl._stacked(weights) is not None
        stacked = torch.ops.hf_paged.sibling_linear(x, weights, biases)
        linears[1].weight.data = linears[1].weight.data.clone()  # moved: no longer back to back
        assert sl._stacked(weights) is None
        moved = torch.ops.hf_paged.sibling_linear(x, weights, biases)
    for out in (apart, stacked, moved):
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.slow
def test_compiled_step_fuses_siblings_and_keeps_transformers_tokens(family):
    model = tiny_model(family, dtype=torch.float32)
    prompts = _prompts()
    refs = _reference(model, prompts)
    hf_paged.enable(model)
    before = dict(sl.FUSED)
    engine = hf_paged.Engine(model, num_blocks=64, block_size=16, max_num_seqs=4, compile_decode=True)
    assert engine.runner.packed_groups == 2 * len(model.model.layers)
    outs = engine.generate(prompts, max_new_tokens=10)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert sl.FUSED["groups"] - before["groups"] == 2  # q/k/v and gate/up in the one compiled layer graph
    # the layer's last residual add went into down_proj's GEMM; the one after o_proj is read by the norm after it
    assert sl.FUSED["residual_adds"] - before["residual_adds"] == 1
    engine.close()


class _RecordExamples(torch.fx.Interpreter):
    def run_node(self, n):
        n.meta["example_value"] = value = super().run_node(n)
        return value


def test_residual_add_folds_only_into_a_returned_bias_free_linear():
    class Block(torch.nn.Module):
        def __init__(self, bias: bool):
            super().__init__()
            self.o = torch.nn.Linear(16, 16, bias=False)
            self.up = torch.nn.Linear(16, 32, bias=False)
            self.down = torch.nn.Linear(32, 16, bias=bias)

        def forward(self, h):  # functional linears: Dynamo's graphs call them so (a symbolic trace keeps modules)
            F = torch.nn.functional
            h = h + F.linear(h, self.o.weight)  # read by what follows: left to Inductor
            return h + F.linear(F.silu(F.linear(h, self.up.weight)), self.down.weight, self.down.bias)

    torch.manual_seed(0)
    for bias, expected in ((False, 1), (True, 0)):
        block = Block(bias)
        x = torch.randn(1, 5, 16)
        gm = torch.fx.symbolic_trace(block)
        _RecordExamples(gm).run(x)  # Dynamo graphs carry example values; a symbolic trace does not
        assert sl.fold_residual_adds(gm) == expected
        torch.testing.assert_close(gm(x), block(x))
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert (torch.addmm in targets) == bool(expected)


@pytest.mark.slow
def test_weights_moved_after_compilation_are_stacked_again_and_read_anew():
    """`param.data = ...` after the step was compiled with one GEMM per group: the op does not read the old place,
    the engine's weight watch stacks them again, and the tokens follow the new weights."""
    model = tiny_model("llama", dtype=torch.float32)
    prompts = _prompts()
    hf_paged.enable(model)
    engine = hf_paged.Engine(model, num_blocks=64, block_size=16, max_num_seqs=4, compile_decode=True)
    engine.generate(prompts, max_new_tokens=4)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.k_proj.weight.data = attn.k_proj.weight.data * 1.5  # a new storage, elsewhere
    assert sl._stacked([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) is None
    outs = engine.generate(prompts, max_new_tokens=10)
    assert sl._stacked([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) is not None
    engine.close()
    fresh = tiny_model("llama", dtype=torch.float32)
    fresh.load_state_dict(model.state_dict())
    assert [o.outputs[0].token_ids for o in outs] == _reference(fresh, prompts)


def test_checkpoints_after_packing_keep_every_weight(tmp_path):
    """Each packed parameter has a storage of its own: writers that drop tensors sharing a storage as "tied"
    (accelerate's `save_model`, safetensors' `save_model`) keep every one, and transformers' round-trips."""
    from safetensors.torch import load_file, save_model

    model = tiny_model("llama", dtype=torch.float32)
    sl.pack_siblings([model])
    state = model.state_dict()
    model.save_pretrained(tmp_path / "hf")
    loaded = type(model).from_pretrained(tmp_path / "hf")
    for (name, a), (_, b) in zip(state.items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    save_model(model, str(tmp_path / "st.safetensors"))
    written = load_file(str(tmp_path / "st.safetensors"))
    assert written.keys() == state.keys() and all(torch.equal(written[k], v) for k, v in state.items())
    accelerate = pytest.importorskip("accelerate")
    accelerate.Accelerator(cpu=True).save_model(model, str(tmp_path / "acc"))
    written = {}
    for path in sorted((tmp_path / "acc").glob("*.safetensors")):
        written.update(load_file(str(path)))
    assert written.keys() == state.keys()


def test_a_dropped_model_takes_its_buffers_along():
    import gc
    import weakref

    gc.collect()  # earlier tests' models, if any are still in cycles, go first
    model = tiny_model("llama", dtype=torch.float32)
    before = len(sl._STACKS)
    assert sl.pack_siblings([model]) == 2 * len(model.model.layers)
    assert len(sl._STACKS) > before  # one buffer per group's weights, one per group's biases
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None and len(sl._STACKS) == before


def test_fused_graph_stays_cacheable_across_processes():
    """A warm start reuses AOTAutograd's on-disk cache only for graphs it deems safe: the rewritten nodes carry the
    example values its check reads (without them the layer graph was compiled again in every process)."""
    autograd_cache = pytest.importorskip("torch._functorch._aot_autograd.autograd_cache")
    model = tiny_model("qwen3", dtype=torch.float32)
    sl.pack_siblings([model])
    layer = model.model.layers[0]
    seen = []

    def backend(gm, example_inputs):
        seen.append(sl.fuse_sibling_linears(gm, example_inputs))
        autograd_cache.check_cacheable(gm)  # raises BypassAOTAutogradCache when a node is not safe to cache
        return gm.forward

    x = torch.randn(1, 5, model.config.hidden_size)
    position_embeddings = model.model.rotary_emb(x, torch.arange(5)[None])
    with torch.inference_mode():
        out = torch.compile(layer.forward, backend=backend)(x, position_embeddings=position_embeddings,
                                                           attention_mask=None)
        ref = layer(x, position_embeddings=position_embeddings, attention_mask=None)
    assert seen == [2]
    out, ref = (out[0] if isinstance(out, tuple) else out), (ref[0] if isinstance(ref, tuple) else ref)
    torch.testing.assert_close(out, ref)


def test_building_a_compiled_engine_makes_other_engines_of_the_model_record_their_graphs_again():
    """Stacking moves the projections' storage: another runner of the same model (its CUDA graphs recorded with the
    old addresses) drops its graphs; runners of other models keep theirs."""
    model, other = tiny_model("llama", dtype=torch.float32), tiny_model("llama", dtype=torch.float32)
    hf_paged.enable(model)
    hf_paged.enable(other)
    first = hf_paged.Engine(model, num_blocks=64, block_size=16, max_num_seqs=4)
    bystander = hf_paged.Engine(other, num_blocks=64, block_size=16, max_num_seqs=4)
    for engine in (first, bystander):
        engine.runner._graphs[2] = object()  # stands in for a recorded graph (no CUDA here)
    compiled = hf_paged.Engine(model, num_blocks=64, block_size=16, max_num_seqs=4, compile_decode=True)
    assert compiled.runner.packed_groups > 0
    assert 2 not in first.runner._graphs and 2 in bystander.runner._graphs
    for engine in (first, bystander, compiled):
        engine.runner._graphs.clear()
        engine.close()
