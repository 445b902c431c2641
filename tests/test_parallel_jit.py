"""`kernels.parallel_jit`: a warm-up's Triton kernels compiled in threads, without running them (GPU checks skip
without CUDA; the CPU check is that nothing changes there)."""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext

import pytest
import torch

import hf_paged
from hf_paged import kernels
from hf_paged.kernels import parallel_jit
from hf_paged.testing import tiny_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_compile_only_changes_nothing_without_cuda(monkeypatch):
    """Where it cannot serve (here: no CUDA, as in CI) the block is told so and launches are left alone."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with parallel_jit.compile_only() as dry:
        assert dry is False
        assert not parallel_jit.compiling_only()
    assert not parallel_jit.compiling_only()


def test_compile_only_is_never_dry_for_work_on_another_device(monkeypatch):
    """A CPU engine on a host with a GPU: its warm-up launches no Triton kernel, so its block must run for real (a
    dry one skipped the prefill forwards and the compiled prefill's check, as three GPU-host failures showed)."""
    asked = []
    monkeypatch.setattr(parallel_jit, "_async_mode_class", lambda: asked.append(1) or object)
    with parallel_jit.compile_only(device="cpu") as dry:
        assert dry is False and not parallel_jit.compiling_only()
    assert asked == []


def test_the_compiler_key_is_hashed_once_from_when_an_engine_is_built(monkeypatch):
    """`prefetch_compiler_key` starts hashing Triton's key in a thread where a dry block would run, not for a CPU
    engine; a second call and the dry block's own start take that same thread while it runs (one hash per process)."""
    import triton.runtime.cache

    gate = threading.Event()

    class Key:  # Triton's `triton_key` (an lru-cached function): "hashes" until the gate opens
        calls = 0
        cached = 0

        def __call__(self):
            Key.calls += 1
            gate.wait(30)
            Key.cached = 1
            return "key"

        def cache_info(self):
            return type("Info", (), {"currsize": Key.cached})()

    monkeypatch.setattr(triton.runtime.cache, "triton_key", Key())
    monkeypatch.setattr(parallel_jit, "_KEY_THREAD", [None])
    monkeypatch.setattr(parallel_jit, "_async_mode_class", lambda: object)
    parallel_jit.prefetch_compiler_key("cpu")
    assert parallel_jit._KEY_THREAD[0] is None
    parallel_jit.prefetch_compiler_key("cuda")
    thread = parallel_jit._KEY_THREAD[0]
    assert thread is not None and thread.is_alive()
    parallel_jit.prefetch_compiler_key("cuda")
    assert parallel_jit._start_key_hash() is thread and parallel_jit._KEY_THREAD[0] is thread
    gate.set()
    thread.join(30)
    assert Key.calls == 1 and not thread.is_alive()
    assert parallel_jit._start_key_hash() is None and Key.calls == 1  # hashed: nothing more to start


def test_an_engine_starts_the_key_hash_when_it_is_built(monkeypatch):
    """The engine hands its device to `prefetch_compiler_key` first thing (before its memory profiling)."""
    from hf_paged.engine import engine as engine_module

    seen = []
    monkeypatch.setattr(engine_module, "prefetch_compiler_key", seen.append)
    engine = hf_paged.Engine(tiny_model("llama"), num_blocks=8, block_size=8, max_num_seqs=2)
    assert seen == [engine.device]
    engine.close()


@contextmanager
def _always(*args, **kwargs):
    """`compile_only` as it behaves on CUDA: yields True (here nothing of it is real: the work inside is stubbed)."""
    yield True


@pytest.mark.parametrize("compile_decode", [False, True])
def test_a_dry_warm_up_imports_the_compiler_before_its_first_launch(monkeypatch, compile_decode):
    """With `compile_decode`, the dry block imports what compiling the step imports before its first Triton launch
    (the sampler's), so the imports overlap the compiler key's hash that launch waits for; without, nothing."""
    import hf_paged.engine.engine as engine_module
    import hf_paged.runner.warm_up as warm_up_module

    engine = hf_paged.Engine(tiny_model("llama"), num_blocks=8, block_size=8, max_num_seqs=2)
    runner = engine.runner
    monkeypatch.setattr(runner, "compile_decode", compile_decode)
    imported, order = [], []
    monkeypatch.setattr(warm_up_module.importlib, "import_module", imported.append)
    monkeypatch.setattr(engine, "_warm_up_sampler", lambda: order.append(("sampler", list(imported))))
    for name in ("warm_up_prefill", "warm_up_decode_kernels", "warm_up_compiled_prefill", "capture_all",
                 "warm_up_uploads"):
        monkeypatch.setattr(runner, name, lambda *args, name=name: order.append((name, list(imported))))
    monkeypatch.setattr(engine_module, "compile_only", _always)
    engine.warm_up(freeze_gc=False)
    wanted = list(warm_up_module.COMPILER_MODULES) if compile_decode else []
    assert order[0] == ("sampler", wanted)
    assert ("warm_up_decode_kernels", wanted) in order
    assert imported == wanted  # once
    engine.close()


def test_a_compiler_import_that_fails_is_left_to_the_compilation(monkeypatch):
    """`import_compiler` never raises: a module missing from this torch, or one whose import fails, is skipped, so an
    automatic `compile_decode` still reaches the compilation, where a failure falls back to the model's own code."""
    import hf_paged.runner.warm_up as warm_up_module

    engine = hf_paged.Engine(tiny_model("llama"), num_blocks=8, block_size=8, max_num_seqs=2)
    monkeypatch.setattr(engine.runner, "compile_decode", True)
    tried = []

    def failing(name):
        tried.append(name)
        raise (ImportError if len(tried) == 1 else RuntimeError)(f"cannot import {name}")

    monkeypatch.setattr(warm_up_module.importlib, "import_module", failing)
    engine.runner.import_compiler()
    assert tried == list(warm_up_module.COMPILER_MODULES)
    engine.close()


def _write_kv_inputs(tokens: int = 5, heads: int = 2, head_dim: int = 64, block_size: int = 16):
    key = torch.randn(tokens, heads, head_dim, device="cuda")
    value = torch.randn_like(key)
    key_cache = torch.zeros(4, heads, block_size, head_dim, device="cuda")
    value_cache = torch.zeros_like(key_cache)
    slots = torch.arange(tokens, device="cuda") + 3
    return key, value, key_cache, value_cache, slots


def _cached(fn) -> int:
    """How many compiled variants `fn` holds for the current device."""
    device = torch.cuda.current_device()
    return len(fn.device_caches[device][0]) if device in fn.device_caches else 0


@needs_cuda
def test_launches_inside_only_compile_and_the_kernel_is_ready_after():
    from hf_paged.kernels import triton_cache

    fn = triton_cache._write_kv_kernel
    fn.device_caches.clear()  # forget in-memory variants: the block must compile (from disk or anew)
    key, value, key_cache, value_cache, slots = _write_kv_inputs()
    with parallel_jit.compile_only() as dry:
        assert dry and parallel_jit.compiling_only()
        kernels.write_kv(key, value, key_cache, value_cache, slots)
        torch.cuda.synchronize()
        assert not key_cache.any() and not value_cache.any()  # compiled, not run
    assert not parallel_jit.compiling_only()
    assert _cached(fn) == 1  # the block's end finished the compilation
    (compiled,) = fn.device_caches[torch.cuda.current_device()][0].values()
    assert compiled.module is not None  # and the pool loaded it (module, launcher): its first launch will not
    kernels.write_kv(key, value, key_cache, value_cache, slots)
    assert _cached(fn) == 1  # the real launch found it
    flat_k = key_cache.permute(0, 2, 1, 3).reshape(-1, key.shape[1], key.shape[2])
    assert torch.equal(flat_k[3:3 + key.shape[0]], key)


@needs_cuda
def test_other_threads_launch_for_real_meanwhile():
    key, value, key_cache, value_cache, slots = _write_kv_inputs()
    with parallel_jit.compile_only() as dry:
        assert dry
        worker = threading.Thread(target=kernels.write_kv, args=(key, value, key_cache, value_cache, slots))
        worker.start()
        worker.join()
        torch.cuda.synchronize()
    assert key_cache.any() and value_cache.any()


@needs_cuda
def test_a_failed_compilation_raises_at_the_end_and_launches_run_after():
    import triton
    import triton.language as tl

    @triton.jit
    def broken(x):
        tl.store(x, not_defined_anywhere)  # noqa: F821

    x = torch.zeros(1, device="cuda")
    with pytest.raises(Exception, match="not_defined_anywhere"):
        with parallel_jit.compile_only() as dry:
            assert dry
            broken[(1,)](x)
    assert not parallel_jit.compiling_only()
    key, value, key_cache, value_cache, slots = _write_kv_inputs()
    kernels.write_kv(key, value, key_cache, value_cache, slots)
    assert key_cache.any() and value_cache.any()


@contextmanager
def _never(*args, **kwargs):
    """`compile_only` as it behaves where it cannot serve: yields False, changes nothing."""
    yield False


@needs_cuda
@pytest.mark.parametrize("compile_decode", [False, True])
def test_an_engine_warm_up_compiles_what_the_real_forwards_would(monkeypatch, compile_decode):
    """The variants a dry warm-up compiles include every one that the same warm-up run for real compiles, so its
    captures and first steps compile nothing more (with `compile_decode`, the decode step is compiled inside the
    block too); the engine then gives transformers' tokens."""
    import hf_paged.engine.engine as engine_module
    from hf_paged.kernels import triton_cache, triton_decode, triton_prefill, triton_sampling

    fns = [triton_cache._write_kv_kernel, triton_prefill._paged_prefill_kernel, triton_decode._paged_decode_kernel,
           triton_decode._paged_decode_reduce_kernel, triton_sampling._sample_kernel]

    def variants():
        device = torch.cuda.current_device()
        return {fn: set(fn.device_caches[device][0]) if device in fn.device_caches else set() for fn in fns}

    def warmed_engine(model):
        for fn in fns:
            fn.device_caches.clear()
        engine = hf_paged.Engine(model, block_size=16, num_blocks=64, max_num_seqs=48, compile_decode=compile_decode)
        engines.append(engine)
        engine.warm_up(freeze_gc=False)
        return engine

    after_dry_block, engines = [], []

    @contextmanager
    def recording(*args, **kwargs):
        with parallel_jit.compile_only(*args, **kwargs) as dry:
            yield dry
        after_dry_block.append(variants())
        compiled_in_block.append(engines[-1].runner._compiled is not None)

    compiled_in_block = []

    model = tiny_model("llama", seed=3).cuda()
    hf_paged.enable(model)
    with monkeypatch.context() as patch:
        patch.setattr(engine_module, "compile_only", _never)
        real_engine = warmed_engine(model)  # the forwards and captures run for real, compiling as they go
    real_variants = variants()
    assert real_engine.warm_up_seconds["prefill"] > 0
    real_engine.close()
    monkeypatch.setattr(engine_module, "compile_only", recording)
    dry_engine = warmed_engine(model)
    assert dry_engine.warm_up_seconds["kernel_jit"] > 0 and dry_engine.warm_up_seconds["prefill"] < 0.1
    dry_variants = after_dry_block[0]  # what the block compiled, before any capture ran
    assert compiled_in_block == [compile_decode]
    for fn in fns:
        assert real_variants[fn] <= dry_variants[fn], fn
    assert len(dry_variants[triton_prefill._paged_prefill_kernel]) > 1
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    refs = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    outs = dry_engine.generate(prompts, max_new_tokens=8)
    assert [o.outputs[0].token_ids for o in outs] == refs
    dry_engine.close()


def test_the_pool_loads_what_it_compiled(monkeypatch):
    """The pool thread that compiled a kernel also loads it (Triton's `_init_handles`), on the launching thread's
    device; a kernel that fails to load is handed over all the same (its first launch raises). CPU-only: Triton's
    `AsyncCompileMode` with a stand-in compilation, the callbacks passed as this Triton's `_do_compile` passes them."""
    import inspect
    from concurrent.futures import ThreadPoolExecutor

    mode_class = pytest.importorskip("triton.runtime._async_compile").AsyncCompileMode
    devices = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "device", lambda d: devices.append(d) or nullcontext())

    class Kernel:
        def __init__(self, fails):
            self.fails, self.loaded_by = fails, None

        def _init_handles(self):
            self.loaded_by = threading.current_thread().name
            if self.fails:
                raise RuntimeError("out of resources")

    finalized = []
    callbacks = [finalized.append, lambda future: None][: len(inspect.signature(mode_class.submit).parameters) - 3]
    with ThreadPoolExecutor(2, thread_name_prefix="pool") as executor:
        with parallel_jit._loading_mode(mode_class)(executor) as mode:
            futures = [mode.submit(key, lambda fails=fails: Kernel(fails), *callbacks)
                       for key, fails in (("ok", False), ("bad", True))]
    kernels_done = [f.result() for f in futures]
    assert [k.fails for k in finalized] == [False, True] or [k.fails for k in finalized] == [True, False]
    assert all(k.loaded_by.startswith("pool") for k in kernels_done)
    assert devices == [3, 3]


