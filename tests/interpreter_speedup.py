"""Triton's interpreter, without its redundant re-patching of `triton.language` on every device-function call.

Under `TRITON_INTERPRET=1` a kernel launch (`GridExecutor.__call__`) swaps the builtins of `triton.language`
(`tl.load`, `tl.where`, tensor methods, ...) for interpreted ones, runs the grid, and restores them. Every call of a
`@triton.jit` helper inside the kernel (`InterpretedFunction.__call__`) patches the same modules again with
`inspect.getmembers` over each of them, about 2 ms a call, and finds nothing left to patch: the builtins are already
the launch's wrappers, which are not builtins themselves. In the sampling kernel's searches that was a third of the
time of tests/test_kernel_sampling.py.

`install()` makes a helper call skip that re-patch while a launch in the same thread has already patched every
`triton.language` module the helper's globals name; anything else (no launch active, a module the launch did not
patch) goes through Triton's own `_patch_lang`. What the kernels compute is unchanged: the helper runs under the very
wrappers it would have installed. A Triton whose interpreter lacks these internals is left alone.
"""

from __future__ import annotations

import functools
import threading
import types

_state = threading.local()


def _lang_modules(fn, tl) -> frozenset[int]:
    return frozenset(id(value) for value in fn.__globals__.values() if value is tl or value is tl.core)


def _function_seeing(module):
    """A function whose globals hold `module` (what Triton's `_patch_lang` looks for)."""
    return types.FunctionType((lambda: None).__code__, {"lang": module})


def install() -> bool:
    """Patch Triton's interpreter (idempotent); False where its internals are not the expected ones."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except Exception:  # no triton, or one that fails to import: nothing to speed up
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or scope_type is None or executor is None or getattr(patch_lang, "_hf_paged_tests", False):
        return getattr(patch_lang, "_hf_paged_tests", False)

    @functools.wraps(patch_lang)
    def patch_once_per_launch(fn):
        launch = getattr(_state, "launch", None)  # None outside a launch; a set once the launch has patched
        langs = _lang_modules(fn, tl)
        if launch is not None and launch is not _STARTING and langs <= launch:
            return scope_type()  # already patched by this thread's launch: nothing to do, nothing to restore
        scope = patch_lang(fn)
        if launch is _STARTING:
            # the launch's own patch, widened to both `triton.language` and `triton.language.core`: the standard
            # library's helpers (`tl.sum`, `tl.zeros`, `tl.sort`, ... in triton/language/standard.py) see only `core`,
            # so a launch that patched `tl` alone left each of their calls to patch `core` anew (2,700 calls, a fifth
            # of a sampling test's time). Restored with the launch's scope (its changes undo last-in first-out).
            missing = [module for module in (tl, tl.core) if id(module) not in langs]
            changes = getattr(scope, "_changes", None)
            for module in missing if isinstance(changes, list) else ():
                changes.extend(patch_lang(_function_seeing(module))._changes)
                langs = langs | {id(module)}
            _state.launch = langs  # what its helpers may rely on
        return scope

    launch_call = executor.__call__

    @functools.wraps(launch_call)
    def call(self, *args, **kwargs):
        outer = getattr(_state, "launch", None)
        _state.launch = _STARTING
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            _state.launch = outer

    patch_once_per_launch._hf_paged_tests = True
    interpreter._patch_lang = patch_once_per_launch
    executor.__call__ = call
    return True


_STARTING = object()
