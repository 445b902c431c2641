"""One GEMM for the sibling projections of a layer (q/k/v, gate/up) in the compiled step, without touching modules.

Why: the GEMMs of a decode step are skinny (M = the batch), and on an H100 each costs about 5 us whatever its size
(`benchmarks/results/h100_2026-11-25c/where_time_goes/skinny.log`): llama-1b's q, k and v projections take ~15 us as
three GEMMs and ~5 us as one over their stacked weights, Qwen3-0.6B's about 11 and 5. Stacking them is what vLLM's
own model code does (`QKVParallelLinear`); we run transformers' code, so it is done in two steps that keep the modules
as they are:

1. `pack_siblings` moves each group's weights (and biases) into one buffer, in place: the parameters stay the same
   `nn.Parameter` objects with the same values, each now over its rows of the buffer, with a storage of its own (a
   DLPack alias, which keeps the buffer's memory alive). No memory is added (the old storages are freed). Optimizers
   update them in place; checkpoint writers see separate tensors (none of them "tied": accelerate's `save_model`
   drops all but one tensor of a shared storage); only this module's registry knows they lie together.
2. `fusing_backend` (the compiled step's `torch.compile` backend) rewrites the traced graph before Inductor: linears
   reading the same input whose weights are the rows of one buffer, in order, become one `hf_paged::sibling_linear`
   call, narrowed back into the projections.

The op checks at run time that the weights are still those rows of a registered buffer (a `param.data = ...`,
`load_state_dict(assign=True)` may have moved one: the engine's weight watch then re-packs) and otherwise runs one GEMM
per weight, so a moved weight is never read from where it used to be. In a CUDA graph the check runs at capture, as every address does.

Packing moves storage once, when a compiled engine is built: the other runners of the same model then drop their CUDA
graphs, recorded with the old addresses (`ModelRunner.repack`; the old memory is freed in stream order, after any
replay already launched). Not under tensor parallelism, and not for hooked, LoRA, quantized or parametrized linears,
which keep their own forward (`_plain_linear`). On an H100 this took the llama-1b ShareGPT run from 2.61 to 2.45 s
and the sampled Qwen3-0.6B workload from 9.27 to 8.97 s.
"""

from __future__ import annotations

import operator
import os
import weakref
from contextlib import nullcontext

import torch
import torch.nn.functional as F
import torch.utils.dlpack

__all__ = ["FUSED", "SIBLING_NAMES", "fold_residual_adds", "fusing_backend", "fuse_sibling_linears", "pack_siblings",
           "sibling_linear"]

#: names of sibling projections reading one input, in transformers' decoder layers (q/k/v of attention, gate/up of a
#: gated MLP); packing is by name, fusing in the graph by what the weights are
SIBLING_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


