"""Compile the Triton kernels of a warm-up in parallel, in a thread pool, instead of one after another.

Why: Triton compiles a kernel the first time it is launched with a new specialisation, and the launching thread
waits for it. An engine's warm-up runs code that launches a dozen variants (a prefill kernel per tile shape, the
K/V write, the decode kernels of the batch buckets, the sampler), so on a cold cache their compilations ran in a
row: seconds each, 8-10 s in all on an H100 host. Most of a compilation (LLVM's optimiser, the PTX translation,
`ptxas`) runs without the GIL, so threads do overlap them.

How: `compile_only()` runs its body with this thread's Triton launches turned into `warmup` calls (compile, do not
run) under Triton's `AsyncCompileMode`, which hands each compilation to a thread pool and finishes them all when the
block ends; the pool's threads also load each kernel they compiled (module and launcher), which Triton would do at
its first real launch. The body is the warm-up code itself (a dummy forward, a sampler call), so what is compiled is exactly
what the real launches will need, with no list of signatures to keep in step with the kernels.

While the block runs, no Triton kernel of this thread runs: the tensors they would write hold whatever was in
memory. Only code whose results are thrown away may run inside (warm-up forwards), and nothing inside may read a
kernel's output on the host to decide what to do. Launches of other threads are untouched.

Without CUDA, for work on another device, with the interpreter (`TRITON_INTERPRET=1`), or with a Triton older than
`AsyncCompileMode` (3.4), `compile_only()` yields False and does nothing: the caller runs its warm-up as before.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from .interpreter import triton_interpreting

__all__ = ["compile_only", "compiling_only", "prefetch_compiler_key"]

_STATE = threading.local()  # .active: this thread's launches only compile
_PATCH_LOCK = threading.Lock()
_PATCHED: list[bool] = [False]
_KEY_THREAD: list[threading.Thread | None] = [None]  # the process's one hashing of Triton's compiler key, if started


def compiling_only() -> bool:
    """True inside `compile_only()` on this thread (its Triton launches compile and do not run)."""
    return getattr(_STATE, "active", False)


def _async_mode_class():
    """Triton's `AsyncCompileMode`, or None where it cannot serve (no CUDA, interpreter, older Triton)."""
    if not torch.cuda.is_available() or triton_interpreting():
        return None
    try:
        from triton.runtime._async_compile import AsyncCompileMode
        from triton.runtime.jit import JITFunction
    except Exception:  # no triton, or one without the async mode
        return None
    if not hasattr(JITFunction, "run"):
        return None
    return AsyncCompileMode


def _start_key_hash() -> threading.Thread | None:
    """Start computing Triton's compiler key in a thread, if this process has not yet; the thread computing it if one
    was started already and is still running.

    Every compilation and every on-disk cache lookup needs it, and the first one computes it: a SHA-256 of
    `libtriton.so` (400 MB) and of Triton's sources, 0.4 s that `hashlib` runs without the GIL. Started when an engine
    is built (`prefetch_compiler_key`), it overlaps the memory profiling and the pool's allocation instead of
    delaying the warm-up's first kernel, which waits for it."""
    running = _KEY_THREAD[0]
    if running is not None and running.is_alive():
        return running
    try:
        from triton.runtime.cache import triton_key
    except Exception:
        return None
    info = getattr(triton_key, "cache_info", None)
    if info is None or info().currsize:
        return None
    thread = threading.Thread(target=triton_key, name="hf_paged-triton-key", daemon=True)
    thread.start()
    _KEY_THREAD[0] = thread
    return thread


def prefetch_compiler_key(device: torch.device | str) -> None:
    """Start hashing Triton's compiler key now, in a thread, when `device` is one `compile_only()` compiles for.

    Why: a warm start of a compiled engine found every kernel in the caches, but its first launch still waited 0.41 s
    for this hash (an H100 host), which `compile_only()` started only when the warm-up began. An engine calls this
    first thing when it is built; the hash then overlaps its memory profiling and pool allocation (hashing releases
    the GIL). Nothing happens where no dry block would run (no CUDA, the interpreter, an older Triton)."""
    if torch.device(device).type == "cuda" and _async_mode_class() is not None:
        _start_key_hash()


