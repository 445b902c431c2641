"""What each entry point allocates and when it is freed (issue 13, items 2 and 4, and the shared-engine outputs).

With the cycle collector off, a model used through any entry point and then dropped must be freed by reference
counting, and its KV pool with it: `del model; torch.cuda.empty_cache()` is how notebook users switch models.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import hf_paged
from hf_paged.testing import tiny_model


@pytest.fixture
def no_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _ids():
    return torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]])


def _generate_paged(model):
    hf_paged.enable(model)
    model.generate(_ids(), cache_implementation="paged", max_new_tokens=3, do_sample=False)
    return model._hf_paged_engine.cache.pool


def _drop_in(model):
    hf_paged.enable(model)
    cache = hf_paged.PagedCache(config=model.config)
    model.generate(_ids(), past_key_values=cache, max_new_tokens=3, do_sample=False)
    return cache.pool


def _pipeline(model):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(model.config.vocab_size)}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0", pad_token="w0", eos_token="w2")
    pipe = hf_paged.pipeline("text-generation", model=model, tokenizer=tok)
    pipe("w5 w6 w7 w8", max_new_tokens=3, do_sample=False)
    pool = model._hf_paged_engine.cache.pool
    del pipe
    return pool


def _engine(model):
    engine = hf_paged.Engine(model, kv_cache_memory="4MiB")
    engine.generate([[5, 6, 7, 8]], max_new_tokens=3)
    return engine.cache.pool


@pytest.mark.parametrize("entry", [_generate_paged, _drop_in, _pipeline, _engine],
                         ids=["generate_paged", "drop_in", "pipeline", "engine"])
def test_dropped_model_is_freed_by_reference_counting(no_gc, entry):
    model = tiny_model("llama")
    pool = entry(model)
    model_ref, pool_ref = weakref.ref(model), weakref.ref(pool)
    del model, pool
    assert model_ref() is None, "the model outlived its last reference (a reference cycle)"
    assert pool_ref() is None, "the KV pool outlived the model"


def test_engine_owned_by_a_model_holds_it_weakly(no_gc):
    model = tiny_model("llama")
    _generate_paged(model)
    engine = model._hf_paged_engine
    assert engine.model is model
    del model
    with pytest.raises(ReferenceError, match="freed"):
        engine.model  # noqa: B018
    # a directly built engine keeps its model alive
    model = tiny_model("llama")
    engine = hf_paged.Engine(model, kv_cache_memory="4MiB")
    ref = weakref.ref(model)
    del model
    assert ref() is not None and engine.model is ref()


def test_disable_closes_the_engine_the_model_owns():
    """`hf_paged.disable(model)` gives the pool and the CUDA graphs back at once (before a tensor-parallel script
    destroys its process group), not when the engine's last reference goes."""
    model = tiny_model("llama")
    _generate_paged(model)
    engine = model._hf_paged_engine
    assert not engine.closed and engine.cache.pool is not None
    hf_paged.disable(model)
    assert engine.closed and engine.cache.pool is None and model._hf_paged_engine is None


def test_drop_in_cache_grows_on_demand():
    model = tiny_model("llama")
    hf_paged.enable(model)
    cache = hf_paged.PagedCache(config=model.config)
    assert cache.grow
    ids = torch.randint(3, 300, (3, 20), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, past_key_values=cache, max_new_tokens=60, do_sample=False)
    ref = model.generate(ids, max_new_tokens=60, do_sample=False)
    assert torch.equal(out, ref)
    # 3 rows of 80 tokens = 15 blocks of 16 at least; the pool grew by doubling from what the prompt needed, not
    # to the 512 MiB a fixed CPU pool would take
    assert 15 <= cache.num_blocks <= 64
    fixed = hf_paged.PagedCache(config=model.config, num_blocks=4)
    assert not fixed.grow
    with pytest.raises(hf_paged.CacheFullError):
        model.generate(ids, past_key_values=fixed, max_new_tokens=60, do_sample=False)
    with pytest.raises(TypeError, match="grow"):
        hf_paged.PagedCache(config=model.config, grow="yes")


def test_growing_pool_keeps_beam_forks_and_block_contents():
    model = tiny_model("qwen3")
    hf_paged.enable(model)
    ids = torch.randint(3, 300, (2, 30), generator=torch.Generator().manual_seed(1))
    cache = hf_paged.PagedCache(config=model.config)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=40, num_beams=3, do_sample=False)
    ref = model.generate(ids, max_new_tokens=40, num_beams=3, do_sample=False)
    assert torch.equal(out, ref)