# the stacked buffers, by the address of their first row: the op finds a group's buffer here. A buffer lives as long
# as its first parameter object (or until that group is stacked again), not longer: dropped models free it
_STACKS: dict[int, torch.Tensor] = {}
_FIRST_ROWS: dict[int, int] = {}  # id() of a live first parameter -> its buffer's key (tensors compare by value)


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The rows of a stacked buffer that `tensors` are, in order from its first row (contiguous, alike, one after the
    other), as one `[sum(rows), ...]` tensor; else None. Such tensors are its memory: the buffer is alive while it is
    registered, so nothing else can be allocated at those addresses."""
    first = tensors[0]
    buffer = _STACKS.get(first.data_ptr())
    if buffer is None:
        return None
    end, rows = first.data_ptr(), 0
    for t in tensors:
        if (t.dtype != buffer.dtype or t.device != buffer.device or t.shape[1:] != buffer.shape[1:]
                or not t.is_contiguous() or t.data_ptr() != end):
            return None
        end += t.numel() * t.element_size()
        rows += t.shape[0]
    return buffer[:rows] if rows <= buffer.shape[0] else None


@torch.library.custom_op("hf_paged::sibling_linear", mutates_args=())
def sibling_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """``cat([linear(x, w, b) for ...], -1)``: one GEMM over the stacked buffer when the weights are its rows, else one
    per weight. `biases` is empty or one per weight."""
    weight = _stacked(weights)
    bias = _stacked(biases) if biases else None
    if weight is not None and (bias is not None or not biases):
        return F.linear(x, weight, bias)
    outs = [F.linear(x, w, biases[i] if biases else None) for i, w in enumerate(weights)]
    return torch.cat(outs, dim=-1)


@sibling_linear.register_fake
def _(x, weights, biases):
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


def _plain_linear(module: torch.nn.Module) -> bool:
    """An `nn.Linear` running its own forward on plain dense tensors (not a LoRA layer, a quantized or sharded
    weight, a hooked or parametrized module, one whose `forward` was replaced on the instance as accelerate's hooks do,
    a meta tensor)."""
    if type(module) is not torch.nn.Linear or module._forward_hooks or module._forward_pre_hooks:
        return False
    if "forward" in vars(module) or getattr(module, "_hf_hook", None) is not None:
        return False
    if getattr(module, "parametrizations", None):
        return False
    tensors = [module.weight] + ([module.bias] if module.bias is not None else [])
    return all(type(t.data) is torch.Tensor and t.device.type != "meta" and t.is_contiguous() for t in tensors)


def pack_siblings(layers: list[torch.nn.Module]) -> int:
    """Put each group of sibling projections (`SIBLING_NAMES`) of `layers` back to back in one buffer (see the module
    docstring); returns how many groups were packed now. Groups already packed, or whose members differ in class,
    input size, dtype, device or bias, are left alone."""
    packed = 0
    with torch.no_grad():
        for layer in layers:
            for parent in layer.modules():
                children = parent._modules
                for names in SIBLING_NAMES:
                    members = [children.get(name) for name in names]
                    if not all(m is not None and _plain_linear(m) for m in members):
                        continue
                    weights = [m.weight for m in members]
                    biases = [m.bias for m in members]
                    w0 = weights[0]
                    if any(w.shape[1] != w0.shape[1] or w.dtype != w0.dtype or w.device != w0.device for w in weights):
                        continue
                    has_bias = [b is not None for b in biases]
                    if any(has_bias) and not all(has_bias):
                        continue
                    if _stacked(weights) is not None and (not all(has_bias) or _stacked(biases) is not None):
                        continue
                    _pack(weights)
                    if all(has_bias):
                        _pack(biases)
                    packed += 1
    return packed


def _pack(params: list[torch.nn.Parameter]) -> None:
    """Copy `params` into one new buffer, each becoming its rows. Each parameter gets a storage of its own over its
    rows (through DLPack, which keeps the buffer's memory alive while any of them uses it), so checkpoint writers that
    look for tensors sharing a storage (accelerate's `save_model` drops all but one of them as "tied") see separate
    tensors; only `_STACKS` knows they lie together."""
    buffer = torch.cat([p.detach() for p in params])
    start = 0
    for p in params:
        rows = p.shape[0]
        p.data = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(buffer[start : start + rows]))
        start += rows
    first = params[0]
    old = _FIRST_ROWS.get(id(first))
    if old is not None:
        _STACKS.pop(old, None)
    else:  # the first packing of this parameter: forget its buffer with it
        weakref.finalize(first, _forget, id(first))
    key = first.data_ptr()
    _STACKS[key] = buffer
    _FIRST_ROWS[id(first)] = key


def _forget(ident: int) -> None:
    """A first parameter died: drop its buffer's entry (the memory goes when its other rows' users do too)."""
    key = _FIRST_ROWS.pop(ident, None)
    if key is not None:
        _STACKS.pop(key, None)


_LINEAR = (torch._C._nn.linear, F.linear)


def _linear_args(node: torch.fx.Node) -> tuple:
    """(input, weight, bias) of a linear call node, positional or keyword (bias None when absent)."""
    args = list(node.args) + [None] * (3 - len(node.args))
    return args[0], node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])


def fuse_sibling_linears(gm: torch.fx.GraphModule, example_inputs) -> int:
    """Rewrite `gm` (a Dynamo graph): linears reading one input, with weights (and biases) among the graph's inputs
    being one stacked buffer's rows in order, become one `sibling_linear` narrowed back. Returns how many groups were
    fused.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    values = {n: v for n, v in zip(placeholders, example_inputs) if isinstance(v, torch.Tensor)}
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[tuple, list[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node | None]]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _LINEAR:
            continue
        x, weight, bias = _linear_args(node)
        if not isinstance(x, torch.fx.Node) or weight not in values or (bias is not None and bias not in values):
            continue
        if values[weight].dim() != 2:
            continue
        groups.setdefault((x, bias is not None), []).append((node, weight, bias))
    fused = 0
    for (x, has_bias), members in groups.items():
        members.sort(key=lambda m: values[m[1]].data_ptr())
        run: list = []
        for member in members + [None]:
            if member is not None and run and _stacked([values[m[1]] for m in run + [member]]) is not None and (
                    not has_bias or _stacked([values[m[2]] for m in run + [member]]) is not None):
                run.append(member)
                continue
            if len(run) >= 2:
                _replace(graph, order, x, run, values)
                fused += 1
            run = [member] if member is not None else []
    if fused:
        graph.lint()
        gm.recompile()
    return fused


def _replace(graph: torch.fx.Graph, order: dict, x: torch.fx.Node, run: list, values: dict) -> None:
    first = min((m[0] for m in run), key=order.__getitem__)
    weights = [m[1] for m in run]
    biases = [m[2] for m in run] if run[0][2] is not None else []
    total = sum(values[w].shape[0] for w in weights)
    # the example values Dynamo's later consumers of a graph read (AOTAutograd's cache checks that a method is called
    # on a tensor by its `example_value`; without one the graph is not cached, and a warm start compiles it again)
    example = x.meta.get("example_value")
    fused = example.new_empty((*example.shape[:-1], total)) if isinstance(example, torch.Tensor) else None
    with graph.inserting_before(first):
        out = graph.call_function(torch.ops.hf_paged.sibling_linear.default, (x, weights, biases))
        out.meta.update(first.meta)
        if fused is not None:
            out.meta["example_value"] = fused
        start = 0
        for node, weight, _ in run:
            rows = values[weight].shape[0]
            part = graph.call_function(operator.getitem, (out, (Ellipsis, slice(start, start + rows))))
            part.meta.update(node.meta)
            if fused is not None:
                part.meta["example_value"] = fused[..., start : start + rows]
            start += rows
            node.replace_all_uses_with(part)
    for node, _, _ in run:  # only now: `first` anchors the insertions above
        graph.erase_node(node)


_ADD = (operator.add, torch.add)


def fold_residual_adds(gm: torch.fx.GraphModule) -> int:
    """Rewrite `gm` (a Dynamo graph): `residual + linear(x, w)` (no bias, the sum only returned by the graph) becomes
    one `addmm(residual, x, w.t())`, the add done in the GEMM's epilogue. Returns how many were folded.

    Why: the compiled step compiles each decoder layer on its own (`hf_paged.runner.regional`), so the residual add
    that ends a layer cannot fuse with the next layer's norm; it stayed a kernel of its own in every layer (about
    1.5 us plus a launch gap on an H100 at decode batch sizes). Inductor folds `mm + add` itself only where no view
    stands between them, and a linear over `[1, batch, hidden]` states is `view(mm(view(x)))`. Adds that something
    else in the graph reads are left to Inductor, which fuses them with what reads them (e.g. add + RMSNorm).
    """
    graph = gm.graph
    outputs = {n for n in graph.nodes if n.op == "output"}
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _ADD or len(node.args) != 2 or node.kwargs:
            continue
        if not node.users or any(user not in outputs for user in node.users):
            continue
        a, b = node.args
        for linear, residual in ((a, b), (b, a)):
            if _plain_linear_node(linear) and isinstance(residual, torch.fx.Node) and _same_layout(linear, residual):
                _fold(graph, node, linear, residual)
                folded += 1
                break
    if folded:  # (no `eliminate_dead_code`: FX takes in-place method calls, e.g. a recurrent layer's convolution
        graph.lint()  # window update `conv_state.copy_(...)`, for dead code and would drop them)
        gm.recompile()
    return folded


def _plain_linear_node(node) -> bool:
    """A bias-free linear over a 2-D weight whose one reader is the add."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in _LINEAR:
        return False
    if len(node.users) != 1 or len(node.args) > 3 or set(node.kwargs) - {"weight", "bias"}:
        return False
    x, weight, bias = _linear_args(node)
    value = weight.meta.get("example_value") if isinstance(weight, torch.fx.Node) else None
    return bias is None and isinstance(value, torch.Tensor) and value.dim() == 2 and isinstance(x, torch.fx.Node)


def _same_layout(linear: torch.fx.Node, residual: torch.fx.Node) -> bool:
    """The residual has the linear output's shape and dtype (no broadcast, no promotion: addmm's result is that)."""
    out, res = linear.meta.get("example_value"), residual.meta.get("example_value")
    return (isinstance(out, torch.Tensor) and isinstance(res, torch.Tensor) and out.dim() >= 2
            and tuple(out.shape) == tuple(res.shape) and out.dtype == res.dtype and out.device == res.device)


def _fold(graph: torch.fx.Graph, add: torch.fx.Node, linear: torch.fx.Node, residual: torch.fx.Node) -> None:
    x, weight, _ = _linear_args(linear)
    out, w = linear.meta["example_value"], weight.meta["example_value"]
    cols, inner = int(w.shape[0]), int(w.shape[1])  # a weight's sizes are static (the batch may be symbolic)
    rows = out.numel() // cols
    with graph.inserting_before(add):
        x2 = graph.call_method("reshape", (x, -1, inner))
        r2 = graph.call_method("reshape", (residual, -1, cols))
        wt = graph.call_method("t", (weight,))
        mm = graph.call_function(torch.addmm, (r2, x2, wt))
        back = graph.call_method("view_as", (mm, residual))
    # example values, as `_replace` keeps them (AOTAutograd's cache reads them)
    for node, value in ((x2, out.new_empty((rows, inner))), (r2, out.new_empty((rows, cols))), (wt, w.t()),
                        (mm, out.new_empty((rows, cols))), (back, out.new_empty(out.shape))):
        node.meta.update(add.meta)
        node.meta["example_value"] = value
    add.replace_all_uses_with(back)
    graph.erase_node(add)
    graph.erase_node(linear)  # its one reader was the add


#: residual adds folded into GEMMs by `fusing_backend` (see `fold_residual_adds`); off: Inductor's own kernels.
#: Within noise end to end on the H100 and the H200 (benchmarks/results/h200_2026-11-28/, call 5); all 89 accepted
#: architectures keep the no-graph engine's greedy tokens with it (`benchmarks/probe_compiled.py`, float32)
FOLD_RESIDUAL_ADDS = True

#: groups fused by `fusing_backend` in this process (tests and benchmarks read it)
FUSED = {"graphs": 0, "groups": 0, "residual_adds": 0}


#: Inductor's combo kernels (independent point-wise kernels of a graph launched as one): in a decode layer, the
#: rotary and layout copies of q, k and v are three kernels of about 1.2 us each, plus a launch gap each, in a step
#: bound by its launches at small batches. Off where the installed Inductor lacks the option. With the fused decode op
#: (`kernels.write_and_paged_decode`), llama-1b's compiled step went from 247 to 183 kernels and from 1.57 to 1.50 ms
#: of GPU time at 24 rows, 2.43 to 2.34 ms at 256 (H100, `benchmarks/bench_decode_step.py`, h100_2026-11-26b)
COMBO_KERNELS = True


#: what compiles the step's graph after the passes above: "inductor" (code generation: what a deployment runs) or
#: "aot_eager" (Dynamo and AOT autograd, the graph run by eager kernels: the same capture, graph breaks, custom ops
#: and passes, no generated code). The environment's ``HF_PAGED_COMPILE_BACKEND`` sets it at import. The test suite
#: takes "aot_eager" on a CPU-only machine (tests/conftest.py), where Inductor's C++ compilation of every tiny
#: graph cost minutes of a cold CI run, and runs the tests marked `inductor` with Inductor.
COMPILE_BACKEND = os.environ.get("HF_PAGED_COMPILE_BACKEND", "inductor")
_BACKENDS = ("inductor", "aot_eager")
if COMPILE_BACKEND not in _BACKENDS:
    raise ValueError(f"HF_PAGED_COMPILE_BACKEND must be one of {_BACKENDS}, got {COMPILE_BACKEND!r}")


def fusing_backend(gm: torch.fx.GraphModule, example_inputs):
    """`torch.compile` backend of the compiled step: `fuse_sibling_linears`, `fold_residual_adds`, then Inductor (with
    `COMBO_KERNELS`), or AOT autograd alone (`COMPILE_BACKEND`)."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.backends.debugging import aot_eager
    from torch._inductor.compile_fx import compile_fx

    if COMPILE_BACKEND not in _BACKENDS:
        raise ValueError(f"HF_PAGED_COMPILE_BACKEND / COMPILE_BACKEND must be one of {_BACKENDS}, "
                         f"got {COMPILE_BACKEND!r}")
    FUSED["graphs"] += 1
    FUSED["groups"] += fuse_sibling_linears(gm, example_inputs)
    if FOLD_RESIDUAL_ADDS:
        FUSED["residual_adds"] += fold_residual_adds(gm)
    if COMPILE_BACKEND == "aot_eager":
        return aot_eager(gm, example_inputs)
    combo = COMBO_KERNELS and hasattr(inductor_config, "combo_kernels")
    with inductor_config.patch(combo_kernels=True) if combo else nullcontext():
        return compile_fx(gm, example_inputs)