def _install_launch_patch() -> None:
    """Wrap `JITFunction.run` once: a launch from a thread inside `compile_only()` becomes a warmup (compile only).

    Every other launch calls the original unchanged, so the wrapper costs one thread-local read per launch."""
    from triton.runtime.jit import JITFunction

    with _PATCH_LOCK:
        if _PATCHED[0]:
            return
        original = JITFunction.run

        def run(self, *args, **kwargs):
            if getattr(_STATE, "active", False):
                kwargs["warmup"] = True
                key_hash = getattr(_STATE, "key_hash", None)
                if key_hash is not None:  # let it finish rather than hash a second time on this thread
                    key_hash.join()
                    _STATE.key_hash = None
            return original(self, *args, **kwargs)

        run.__wrapped__ = original  # type: ignore[attr-defined]
        JITFunction.run = run
        _PATCHED[0] = True


def _workers() -> int:
    return max(1, min(16, os.cpu_count() or 1))


@contextmanager
def compile_only(max_workers: int | None = None, device: torch.device | str | None = None) -> Iterator[bool]:
    """`with compile_only() as dry:` when `dry`, this thread's Triton launches inside only compile, `max_workers`
    at a time in threads; the block's end waits for every compilation (and raises a compilation error). When not
    `dry` (see the module docstring), nothing is changed and the body should not run its launches for nothing.

    `device`: where the body's work runs, when known. Not a CUDA device: never `dry`, even on a host with a GPU (a
    CPU engine's warm-up launches no Triton kernel, so a dry block would only skip its forwards' real work).
    """
    if compiling_only():  # nested: the outer block already only compiles
        yield True
        return
    mode_class = _async_mode_class() if device is None or torch.device(device).type == "cuda" else None
    if mode_class is None:
        yield False
        return
    _install_launch_patch()
    _STATE.key_hash = _start_key_hash()
    executor = ThreadPoolExecutor(max_workers=max_workers or _workers(), thread_name_prefix="hf_paged-jit")
    mode = _loading_mode(mode_class)(executor)
    try:
        with mode:
            _STATE.active = True
            try:
                yield True
            finally:
                _STATE.active = False
                _STATE.key_hash = None
    finally:
        executor.shutdown(wait=True)
        _leave(mode)


def _loading_mode(mode_class):
    """`mode_class` whose pool threads also load each kernel they compiled, on the launching thread's device.

    Triton loads a compiled kernel (its module into the CUDA context, and its launcher, which some Triton versions
    build with the C compiler on a cache miss: tenths of a second each) at its first real launch. A warm-up whose
    launches only compiled would leave that to the graph captures and the first request; done here it runs in
    parallel too. A kernel that fails to load is left as it is: its first launch tries again and raises there."""

    class LoadingMode(mode_class):
        def submit(self, key, compile_fn, *callbacks):  # (finalize[, cleanup]): their number varies by version
            device = torch.cuda.current_device()

            def compile_and_load():
                kernel = compile_fn()
                init = getattr(kernel, "_init_handles", None)
                if init is not None:
                    try:
                        with torch.cuda.device(device):
                            init()
                    except Exception:  # raised again, where it belongs, by the kernel's first launch
                        pass
                return kernel

            return super().submit(key, compile_and_load, *callbacks)

    return LoadingMode


def _leave(mode) -> None:
    """Make sure this thread is out of `mode`: some Triton versions leave it set when a compilation failed at the
    block's end, and every later launch of this thread would then only compile."""
    from triton.runtime import _async_compile

    if _async_compile.active_mode.get() is mode:
        _async_compile.active_mode.set(None)
