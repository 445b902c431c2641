"""`compile_decode=True`: the decode step compiled by Dynamo + Inductor (CPU backend here), attention one hf_paged op.

What must hold: transformers' modeling code is traced without a graph break (a break would put most kernels back
outside the fusion), each kind of decoder layer compiled once for all its layers (regional compilation), greedy and beam outputs stay those of transformers, and preemption, forks, parallel
samples and prefix hits give the same tokens as the uncompiled static decode path. Compiling a tiny model takes
several seconds on the CPU, so the checks share engines.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache

import hf_paged
from hf_paged import model_zoo as zoo
from hf_paged.runner import sibling_linears
from hf_paged.runner.regional import CompiledLayers, layer_kind, regional_layers, repeated_layers
from hf_paged.testing import FAMILIES, tiny_model

try:
    from tests.helpers import greedy_reference, random_prompts
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import greedy_reference, random_prompts

LENGTHS = (1, 39, 7, 22, 3, 31, 12, 5, 17, 26)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_compiled_decode_is_one_graph_and_matches_transformers(family):
    model = tiny_model(family, seed=1)
    prompts = random_prompts(LENGTHS, seed=3)
    new = [4 + (7 * i) % 11 for i in range(len(prompts))]  # requests finish at different steps: several buckets
    references = [greedy_reference(model, p, n) for p, n in zip(prompts, new)]
    engine = hf_paged.Engine(model, block_size=8, max_num_seqs=8, compile_decode=True)
    assert engine.runner.decode_mode == "static"  # CPU: the compiled step runs on the static buffers, no graphs
    assert 1 not in engine.runner._bucket_sizes  # a batch of 1 would be specialised: one more compilation
    fused_before = sibling_linears.FUSED["groups"]
    engine.warm_up(freeze_gc=False)
    # q/k/v and gate/up stacked (families with separate projections) are one GEMM each in the compiled layers
    assert (sibling_linears.FUSED["groups"] > fused_before) == (engine.runner.packed_groups > 0)
    results = engine.generate(prompts, [hf_paged.SamplingParams(max_new_tokens=n) for n in new])
    assert [r.outputs[0].token_ids for r in results] == references
    assert engine.runner.graph_steps > 0
    assert not counters["graph_break"], dict(counters["graph_break"])
    # regional compilation: per kind of layer, the first layer and the next one (layer_idx symbolic); the final norm
    # and rotary table once each; the batch symbolic from the start: never one graph per layer or per bucket
    compiled = engine.runner._compiled
    assert isinstance(compiled, CompiledLayers)
    assert counters["stats"]["unique_graphs"] <= compiled.max_graphs
    # the two requests admitted after the first decode step were prefilled by the same compiled layers
    assert engine.runner.compiled_prefill_steps > 1  # the warm-up's dummy step is one
    engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gptj", "bloom", "diffllama"])
def test_compiled_decode_of_adapted_families_is_one_graph_and_matches_transformers(family):
    """Families whose attention an adapter routes (`hf_paged.attention.adapters`): the adapter's code is traced with
    the rest of the layer, no graph break; BLOOM's ALiBi slopes reach the fused op; DiffLlama's paired query too."""
    model = zoo.tiny_model(family, seed=1)
    prompts = random_prompts((1, 19, 7, 12, 3), seed=3, vocab=zoo.VOCAB)
    new = [4, 6, 3, 5, 7]
    references = [greedy_reference(model, p, n, pad_token_id=zoo.PAD_ID, eos_token_id=None)
                  for p, n in zip(prompts, new)]
    engine = hf_paged.Engine(model, block_size=8, max_num_seqs=8, compile_decode=True)
    engine.warm_up(freeze_gc=False)
    results = engine.generate(prompts, [hf_paged.SamplingParams(max_new_tokens=n, ignore_eos=True) for n in new])
    assert [r.outputs[0].token_ids for r in results] == references
    assert engine.runner.graph_steps > 0 and isinstance(engine.runner._compiled, CompiledLayers)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= engine.runner._compiled.max_graphs
    engine.close()


@pytest.mark.slow
@pytest.mark.inductor  # (Inductor's generated code, not only the capture)
def test_regional_compilation_compiles_the_layer_code_once_for_every_layer():
    """Six layers cost the compilations of two: the layer code is shared, `layer_idx` and the batch symbolic."""
    model = tiny_model("llama", seed=1, num_hidden_layers=6)
    prompts = random_prompts(LENGTHS, seed=4)
    new = [3 + (5 * i) % 7 for i in range(len(prompts))]
    references = [greedy_reference(model, p, n) for p, n in zip(prompts, new)]
    engine = hf_paged.Engine(model, block_size=8, max_num_seqs=8, compile_decode=True)
    engine.warm_up(freeze_gc=False)
    results = engine.generate(prompts, [hf_paged.SamplingParams(max_new_tokens=n) for n in new])
    assert [r.outputs[0].token_ids for r in results] == references
    assert isinstance(engine.runner._compiled, CompiledLayers) and len(engine.runner._compiled.layers) == 6
    # the layer code once (layer_idx symbolic from the start, where torch has `dynamic_sources`; else twice: first
    # constant, then symbolic), the final norm and the rotary table once each
    layer_graphs = 1 if "dynamic_sources" in torch.compiler.config.get_config_copy() else 2
    assert len(engine.runner._compiled.extras) == 2 and counters["stats"]["unique_graphs"] == layer_graphs + 2
    # the layers run their own code again outside the decode step (prefill, other threads)
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)
    engine.close()


@pytest.mark.parametrize("family, config", [("llama", {}), ("mistral", {"sliding_window": 12})])
@pytest.mark.slow
def test_prefill_steps_run_the_compiled_layers_and_compile_nothing_more(family, config):
    """Prefill chunks, alone and beside decodes, run the decode step's compiled layers (the token dimension is the
    compiled batch dimension, the op picks the prefill kernel): transformers' tokens, no further graph, and the
    layers back on their own code afterwards. A sliding window shorter than the prompts reaches the prefill kernel."""
    model = tiny_model(family, seed=3, num_hidden_layers=3, **config)
    prompts = random_prompts((45, 9, 30, 17, 38, 4, 26, 12), seed=6)
    new = [6 + (5 * i) % 9 for i in range(len(prompts))]
    references = [greedy_reference(model, p, n) for p, n in zip(prompts, new)]
    # three running at a time and a 24-token budget: later prompts are prefilled in chunks beside running decodes
    engine = hf_paged.Engine(model, block_size=8, max_num_seqs=3, max_num_batched_tokens=24, compile_decode=True)
    engine.warm_up(freeze_gc=False)
    graphs, routed = counters["stats"]["unique_graphs"], engine.runner.compiled_prefill_steps
    assert routed == 1 and engine.runner.compile_prefill  # the warm-up's dummy step, after the layers compiled
    results = engine.generate(prompts, [hf_paged.SamplingParams(max_new_tokens=n) for n in new])
    assert [r.outputs[0].token_ids for r in results] == references
    assert engine.runner.compiled_prefill_steps - routed >= len(prompts) - 3  # every later admission, in chunks
    assert counters["stats"]["unique_graphs"] == graphs and engine.runner.compile_prefill
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)
    engine.close()


@pytest.mark.slow
def test_prefill_that_would_keep_compiling_stays_on_the_models_code():
    """If the first routed prefill step compiles more graphs than a decode step may, prefill steps run the model's
    own code from then on (the step itself already ran right)."""
    model = tiny_model("llama", seed=1)
    prompts = random_prompts((21, 7, 15), seed=7)
    references = [greedy_reference(model, p, 4) for p in prompts]
    engine = hf_paged.Engine(model, block_size=8, max_num_seqs=2, compile_decode=True)
    engine.generate(prompts[:1], max_new_tokens=2)  # compiles the layers (no warm-up: the check is still due)
    engine.runner._compiled.max_graphs = -1  # any count is then too many
    results = engine.generate(prompts, max_new_tokens=4)
    assert [r.outputs[0].token_ids for r in results] == references
    assert not engine.runner.compile_prefill and engine.runner.compiled_prefill_steps == 1
    engine.close()


def test_the_text_decoders_layers_are_the_ones_compiled():
    """A longer list of attention layers outside the text decoder (a vision tower, say) is not the one picked."""
    model = tiny_model("llama", seed=1)
    assert repeated_layers(model) == list(model.model.layers)
    tower = torch.nn.ModuleList(tiny_model("llama", seed=2, num_hidden_layers=5).model.layers)
    model.add_module("vision_tower", tower)
    assert len(tower) > len(model.model.layers) and repeated_layers(model) == list(model.model.layers)
    assert regional_layers(model) == list(model.model.layers)


def _compiled_engine_matching_transformers(model) -> hf_paged.Engine:
    """A warmed-up `compile_decode` engine on `model` whose greedy tokens were checked against transformers'."""
    prompts = random_prompts(LENGTHS[:6], seed=5)
    references = [greedy_reference(model, p, 5) for p in prompts]
    engine = hf_paged.Engine(model, block_size=8, max_num_seqs=8, compile_decode=True)
    engine.warm_up(freeze_gc=False)
    assert [r.outputs[0].token_ids for r in engine.generate(prompts, max_new_tokens=5)] == references
    return engine


