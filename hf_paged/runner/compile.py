"""Optional kernel fusion: compile a model's pure-tensor submodules with `torch.compile`.

A decode step of a small model is bound by the number of kernels it launches, not by its arithmetic: transformers'
RMSNorm alone is about eight elementwise kernels (cast, square, mean, add, rsqrt, multiply, cast, scale), run twice per
layer, and the rotary embedding and the MLP activation add more. `nn.Module.compile` lets Inductor fuse each such
submodule into one or two kernels while the model keeps running its own code: nothing is rewritten, the submodules
are only called through their compiled form. The attention (hf_paged's Triton kernels, reached through the cache and
the registered attention function) stays outside the compiled regions.

Compilation takes seconds to minutes the first time each submodule runs, so `Engine.warm_up()` is the place to pay
it. Shapes are compiled dynamic in the token dimension, so one compilation serves every batch size. Results are those
of the uncompiled modules up to floating-point reassociation in the fused reductions. The only recompilation is
the 0/1 specialisation of a one-token batch. `hf_paged.disable(model)` uncompiles them (`uncompile_submodules`).
"""

from __future__ import annotations

import torch

__all__ = ["compile_submodules", "uncompile_submodules"]

#: class-name suffixes of the submodules compiled: their forward is tensor arithmetic only
FUSABLE_SUFFIXES = ("RMSNorm", "RotaryEmbedding", "MLP")
_MARK = "_hf_paged_compiled"


def compile_submodules(model: torch.nn.Module, *, dynamic: bool = True) -> int:
    """Compile every RMSNorm, rotary-embedding and MLP submodule of `model` in place; return how many.

    Idempotent: a submodule compiled already (by this function or by the user) is left as it is.
    """
    count = 0
    for module in model.modules():
        if type(module).__name__.endswith(FUSABLE_SUFFIXES) and getattr(module, "_compiled_call_impl", None) is None:
            module.compile(dynamic=dynamic)
            setattr(module, _MARK, True)
            count += 1
    return count


def uncompile_submodules(model: torch.nn.Module) -> int:
    """Undo `compile_submodules` (only the submodules it compiled); return how many were restored."""
    count = 0
    for module in model.modules():
        if getattr(module, _MARK, False):
            module._compiled_call_impl = None
            delattr(module, _MARK)
            count += 1
    return count