@pytest.mark.parametrize("value", ["1", "true", "True", "yes", "on", "y", "0", "false", "False", "", "off", "2"])
def test_every_interpreter_check_reads_triton_interpret_as_triton_does(monkeypatch, value):
    """The backend check, the parallel JIT and the sampler's sort size all follow Triton's own reading of
    `TRITON_INTERPRET` (they used to parse it three ways: "false" counted as on for two of them, "yes" as off for
    the third)."""
    knobs = pytest.importorskip("triton.knobs")  # Triton's own reading (3.4 on)
    from hf_paged.kernels import interpreter, triton_sampling

    monkeypatch.setenv("TRITON_INTERPRET", value)
    on = bool(knobs.runtime.interpret)
    assert on == (value.lower() in ("1", "true", "yes", "on", "y"))
    assert interpreter.triton_interpreting() is on
    cpu = torch.zeros(1)
    if on:
        kernels._check_triton_device(cpu)
    else:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            kernels._check_triton_device(cpu)
    assert triton_sampling.INTERPRETED_SORT_N != triton_sampling.SORT_N
    assert triton_sampling.default_sort_n() == (triton_sampling.INTERPRETED_SORT_N if on else triton_sampling.SORT_N)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # then only the interpreter keeps a block from dry
    if on:
        assert parallel_jit._async_mode_class() is None
    else:
        monkeypatch.setattr(parallel_jit, "triton_interpreting", lambda: True)
        assert parallel_jit._async_mode_class() is None  # (the check goes through the shared helper)


def test_the_interpreter_check_without_triton_reads_the_variable_by_triton_rule(monkeypatch):
    """Without an importable `triton.knobs` the helper applies the same rule to the variable itself."""
    import builtins

    from hf_paged.kernels import interpreter

    real_import = builtins.__import__

    def no_knobs(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "triton" and fromlist and "knobs" in fromlist:
            raise ImportError("no knobs")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_knobs)
    for value, on in (("Y", True), ("On", True), ("false", False), ("2", False), ("", False), (" on ", False)):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert interpreter.triton_interpreting() is on, value