@pytest.mark.slow
def test_each_engine_compiles_into_a_dynamo_cache_of_its_own():
    """Dynamo keeps a compiled function's cache, and its recompile limit, on the code object: every engine compiled
    transformers' layer code, so from the ninth model shape in a process (the limit's 8) an engine's layers ran
    eagerly. Each engine now compiles a copy (`regional.own_code`): with the limit at one entry, a second model
    shape still compiles its layers, and a model whose whole forward is compiled does too."""
    with torch._dynamo.config.patch(recompile_limit=1):
        for regional, model in ((True, tiny_model("llama", seed=1)), (True, tiny_model("llama", seed=2, hidden_size=48)),
                                (False, tiny_model("gpt2", seed=1, n_layer=3)),
                                (False, tiny_model("gpt2", seed=2, n_layer=3, n_embd=48))):
            before = counters["stats"]["unique_graphs"]
            engine = _compiled_engine_matching_transformers(model)
            assert counters["stats"]["unique_graphs"] > before  # it compiled (past the limit: no new graph)
            assert isinstance(engine.runner._compiled, CompiledLayers) == regional
            engine.close()


def test_compiled_entries_are_copies_named_per_module_class():
    """Each entry `CompiledLayers` compiles is a code object of its own (its own Dynamo cache), named after its module
    class: Dynamo's automatic-dynamic size record is kept per (file, line, name), so entries of two classes under one
    name would make each other's sizes symbolic, and one class's entries in two engines share it as before."""
    from torch._dynamo.pgo import CodeId

    from hf_paged.runner.regional import _forward_entry

    model = tiny_model("llama", seed=1)
    layer, norm = type(model.model.layers[0]), type(model.model.norm)
    first, second, other = _forward_entry(layer), _forward_entry(layer), _forward_entry(norm)
    assert first.__code__ is not second.__code__
    assert CodeId.make(first.__code__) == CodeId.make(second.__code__) != CodeId.make(other.__code__)
    hidden = torch.randn(1, 2, model.config.hidden_size)
    assert torch.equal(other(model.model.norm, hidden), model.model.norm(hidden))