def test_generate_on_a_shared_engine_hands_other_outputs_back():
    model = tiny_model("llama")
    engine = hf_paged.Engine(model, kv_cache_memory="4MiB")
    other = engine.add_request([5, 6, 7], params=hf_paged.SamplingParams(max_new_tokens=2, ignore_eos=True))
    mine = engine.generate([[8, 9, 10]], max_new_tokens=12, ignore_eos=True)
    assert len(mine[0].outputs[0].token_ids) == 12
    assert engine.has_unfinished()  # the other caller's finished output waits for it
    got = [out for out in engine.stream() if out.request_id == other]
    assert got and got[-1].finished and len(got[-1].outputs[0].token_ids) == 2
    assert not engine.has_unfinished()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_two_drop_in_caches_and_a_second_model_fit_side_by_side():
    free_before, total = torch.cuda.mem_get_info()
    model = tiny_model("llama").cuda()
    hf_paged.enable(model)
    ids = torch.randint(3, 300, (4, 64), device="cuda")
    caches = [hf_paged.PagedCache(config=model.config) for _ in range(2)]
    for cache in caches:
        model.generate(ids, past_key_values=cache, max_new_tokens=16, do_sample=False)
    used = free_before - torch.cuda.mem_get_info()[0]
    assert used < 0.05 * total, f"two drop-in caches took {used / 2**30:.2f} GiB"
    second = tiny_model("qwen3").cuda()
    hf_paged.enable(second)
    out = second.generate(ids, past_key_values=hf_paged.PagedCache(config=second.config), max_new_tokens=4,
                          do_sample=False)
    assert out.shape == (4, 68)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_dropped_model_gives_its_gpu_pool_back(no_gc):
    """The H100 symptom of issue 13: after `del model` the engine's pool (most of the GPU) stayed allocated.

    A first model is used and dropped before the count starts: its engine leaves cuBLAS's workspaces (33 MiB a
    stream, kept by torch for the process) for the default stream and for the stream it recorded on. The second
    engine borrows that recording stream (`recording.lend_stream`), so it leaves nothing; with a new stream of its
    own it left another 33 MiB."""
    for _model in range(2):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        model = tiny_model("llama").cuda()
        hf_paged.enable(model)
        model.generate(_ids().cuda(), cache_implementation="paged", max_new_tokens=3, do_sample=False)
        assert model._hf_paged_engine.runner.decode_mode == "graph"  # it recorded
        assert torch.cuda.memory_allocated() - before > 2**20  # the engine's pool is allocated
        del model
        torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 2**20, "the pool (or a stream's workspace) outlived the model"


class _FakeStream:
    def __init__(self, index):
        self.index = index


def test_recording_streams_are_lent_to_one_live_runner_at_a_time(monkeypatch):
    """`recording.lend_stream`: a stream goes back when its runner is dropped (reference counting alone) or gives it
    back, the next runner gets it, and two live runners never share one."""
    from hf_paged.runner import recording

    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(recording, "_FREE_STREAMS", {})
    lent = []  # every finalizer, detached at the end: none may give a fake stream to the real free list later

    def lend(owner, device):
        stream, give_back = recording.lend_stream(owner, device)
        lent.append(give_back)
        return stream, give_back

    class Owner:
        pass

    try:
        device = torch.device("cuda", 3)
        first, second = Owner(), Owner()
        s1, give_back1 = lend(first, device)
        s2, _ = lend(second, device)
        assert s1 is not s2 and s1.index == 3  # both live: two streams
        del first  # dropped without closing: its finalizer gives the stream back
        third = Owner()
        s3, give_back3 = lend(third, device)
        assert s3 is s1 and not give_back1.alive
        give_back3()  # a closing runner gives it back while still referenced
        s4, _ = lend(Owner(), device)
        assert s4 is s1
        other, _ = lend(third, torch.device("cuda", 1))
        assert other.index == 1 and other is not s1  # streams stay on their device
    finally:
        for give_back in lent:
            give_back.detach()


EXIT_SCRIPT = """
import sys
import hf_paged
from hf_paged.testing import tiny_model

class Graph:  # stands in for a captured CUDA graph: under tensor parallelism it pins its NCCL communicator
    def __del__(self):
        print("graph dropped while finalizing:", sys.is_finalizing(), flush=True)

engine = hf_paged.Engine(tiny_model("llama"), num_blocks=8, block_size=16)  # left open: no close() before exit
engine.runner._graphs[1] = Graph()
print("exiting", flush=True)
"""


@pytest.mark.slow
def test_graphs_of_an_engine_left_open_are_dropped_before_the_interpreter_tears_down():
    """An engine still open at exit drops its CUDA graphs in an `atexit` handler, before the interpreter's teardown
    (which frees torch.distributed's process groups; a graph that recorded NCCL collectives blocks that forever)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-2:] == ["exiting", "graph dropped while finalizing: False"]
