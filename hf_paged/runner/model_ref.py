"""How the engine holds its model: strongly when the user built the engine, weakly when the model owns the engine.

`hf_paged.enable(model)` / `generate(cache_implementation="paged")` / `hf_paged.pipeline` keep an engine on the model
(`model._hf_paged_engine`) so its KV pool is allocated once and reused by later calls. If that engine also held the
model strongly, model and engine would form a reference cycle: `del model` would free nothing until the cycle
collector ran (never, with `gc.disable()` or after `gc.freeze()`), and the engine's KV pool (most of the GPU) would
stay allocated. So an engine owned by its model holds it through a `weakref`: dropping the last user reference frees
the model, which frees the engine, which frees the pool, all by reference counting.

An `Engine(model)` built directly holds the model strongly (the user holds the engine; nothing points back).
"""

from __future__ import annotations

import weakref

__all__ = ["ModelRef", "ModelFreedError"]


class ModelFreedError(ReferenceError):
    """The model an engine served (weakly, because the model owned the engine) has been freed."""


class ModelRef:
    """`ref()` returns the model; weak or strong (see the module docstring). Dynamo traces the call (a plain
    attribute read, or a `weakref.ref` call, which it supports), so the compiled decode step can go through it."""

    __slots__ = ("_strong", "_weak")

    def __init__(self, model, *, weak: bool = False) -> None:
        self._strong = None if weak else model
        self._weak = weakref.ref(model) if weak else None

    @property
    def is_weak(self) -> bool:
        return self._weak is not None

    def peek(self):
        """The model, or None if it was freed (never raises)."""
        return self._strong if self._strong is not None else self._weak()

    def __call__(self):
        if self._strong is not None:
            return self._strong
        model = self._weak()
        if model is None:
            raise ModelFreedError("the model this engine served has been freed (the engine belonged to it)")
        return model