@pytest.mark.slow
def test_layers_that_differ_per_layer_compile_the_whole_forward():
    """GPT-2 with `scale_attn_by_inverse_layer_idx`: every layer has its own scaling constant, so regional compilation
    would compile one graph per layer; the whole decode forward is compiled instead (one graph)."""
    model = tiny_model("gpt2", seed=1, n_layer=4)
    assert len({layer_kind(layer) for layer in model.transformer.h}) == 4
    engine = _compiled_engine_matching_transformers(model)
    assert not isinstance(engine.runner._compiled, CompiledLayers)
    assert counters["stats"]["unique_graphs"] == 1
    engine.close()


@pytest.mark.slow
def test_layers_recompiling_unexpectedly_fall_back_to_the_whole_forward(monkeypatch):
    """When the layers differ in a way `layer_kind` misses (here: it is told they are all alike), the first decode
    forward compiles more graphs than the kinds allow, and the runner switches to compiling the whole forward."""
    from hf_paged.runner import regional

    monkeypatch.setattr(regional, "layer_kind", lambda layer: ())
    engine = _compiled_engine_matching_transformers(tiny_model("gpt2", seed=1, n_layer=4))
    assert not isinstance(engine.runner._compiled, CompiledLayers)
    engine.close()


def test_compiled_layers_route_only_the_owning_thread():
    """While one thread's decode step runs the compiled layers, another thread calling the same layers (an eager
    prefill of a second engine on the same model) runs the model's own code: nothing compiles for it."""
    model = tiny_model("llama", seed=1)
    compiled = CompiledLayers(list(model.model.layers))
    hidden = torch.randn(1, 3, model.config.hidden_size)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(3)[None])
    layer = model.model.layers[0]
    seen = []
    with compiled.active(3):
        assert layer._compiled_call_impl is not None
        worker = threading.Thread(target=lambda: seen.append(layer(hidden, position_embeddings=(cos, sin))))
        worker.start()
        worker.join()
    assert counters["stats"]["unique_graphs"] == 0 and len(seen) == 1
    assert layer._compiled_call_impl is None


