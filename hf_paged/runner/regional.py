"""Regional compilation of the decode step: each repeated decoder layer runs through one shared compiled form.

`compile_decode` used to hand the whole decode forward to `torch.compile`. Dynamo then traces transformers' code for
every layer (16 to 80 copies of the same code) and Inductor lowers every copy: on an H100 that was 46 s of a cold
start and, since Dynamo's tracing is redone in every process, 8 s of a warm one for a 16-layer model. The layers of
a decoder are instances of one class running one `forward`: compiled once, the code serves them all (Dynamo keys its
cache on the code object, and the weights are inputs of the graph, not constants), as PyTorch's "regional
compilation" recipe does. Each engine compiles a copy of the entry code (`own_code`), so engines do not share one
cache and its recompile limit. The final norm and the rotary table are compiled alone (`top_level_modules`); what is
left (embedding, `lm_head`) runs eagerly, recorded on the GPU in the same CUDA graph, so it costs no host time at
replay. On the H100 the llama-1b start-up went from 56 s to 21 s cold and from 14 s to 7.5 s warm, at the same
decode speed.

`CompiledLayers.active()` routes a layer's calls to the compiled form for the duration of one forward (a decode
step, or a ragged prefill step once the decode step compiled them: `ModelRunner._prefill_layers`), on the calling
thread only, and restores the module afterwards. Another engine's step in another thread keeps running the model's
own code.

Two things make one compilation fit every layer and every batch bucket. Int attributes of modules (`layer_idx`) are
constants to Dynamo by default, which would compile one graph per layer; `allow_unspec_int_on_nn_module` lets the one
that differs between layers become an input. Where torch can be told which ints are dynamic
(`torch.compiler.config.dynamic_sources`), `layer_idx` is symbolic from the first compilation, so a layer's code is
compiled once; elsewhere it turns symbolic at the first recompilation (Dynamo's automatic dynamic), and the code is
compiled twice (the first layer, then the second). The batch dimension of the step's tensors is marked symbolic
before the first call. The final norm and rotary table are compiled once each.

A model whose layers come in more than `MAX_LAYER_KINDS` kinds (`layer_kind`: the classes and scalar attributes of
the submodules, the config's layer type), or with chunked attention (its size is looked up by layer index), has its
whole decode forward compiled as one graph instead, as does a model whose first compiled forward produced more
graphs than its kinds allow (a per-layer constant `layer_kind` did not see).

Where the rest of the compiled step lives: the default and its fallback (`hf_paged.engine.defaults`,
`ModelRunner._give_up_compiling`), the opaque attention op (`hf_paged.attention.compiled_op`), one GEMM for q/k/v
and gate/up, the residual fold and combo kernels (`hf_paged.runner.sibling_linears.fusing_backend`), the CUDA graphs
(`graphs`, `ragged_graphs`, `recording`) and compiled prefill (`ModelRunner._prefill_layers`).
`tests/test_compile_decode.py` checks on the CPU backend that every supported family compiles with no graph break
and no more graphs than its layer kinds allow (six layers compile as often as two), the whole-forward fallbacks,
transformers' greedy and beam tokens, and equality with the uncompiled static path under preemption, forks and
prefix hits; `tests/test_gpu.py` compares the compiled CUDA graphs with eager decoding on a GPU. No reference cycle
may hold an engine: `Engine.warm_up()` freezes the objects alive (`gc.freeze()`), so a cycle through the engine would
keep its pool forever; `BeamSearch` holds a weak proxy of the engine, and `Engine.close()` drops the pool, the graphs
and the compiled step.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch

from .sibling_linears import fusing_backend

__all__ = ["CompiledLayers", "MAX_LAYER_KINDS", "layer_kind", "own_code", "regional_layers", "repeated_layers",
           "top_level_modules"]


#: most distinct kinds of layer (e.g. sliding-window and full-attention layers) compiled regionally; a model whose
#: layers differ more (per-layer constants, chunked attention) has its whole decode forward compiled instead
MAX_LAYER_KINDS = 2
_SCALARS = (bool, int, float, str, type(None))


def layer_kind(layer: torch.nn.Module) -> tuple:
    """What Dynamo would specialise one layer's compiled code on, besides tensor shapes: every submodule's class and
    plain scalar attributes (`layer_idx` aside: it is made symbolic) and the config's type of its attention layer.
    Layers of one kind share one compiled graph."""
    parts = []
    for name, sub in layer.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(sub).items() if not k.startswith("_")
                             and k not in ("layer_idx", "training") and isinstance(v, _SCALARS)))
        idx = getattr(sub, "layer_idx", None)
        layer_types = getattr(getattr(sub, "config", None), "layer_types", None)
        attention = layer_types[idx] if isinstance(idx, int) and layer_types and 0 <= idx < len(layer_types) else None
        parts.append((name, type(sub).__qualname__, attrs, attention))
    return tuple(parts)


def regional_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated layers when compiling them one kind at a time pays: at most `MAX_LAYER_KINDS` kinds and no
    chunked attention (its size is looked up per layer index); else `[]`."""
    layers = repeated_layers(model)
    if not layers:
        return []
    kinds = {layer_kind(layer) for layer in layers}
    if len(kinds) > MAX_LAYER_KINDS or any(part[3] == "chunked_attention" for kind in kinds for part in kind):
        return []
    return layers


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The text decoder (transformers' `get_decoder()`), so that a vision tower's layers are never the ones picked."""
    try:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    except Exception:  # a bespoke model whose lookup raises: search the whole model
        return model
    return decoder if isinstance(decoder, torch.nn.Module) else model


def repeated_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's layers: the longest `ModuleList` of the text decoder whose every item holds an attention module
    (an int `layer_idx`), with at least two items; `[]` when the model has no such list."""
    best: list[torch.nn.Module] = []
    for module in _decoder(model).modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2 or len(module) <= len(best):
            continue
        if all(any(isinstance(getattr(m, "layer_idx", None), int) for m in item.modules()) for item in module):
            best = list(module)
    return best


#: modules outside the layers compiled as well (each alone, so one compilation each): a final RMSNorm is ~8 kernels
#: eager and the rotary table ~6, next to one or two compiled
_TOP_LEVEL_SUFFIXES = ("RMSNorm", "RotaryEmbedding")


def top_level_modules(model: torch.nn.Module, layers: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The text decoder's RMSNorm and rotary-embedding modules that are not inside `layers` (final norm, rotary)."""
    inside = {id(m) for layer in layers for m in layer.modules()}
    return [m for m in _decoder(model).modules()
            if id(m) not in inside and type(m).__name__.endswith(_TOP_LEVEL_SUFFIXES)]


def _mark_batch(values, batch: int) -> None:
    """Let the batch dimension of the decode step's tensors be symbolic from the first compilation: dimension 1 of
    `[1, B, ...]` tensors, dimension 0 of `[B]` ones (Dynamo would otherwise compile once more at the next bucket)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.dim() >= 2 and value.shape[1] == batch:
                torch._dynamo.maybe_mark_dynamic(value, 1)
            elif value.dim() == 1 and value.shape[0] == batch:
                torch._dynamo.maybe_mark_dynamic(value, 0)
        elif isinstance(value, (tuple, list)):
            _mark_batch(value, batch)


def _has_hooks(module: torch.nn.Module) -> bool:
    """Forward hooks would be skipped by calling the compiled `forward` directly: such a layer stays eager."""
    hooks = torch.nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks or hooks._global_forward_hooks
                or hooks._global_forward_pre_hooks)


#: Dynamo source names of the layers' `layer_idx` attributes (e.g. ``L['self']._modules['self_attn'].layer_idx``)
_LAYER_IDX_SOURCES = r".*\.layer_idx$"


def _layer_idx_dynamic():
    """Make `layer_idx` symbolic from the first compilation where torch can be told so
    (`torch.compiler.config.dynamic_sources`, torch >= 2.8): one compilation per kind of layer instead of two (the
    first layer with its index a constant, then the next with it symbolic). A no-op where the option is missing."""
    config = getattr(torch.compiler, "config", None)
    if config is None or "dynamic_sources" not in config.get_config_copy():
        return nullcontext()
    return config.patch(dynamic_sources=_LAYER_IDX_SOURCES)


class _RouteState:
    """What the routes read while `active()`: kept apart from `CompiledLayers`, so that the routes (closures) do not
    point back at the object holding them. A cycle there would be frozen by `Engine.warm_up`'s `gc.freeze()` and keep
    the model's weights alive after the user dropped it."""

    __slots__ = ("owner", "batch", "saved")

    def __init__(self, size: int) -> None:
        self.owner: int | None = None
        self.batch = 0
        self.saved: list = [None] * size  # what each module ran before `active()` (another thread keeps it)


def own_code(fn: types.FunctionType, name: str | None = None) -> types.FunctionType:
    """`fn` made again around a copy of its code object (named `name` when given).

    Why: Dynamo keeps a compiled function's cache on its code object, and its recompile limits with it (8 entries of
    one code object, 256 in all). Every engine compiled the same code (a decoder layer class's `forward`, the decode
    forward below), so the engines of one process shared one cache: from the ninth model shape on (a notebook or an
    evaluation that goes through models), Dynamo stopped compiling and the new engine's decode step ran the model's
    own code, as with `compile_decode=False`, with no error. A copy per compiled function gives each its own cache,
    dropped with it. (torch does the same for `debug_force_nested_calls`.)

    The name matters too: Dynamo's automatic-dynamic record of the sizes a frame has seen is kept per (file, line,
    name), not per code object, and a size that differs from the record compiles symbolic. Copies of one function
    under one name would pool the sizes of every module they serve."""
    code = fn.__code__.replace(co_name=name) if name else fn.__code__.replace()
    copy = types.FunctionType(code, fn.__globals__, name or fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = name or fn.__qualname__
    return copy


def _forward_entry(cls: type) -> Callable:
    """A function of its own code (`own_code`) that runs a module's `forward`: what `CompiledLayers` compiles, one per
    module class (the layers share one), instead of the module's `forward` itself. Compiling the bound `forward` would
    key the cache on transformers' code, shared by every engine; and a `forward` in a file Dynamo does not trace from
    (a `torch.no_grad()`-decorated rotary embedding's) is compiled through torch's one shared wrapper code for the
    whole process. Named after `cls` (`forward_of_LlamaDecoderLayer`), so that automatic dynamic shapes keep one
    record per class, as they did with the class's own `forward`, not one for every module class of the process."""

    def run_forward(module, *args, **kwargs):
        return module.forward(*args, **kwargs)

    return own_code(run_forward, f"forward_of_{cls.__name__}")


def _route(module: torch.nn.Module, compiled, state: _RouteState, i: int):
    def call(*args, **kwargs):
        if threading.get_ident() != state.owner or _has_hooks(module):
            return (state.saved[i] or module._call_impl)(*args, **kwargs)
        _mark_batch(args, state.batch)
        _mark_batch(kwargs.values(), state.batch)
        return compiled(module, *args, **kwargs)

    return call


class CompiledLayers:
    """The compiled `forward` of every decoder layer (one Dynamo cache per layer class, shared by its instances) and
    of the few modules outside them (`top_level_modules`)."""

    def __init__(self, layers: list[torch.nn.Module], extras: list[torch.nn.Module] | None = None) -> None:
        if not layers:
            raise ValueError("CompiledLayers needs at least one layer")
        self.layers = layers
        self.extras = list(extras or [])
        self.modules = self.layers + self.extras
        # graphs the first decode forward may compile: per kind of layer two at most (without `dynamic_sources`: the
        # first layer, its `layer_idx` still a constant, and the next, now symbolic); one per module outside the
        # layers. More means the layers differ in ways `layer_kind` did not see.
        self.max_graphs = 2 * len({layer_kind(layer) for layer in layers}) + len(self.extras)
        self._state = _RouteState(len(self.modules))
        entries: dict[type, Callable] = {}  # module class -> its compiled entry (one Dynamo cache each)
        self._routes = []
        for i, module in enumerate(self.modules):
            if type(module) not in entries:
                entries[type(module)] = torch.compile(_forward_entry(type(module)), backend=fusing_backend)
            self._routes.append(_route(module, entries[type(module)], self._state, i))

    @classmethod
    def of(cls, model: torch.nn.Module) -> CompiledLayers | None:
        """Compiled layers for `model`, or None when regional compilation does not fit it (`regional_layers`): then
        the whole decode forward is compiled."""
        layers = regional_layers(model)
        return cls(layers, top_level_modules(model, layers)) if layers else None

    @contextmanager
    def active(self, batch: int, extras: bool = True) -> Iterator[None]:
        """Within: this thread's calls of the modules run their compiled form (restored after); `batch` is the decode
        step's number of rows (the dimension compiled symbolic). `extras=False` routes the layers only: a prefill
        step's final norm and rotary table stay eager (a few kernels a step; their compiled forms are specialised on
        the decode step's inputs, views into its persistent buffers)."""
        state = self._state
        routed = len(self.modules) if extras else len(self.layers)
        modules = self.modules[:routed]
        state.saved = [module._compiled_call_impl for module in modules] + [None] * (len(self.modules) - routed)
        state.owner, state.batch = threading.get_ident(), batch
        for module, route in zip(modules, self._routes):
            module._compiled_call_impl = route
        try:
            with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True), _layer_idx_dynamic():
                yield
        finally:
            state.owner = None
            for module, previous in zip(modules, state.saved):
                module._compiled_call_impl = previous
            state.saved = [None] * len(self.modules)