@pytest.mark.slow
@pytest.mark.inductor  # (Inductor's generated code, not only the capture)
def test_compiled_decode_equals_static_path_under_preemption_forks_and_prefix_hits():
    model = tiny_model("llama", seed=2)
    prompts = random_prompts((30, 9, 25, 14, 33, 6, 21, 18), seed=5)
    shared = prompts[0][:24]
    requests = []
    for i, p in enumerate(prompts):
        if i % 4 == 1:
            requests.append((shared + p[:5], dict(max_new_tokens=10, num_beams=3, num_return_sequences=2)))
        elif i % 4 == 2:
            requests.append((shared + p[:3], dict(max_new_tokens=9, do_sample=True, num_return_sequences=2, seed=i)))
        else:
            requests.append((p, dict(max_new_tokens=14)))
    results = []
    for compiled in (False, True):
        engine = hf_paged.Engine(model, block_size=8, num_blocks=16, max_num_seqs=8, compile_decode=compiled)
        engine.runner.decode_mode = "static"
        outs = engine.generate([p for p, _ in requests], [hf_paged.SamplingParams(**kw) for _, kw in requests])
        results.append([[o.token_ids for o in r.outputs] for r in outs])
        assert sum(engine.scheduler.num_preemptions.values()) > 0
        assert engine.prefix_cache_stats().hit_tokens > 0
        assert engine.kv_stats().used_blocks == 0
        engine.close()
    assert results[0] == results[1]
    # beams of the compiled engine are still transformers' beams
    model_beams = [model.generate(torch.tensor([p]), max_new_tokens=10, num_beams=3, num_return_sequences=2,
                                  do_sample=False)[:, len(p):].tolist() for p, kw in requests if kw.get("num_beams")]
    assert [r for r, (_, kw) in zip(results[1], requests) if kw.get("num_beams")] == model_beams


@pytest.mark.slow
def test_a_dropped_engine_is_freed_without_the_cycle_collector():
    """warm_up() freezes the objects alive into the collector's permanent generation; an engine in a reference cycle
    would then keep its KV pool forever. Reference counting alone must free it."""
    model = tiny_model("llama", seed=1)
    engine = hf_paged.Engine(model, block_size=8, num_blocks=32, max_num_seqs=4, compile_decode=True)
    assert engine.warm_up_seconds == {}
    engine.warm_up()
    # where the start-up went: buckets 2 and 4 (a compiled step starts at 2), the first one holding the compilation
    phases = engine.warm_up_seconds
    assert phases["decode_buckets"] == 2 and phases["first_decode_bucket"] > phases["other_decode_buckets"] > 0
    # on the CPU nothing is compiled in threads: the prefill forwards run for real
    assert phases["kernel_jit"] >= 0 and phases["prefill"] > 0 and phases["sampler"] >= 0
    engine.generate(random_prompts((5, 9), seed=1), max_new_tokens=3)
    engine.generate(random_prompts((6,), seed=2), max_new_tokens=3, num_beams=2)
    engine_ref, cache_ref = weakref.ref(engine), weakref.ref(engine.cache)
    engine.close()
    gc.disable()
    try:
        del engine
        assert engine_ref() is None and cache_ref() is None
    finally:
        gc.enable()
        gc.unfreeze()


@pytest.mark.slow
def test_a_dropped_model_is_freed_after_a_compiled_engine():
    """The regionally compiled layers hold no reference cycle: `warm_up()` freezes what is alive (`gc.freeze()`), and
    a cycle through the compiled layers would then keep a dropped model's weights for good."""

    def run():
        model = tiny_model("llama", seed=1, num_hidden_layers=3)
        engine = hf_paged.Engine(model, block_size=8, num_blocks=32, max_num_seqs=4, compile_decode=True)
        engine.warm_up()
        engine.generate(random_prompts((5, 9), seed=1), max_new_tokens=3)
        assert isinstance(engine.runner._compiled, CompiledLayers)
        engine.close()
        return weakref.ref(model.model.layers[0].mlp.down_proj.weight), weakref.ref(model.model.norm.weight)

    try:
        layer_weight, norm_weight = run()
        gc.collect()
        assert layer_weight() is None and norm_weight() is None
    finally:
        gc.unfreeze()


def test_an_unknown_compile_backend_is_refused(monkeypatch):
    from hf_paged.runner import sibling_linears

    monkeypatch.setattr(sibling_linears, "COMPILE_BACKEND", "tvm")
    graph = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="HF_PAGED_COMPILE_BACKEND"):
        sibling_linears.fusing_backend(graph, [torch.randn(1, 2)])


def test_compile_decode_arguments():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="compile_decode"):
        hf_paged.Engine(model, num_blocks=8, compile_decode="yes")


def test_the_fused_op_outside_a_compiled_step_says_so():
    q = torch.zeros(2, 4, 16)
    kv = torch.zeros(2, 2, 16)
    with pytest.raises(RuntimeError, match="no active cache"):
        torch.ops.hf_paged.write_and_decode(q, kv, kv, 0, 0.25)


@pytest.mark.slow
def test_two_compiled_engines_stepping_in_two_threads_keep_their_own_caches():
    """The fused op finds its pool through the active cache; engines in two threads must not read each other's."""
    import threading

    model = tiny_model("llama", seed=1)
    prompt_sets = [random_prompts((9, 4, 13), seed=11), random_prompts((6, 15, 2, 8), seed=12)]
    references = [[greedy_reference(model, p, 10) for p in prompts] for prompts in prompt_sets]
    engines = [hf_paged.Engine(model, block_size=8, max_num_seqs=4, compile_decode=True) for _ in prompt_sets]
    results: list = [None, None]

    def serve(i: int) -> None:
        outs = engines[i].generate(prompt_sets[i], max_new_tokens=10)
        errors = [(r.outputs[0].finish_reason, repr(r.error)) for r in outs if r.error is not None]
        results[i] = errors or [r.outputs[0].token_ids for r in outs]  # a failed step shows its error here

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert results == references
    for engine in engines:
        engine.close()


def test_eager_forward_ignores_another_threads_compilation(monkeypatch):
    """While any thread compiles, torch sets a process-wide `is_compiling()` flag. A compile_decode cache must decide
    "inside our traced step" with `is_dynamo_compiling()` (true only in the trace), or an eager forward in another
    thread skips its K/V write and reads another engine's step (seen as a flaky two-engine failure)."""
    model = tiny_model("llama", seed=3)
    ids = torch.randint(3, 300, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dynamic = DynamicCache(config=model.config)
        model(input_ids=ids[:, :9], past_key_values=dynamic, use_cache=True)
        ref = model(input_ids=ids[:, 9:], past_key_values=dynamic, use_cache=True).logits
    hf_paged.enable(model)
    cache = hf_paged.PagedCache(config=model.config, num_blocks=8, block_size=4)
    cache._defer_write = True  # as an engine with compile_decode sets it
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True, raising=False)  # another thread compiling
    with torch.no_grad():
        model(input_ids=ids[:, :9], past_key_values=cache, use_cache=True)  # prefill: its K/V must be written
        got = model(input_ids=ids[:, 9:], past_key_values=cache, use_cache=True).logits
    monkeypatch.undo()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
