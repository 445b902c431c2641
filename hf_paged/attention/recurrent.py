"""Recurrent layers of hybrid models on the paged cache: each sequence's state in a slot, ragged steps without leaks.

transformers 5.x runs every hybrid family's recurrent mixer (gated DeltaNet in Qwen3.5 / Qwen3-Next / OLMo-Hybrid,
Mamba 2 in Granite 4 / Bamba / Falcon-H1 / Nemotron-H, Mamba in Jamba, the short convolution of LFM2) through one
cache API: ``cache.has_previous_state(layer_idx)``, ``cache.layers[layer_idx].conv_states[i]`` /
``.recurrent_states[i]`` and ``cache.update_conv_state`` / ``cache.update_recurrent_state``, with one batch row per
sequence. The engine's steps are one packed ``[1, T]`` row holding many sequences (prefill chunks and decodes), whose
states live in a slot pool (`hf_paged.cache.state_pool`); run as one row, one sequence's tokens would flow into
the next one's state through the convolution and the scan.

So `install` wraps the `forward` of every such mixer module (per instance; the model's own projections, weights and
code run unchanged) with `_mixer_forward`, which, when the cache is a `PagedCache`, calls the module's own forward
once per group of rows that form a proper batch, each time with a `_StateView`: a stand-in cache that gathers the
group's slots from the pool, answers the calls above for exactly those rows, and scatters the new states back:

* the rows that decode one token with a state (every row of a decode step): one call, ``[B, 1, H]``;
* each prefill chunk: one call of its own, ``[1, n, H]``, starting from its slot's state when the sequence has
  computed tokens before (a chunked prefill, a prefix-cache hit restored from a checkpoint), else from nothing;
* the drop-in cache's padded batches (transformers' own `generate()`): one call for the whole batch, the padding mask
  passed through, as transformers runs it.

Anything else (no cache, a `DynamicCache`) goes straight to the module's own forward.

Pure recurrent models (Mamba, FalconMamba: Mamba 1 mixers, no attention layer) take their cache as ``cache_params``,
not ``past_key_values``, and ignore the latter (building a `DynamicCache` of their own). `install` hooks such a model so
that a `PagedCache` handed as ``past_key_values`` (what the engine's runner passes every model) reaches it as
``cache_params`` (`cache_argument`). Their mixers' decode path updates the gathered states in place
(``causal_conv1d_update``, ``selective_state_update``), which `_StateView.commit` writes back like any other state.

Two families keep their state outside those calls (`hf_paged.attention.recurrent_families`): MiniMax's lightning
attention asks its cache for it by ``get_linear_cache`` / ``set_linear_cache``, which `_StateView` answers too (its
model gets a pre-hook: it accepts no cache but its own otherwise); RecurrentGemma's recurrent block keeps it in module
attributes, which a state binding fills from the view before the block's own forward and empties into it after, the
group's ``position_ids`` passed along (`_take`).
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

import torch

from ..cache import PagedCache
from ..kernels.gated_delta import gdn_decode
from . import gated_deltanet, mamba2, recurrent_families
from .compiled_op import active_state_pool

__all__ = ["install", "uninstall", "mixer_modules", "is_mixer_class", "cache_argument"]

_KINDS = ("conv", "recurrent")  # the kinds of state a layer keeps (`hf_paged.cache.state_pool.StateKey`)
# the cache calls of a recurrent mixer (MiniMax's lightning attention keeps its K^T V state by `set_linear_cache`)
_RECURRENT_CALLS = ("update_conv_state", "update_recurrent_state", "set_linear_cache")
_CACHE_ARGS = ("cache_params", "past_key_values")
# per-token keyword arguments of a packed batch that a per-sequence call must not receive whole
_PER_TOKEN_KWARGS = ("position_ids", "cache_position", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                     "max_length_k", "seq_idx", "position_embeddings")


@functools.cache
def _call_layout(cls: type) -> tuple[tuple[str, ...], str | None] | None:
    """(positional parameter names of `cls.forward` after self, the cache argument's name), or None when `cls` is no
    recurrent mixer of transformers' cache API."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None
    bound = recurrent_families.binding(cls)  # (a family whose mixer keeps its state elsewhere: RecurrentGemma)
    if bound is None and not any(call in source for call in _RECURRENT_CALLS):
        return None
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    cache_arg = bound.cache_arg if bound is not None else next((n for n in _CACHE_ARGS if n in names), None)
    if cache_arg is None or not names:
        return None
    return names, cache_arg


@functools.cache
def _required_params(cls: type) -> tuple[str, ...]:
    """Parameters of `cls.forward` without a default (MiniMax's lightning attention requires `position_embeddings`
    and `attention_mask`, which it does not read): a call that leaves one out passes None."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                 and p.default is inspect.Parameter.empty)


def is_mixer_class(cls: type) -> bool:
    """Whether `cls` is a recurrent mixer that keeps its state through transformers' cache API (see the module doc)."""
    return _call_layout(cls) is not None


def mixer_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The recurrent mixer modules of `model` (those `install` wraps), in module order."""
    return [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int) and is_mixer_class(type(m))]


@functools.cache
def _takes_cache_params(cls: type) -> bool:
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False
    return "cache_params" in params and "past_key_values" not in params


def cache_argument(model: torch.nn.Module) -> str:
    """The name under which `model`'s forward takes its cache: ``cache_params`` (Mamba, FalconMamba) or
    ``past_key_values``."""
    return "cache_params" if _takes_cache_params(type(model)) else "past_key_values"


def _paged_cache_as_cache_params(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a model whose forward takes ``cache_params``: a `PagedCache` passed as ``past_key_values``
    (the runner's call) goes there instead (the model would otherwise ignore it)."""
    if isinstance(kwargs.get("past_key_values"), PagedCache) and kwargs.get("cache_params") is None:
        kwargs = dict(kwargs)
        kwargs["cache_params"] = kwargs.pop("past_key_values")
        return args, kwargs
    return None


def install(model: torch.nn.Module) -> int:
    """Wrap every recurrent mixer's forward (idempotent); returns how many modules are wrapped."""
    if cache_argument(model) == "cache_params" and "_hf_paged_cache_hook" not in model.__dict__:
        model._hf_paged_cache_hook = model.register_forward_pre_hook(_paged_cache_as_cache_params, with_kwargs=True)
    for module in model.modules():  # families whose model code needs a word first (`recurrent_families`)
        hook = recurrent_families.model_hook(type(module))
        if hook is not None and "_hf_paged_family_hook" not in module.__dict__:
            module._hf_paged_family_hook = module.register_forward_pre_hook(hook, with_kwargs=True)
    for name, module in model.named_modules():  # a bound mixer given no layer index gets its decoder layer's
        if (recurrent_families.binding(type(module)) is not None
                and not isinstance(getattr(module, "layer_idx", None), int)):
            module.layer_idx = recurrent_families.layer_index(name, module)
            module._hf_paged_layer_alias = True
    count = 0
    for module in mixer_modules(model):
        if "_hf_paged_forward" not in module.__dict__:
            module._hf_paged_forward = module.forward  # what the instance ran before (a bound method, or a hook's)
            module._hf_paged_layout = _call_layout(type(module))  # (read in the compiled step: no source lookups)
            module._hf_paged_required = _required_params(type(module))
            module._hf_paged_binding = recurrent_families.binding(type(module))
            module.forward = types.MethodType(_mixer_forward, module)
            gated_deltanet.install(module)  # Qwen3.5's layout: one call a step on the GPU
            mamba2.install(module)  # Granite 4 / Bamba / Falcon-H1 / Nemotron-H: one call a step on the GPU
        count += 1
    return count


def uninstall(model: torch.nn.Module) -> None:
    """Undo `install`."""
    hook = model.__dict__.pop("_hf_paged_cache_hook", None)
    if hook is not None:
        hook.remove()
    for module in model.modules():
        family_hook = module.__dict__.pop("_hf_paged_family_hook", None)
        if family_hook is not None:
            family_hook.remove()
        original = module.__dict__.pop("_hf_paged_forward", None)
        for name in ("_hf_paged_layout", "_hf_paged_required", "_hf_paged_binding"):
            module.__dict__.pop(name, None)
        module.__dict__.pop("_hf_paged_state_layout", None)
        if module.__dict__.pop("_hf_paged_layer_alias", False):
            module.__dict__.pop("layer_idx", None)
        gated_deltanet.uninstall(module)
        mamba2.uninstall(module)
        if original is not None:
            if isinstance(original, types.MethodType) and original.__func__ is type(module).forward:
                module.__dict__.pop("forward", None)
            else:
                module.forward = original


def _mixer_forward(module: torch.nn.Module, *args, **kwargs):
    """The installed forward: a `PagedCache` step through `_run_paged`, anything else to the module's own forward."""
    names, cache_arg = module._hf_paged_layout
    call = dict(zip(names, args))
    call.update(kwargs)
    cache = call.get(cache_arg)
    if not isinstance(cache, PagedCache):
        return module._hf_paged_forward(*args, **kwargs)
    run = _Call(module, names[0], cache_arg, call)
    out = _run_paged(cache, run)
    # a mixer that returns `(output, weights)` (MiniMax's lightning attention) gets its tuple back, weights None
    return (out, *([None] * run.extra)) if run.extra else out


def _run_paged(cache: PagedCache, call: _Call) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """One mixer's part of a forward over the paged cache: its own code over each group of rows (module doc)."""
    hidden = call.hidden_states
    layer = call.layer_idx
    # inside the compiled decode step the runner has set the step (no bookkeeping may run in the graph), and the
    # states go through opaque ops (`_StateView`)
    compiled = getattr(call.module, "_hf_paged_state_layout", None) if torch.compiler.is_compiling() else None
    step = cache._step if compiled is not None else cache.enter_recurrent_layer(layer, hidden)
    pool = cache.states.pool
    if step.layout == "padded":  # the drop-in cache: transformers' own batch, its padding mask included
        return call.run(hidden, _StateView(layer, pool, step.state_slots, step.state_prev), call.attention_mask)
    tokens = hidden.shape[1]
    rows = step.state_rows
    fast = gated_deltanet.applies(call.module, hidden) or mamba2.applies(call.module, hidden)
    if fast is not None:  # Qwen3.5's gated DeltaNet or a Mamba 2 mixer on the GPU: every row of the step in one call
        if rows is None:
            return fast.decode(call.module, hidden[0], step.state_slots[:tokens], pool, compiled is not None)[None]
        return fast.ragged(call.module, hidden[0], rows, step.state_slots, pool)[None]
    if rows is None:  # a decode-only step on the static buffers: every row decodes from its slot
        view = _StateView(layer, pool, step.state_slots[:tokens], True, compiled)
        return _each(call.run(_take(hidden, _EACH), view, packed=True, where=_EACH),
                     lambda x: x.view(1, tokens, *x.shape[2:]))
    if compiled is not None:
        raise RuntimeError("hf-paged: a hybrid model's ragged step ran through the compiled layers (they compile its "
                           "decode steps only)")
    decode = [i for i, (_, n, prev) in enumerate(rows) if n == 1 and prev]
    if len(decode) == len(rows) == tokens:  # (an eager decode step: rows are the sequences, in order)
        view = _StateView(layer, pool, step.state_slots, True)
        return _each(call.run(_take(hidden, _EACH), view, packed=True, where=_EACH),
                     lambda x: x.view(1, tokens, *x.shape[2:]))
    pieces: list[tuple[torch.Tensor | slice, Any]] = []
    if decode:
        index = torch.tensor(decode, dtype=torch.long, device=hidden.device)
        at = torch.tensor([rows[i][0] for i in decode], dtype=torch.long, device=hidden.device)
        view = _StateView(layer, pool, step.state_slots.index_select(0, index), True)
        pieces.append((at, _each(call.run(_take(hidden, at), view, packed=True, where=at), lambda x: x[:, 0])))
    chosen = set(decode)
    by_token = getattr(call.module, "_hf_paged_token_chunks", False)
    for i, (first, n, prev) in enumerate(rows):
        if i in chosen:
            continue
        if prev and n > 1 and by_token:  # a mixer whose multi-token form starts from zero: one token at a time
            outs = [_each(call.run(hidden[:, t : t + 1], _StateView(layer, pool, step.state_slots[i : i + 1], True),
                                   packed=True, where=slice(t, t + 1)), lambda x: x[0]) for t in range(first, first + n)]
            pieces.append((slice(first, first + n), _each(tuple(zip(*outs)) if isinstance(outs[0], tuple) else outs,
                                                          torch.cat, whole=True)))
            continue
        view = _StateView(layer, pool, step.state_slots[i : i + 1], prev)
        where = slice(first, first + n)
        pieces.append((where, _each(call.run(hidden[:, where], view, packed=True, where=where), lambda x: x[0])))
    first_out = pieces[0][1]
    if len(pieces) == 1 and isinstance(pieces[0][0], slice) and _first(first_out).shape[0] == tokens:
        return _each(first_out, lambda x: x[None])
    outputs = []
    for part in range(len(first_out) if isinstance(first_out, tuple) else 1):
        ref = first_out[part] if isinstance(first_out, tuple) else first_out
        out = ref.new_zeros((tokens, *ref.shape[1:]))  # padding rows (a token grid) stay zero
        for where, piece in pieces:
            piece = piece[part] if isinstance(piece, tuple) else piece
            if isinstance(where, slice):
                out[where] = piece
            else:
                out.index_copy_(0, where, piece)
        outputs.append(out[None])
    return tuple(outputs) if isinstance(first_out, tuple) else outputs[0]


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _each(out, fn, whole: bool = False):
    """`fn` over a mixer's output: its tensor, or each tensor of a tuple (Zaya's CCA projection returns its query, key
    and value, each `[B, L, ...]`). `whole`: `out` is a list of per-token pieces (or a tuple of such lists)."""
    if isinstance(out, tuple):
        return tuple(fn(list(t) if whole else t) for t in out)
    return fn(out)


def per_token_outputs(out, hidden: torch.Tensor) -> bool:
    """Whether a mixer's tuple holds outputs per token, each kept (Zaya's CCA projection: its query, key and value,
    each `[B, L, ...]`), rather than its output and extras the caller drops (MiniMax's lightning attention: the
    output and its new state, `[B, heads, d, d]`): every entry a tensor of the input's `[B, L]` and one rank."""
    return isinstance(out, tuple) and bool(out) and all(
        isinstance(t, torch.Tensor) and t.shape[:2] == hidden.shape[:2] and t.dim() == out[0].dim() for t in out)


_EACH = "each"  # every token of the packed row its own batch row (a decode step)


def _take(x: torch.Tensor, where: torch.Tensor | slice | str) -> torch.Tensor:
    """The rows of a group out of the packed ``[1, T, ...]`` row: a chunk (`slice`: ``[1, n, ...]``), decoding tokens
    (an index tensor: ``[B, 1, ...]``) or every token its own row (`_EACH`: ``[T, 1, ...]``)."""
    if isinstance(where, slice):
        return x[:, where]
    if isinstance(where, torch.Tensor):
        return x[0].index_select(0, where)[:, None]
    return x.view(x.shape[1], 1, *x.shape[2:])


class _Call:
    """One call of a mixer's own forward, re-issued over groups of rows with a `_StateView` as the cache."""

    def __init__(self, module: torch.nn.Module, hidden_name: str, cache_arg: str, call: dict[str, Any]) -> None:
        self.module = module
        self.layer_idx = module.layer_idx  # (symbolic in the compiled step: never made an int here)
        self.hidden_name = hidden_name
        self.cache_arg = cache_arg
        self.call = call
        self.extra = 0  # how many outputs the module's forward returns beside its output tensor
        self.binding = module._hf_paged_binding  # (set by `install`: no lookups in the compiled step)

    @property
    def hidden_states(self) -> torch.Tensor:
        return self.call[self.hidden_name]

    @property
    def attention_mask(self) -> torch.Tensor | None:
        return self.call.get("attention_mask")

    def run(self, hidden: torch.Tensor, view: _StateView, attention_mask: torch.Tensor | None = None,
            packed: bool = False, where: torch.Tensor | slice | str | None = None
            ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The module's own forward over `hidden` with `view` as its cache; `packed`: the rows come out of a packed
        step (`where` in it, see `_take`), so per-token keyword arguments of the whole step are left out, except the
        positions a bound mixer reads (taken at `where`)."""
        call = dict(self.call)
        call[self.hidden_name] = hidden
        call[self.cache_arg] = view
        if "attention_mask" in call or attention_mask is not None:
            call["attention_mask"] = attention_mask
        if packed:
            for name in _PER_TOKEN_KWARGS:
                call.pop(name, None)
            positions = self.call.get("position_ids")
            if self.binding is not None and self.binding.positions and positions is not None:
                call["position_ids"] = _take(positions, where)
        for name in self.module._hf_paged_required:
            call.setdefault(name, None)
        out = _bound_forward(self.module._hf_paged_forward, call, self.hidden_name, self.cache_arg, view, self.binding,
                             self.module)
        if per_token_outputs(out, hidden):  # (Zaya: query, key and value, each kept)
            return view.commit(out)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):  # (output, weights or state)
            self.extra = len(out) - 1
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"hf-paged: {type(self.module).__name__}.forward returned {type(out).__name__}; the "
                            "recurrent adapter handles mixers that return their output tensor (or a tuple of them)")
        return view.commit(out)


class _LayerStates:
    """What a mixer reads off `cache.layers[layer_idx]`: its states (by state index) and flags."""

    __slots__ = ("conv_states", "recurrent_states", "has_previous_state", "record_past", "conv_kernel_size")

    def __init__(self) -> None:
        self.conv_states: dict[int, torch.Tensor] = {}
        self.recurrent_states: dict[int, torch.Tensor] = {}
        self.has_previous_state: dict[int, bool] = {}
        self.record_past = False  # speculative-decoding rollback: not used by hf-paged
        self.conv_kernel_size: dict[int, int] = {}


class _Layers:
    """`cache.layers` of a `_StateView`: whatever index the mixer asks for (its own), its states."""

    __slots__ = ("states",)

    def __init__(self, states: _LayerStates) -> None:
        self.states = states

    def __getitem__(self, layer_idx) -> _LayerStates:
        return self.states


class _StateView:
    """A stand-in cache for one call of one mixer: the states of `slots` (gathered from the pool), or none when the
    rows start fresh; `commit(out)` writes what the call left back to the slots.

    It implements what transformers' `LinearAttentionLayer` does for the calls recurrent mixers make (the padding of
    a first convolution window, the concatenation with the previous one, keeping the last `conv_kernel_size`).
    `pool` None: a recording view (`profile_state_specs`), whose commit keeps the states' shapes and dtypes.
    `compiled`: the layer's state layout (`_hf_paged_state_layout`, from `profile_state_specs`) when the call is
    traced in the compiled decode step: the states go through the opaque ops `hf_paged::gather_state` and
    `hf_paged::commit_states`, so the pool is no graph input and the layer index stays symbolic.
    """

    def __init__(self, layer_idx, pool, slots: torch.Tensor | None, has_previous: bool,
                 compiled: list | None = None) -> None:
        self.layer_idx = layer_idx
        self._pool = pool
        self._slots = slots
        self._compiled = compiled
        self._initial = has_previous
        states = _LayerStates()
        self.layers = _Layers(states)
        self.recorded: dict[tuple[int, str, int], torch.Tensor] = {}
        if pool is None or not has_previous:
            return
        if compiled is not None:
            keys = [(layer_idx, kind, index, shape, dtype) for kind, index, shape, dtype in compiled]
        else:
            keys = [(*key, None, None) for key in pool.specs if key[0] == layer_idx]
        for _, kind, index, shape, dtype in keys:
            if compiled is not None:
                tensor = torch.ops.hf_paged.gather_state(slots, layer_idx, kind, index, list(shape), dtype)
            else:
                tensor = pool.tensors[(layer_idx, kind, index)].index_select(0, slots)
            (states.conv_states if kind == "conv" else states.recurrent_states)[index] = tensor
            if kind == "conv":
                states.has_previous_state[index] = True
                states.conv_kernel_size[index] = tensor.shape[-1]

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        flags = self.layers.states.has_previous_state
        if state_idx is None:
            return all(flags.values()) if flags else self._initial
        return flags.get(state_idx, self._initial)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        states = self.layers.states
        kernel = states.conv_kernel_size.get(state_idx)
        if kernel is None:
            kernel = conv_kernel_size if conv_kernel_size is not None else conv_states.shape[-1]
            states.conv_kernel_size[state_idx] = kernel
        previous = states.conv_states.get(state_idx)
        if not states.has_previous_state.get(state_idx, False) or previous is None:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
            states.has_previous_state[state_idx] = True
        else:
            full = torch.cat([previous.to(conv_states.dtype), conv_states], dim=-1)
        states.conv_states[state_idx] = full[..., -kernel:]
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        states = self.layers.states
        previous = states.recurrent_states.get(state_idx)
        if previous is not None and previous.dtype != recurrent_states.dtype:
            recurrent_states = recurrent_states.to(previous.dtype)  # transformers keeps the first state's dtype
        states.recurrent_states[state_idx] = recurrent_states
        return recurrent_states

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        """MiniMax's lightning attention (`MiniMaxCache`'s call): its K^T V state, None when the rows start fresh
        (the mixer then runs its blocked prefill from zeros, else its token-by-token recurrence from the state)."""
        return self.layers.states.recurrent_states.get(0)

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        self.update_recurrent_state(linear_cache, layer_idx)

    def commit(self, out: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Write the states the call left to the slots; returns `out` (in the compiled step, through the op that
        writes, so the write is never dropped as dead code nor moved after a later read; a tuple's first tensor)."""
        states = self.layers.states
        items = [(kind, index, tensor) for kind, tensors in (("conv", states.conv_states),
                                                             ("recurrent", states.recurrent_states))
                 for index, tensor in tensors.items()]
        if self._pool is None:
            self.recorded.update({(self.layer_idx, kind, index): tensor for kind, index, tensor in items})
            return out
        if self._compiled is not None:
            written = torch.ops.hf_paged.commit_states(_first(out), [t for _, _, t in items], self._slots,
                                                       self.layer_idx, [_KINDS.index(k) for k, _, _ in items],
                                                       [i for _, i, _ in items])
            return (written, *out[1:]) if isinstance(out, tuple) else written
        for kind, index, tensor in items:
            target = self._pool.ensure((self.layer_idx, kind, index), tensor)
            target.index_copy_(0, self._slots, tensor.to(target.dtype))
        return out


@torch.library.custom_op("hf_paged::gather_state", mutates_args=())
def gather_state(slots: torch.Tensor, layer_idx: int, kind: str, index: int, shape: list[int],
                 dtype: torch.dtype) -> torch.Tensor:
    """The states `(layer_idx, kind, index)` of `slots`, read from the active cache's pool (the compiled step)."""
    return active_state_pool().tensors[(layer_idx, kind, index)].index_select(0, slots)


@gather_state.register_fake
def _(slots, layer_idx, kind, index, shape, dtype):
    return slots.new_empty((slots.shape[0], *shape), dtype=dtype)


@torch.library.custom_op("hf_paged::commit_states", mutates_args=())
def commit_states(out: torch.Tensor, values: list[torch.Tensor], slots: torch.Tensor, layer_idx: int,
                  kinds: list[int], indices: list[int]) -> torch.Tensor:
    """Write a layer's new states (`kinds`: indices into `_KINDS`) to `slots` of the active cache's pool; returns a
    copy of `out` (the layer's output, which the rest of the step reads: that keeps this op in the graph, in order)."""
    pool = active_state_pool()
    for value, kind, index in zip(values, kinds, indices):
        target = pool.tensors[(layer_idx, _KINDS[kind], index)]
        target.index_copy_(0, slots, value.to(target.dtype))
    return out.clone()


@commit_states.register_fake
def _(out, values, slots, layer_idx, kinds, indices):
    return torch.empty_like(out)


@torch.library.custom_op("hf_paged::gdn_decode_slots", mutates_args=())
def gdn_decode_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     slots: torch.Tensor, layer_idx: int, scale: float) -> torch.Tensor:
    """`kernels.gated_delta.gdn_decode` on layer `layer_idx`'s delta-rule states in the active cache's pool (updated in place):
    the compiled decode step of a gated DeltaNet layer (`gated_deltanet`)."""
    return gdn_decode(q, k, v, g, beta, active_state_pool().tensors[(layer_idx, "recurrent", 0)], slots, scale)


@gdn_decode_slots.register_fake
def _(q, k, v, g, beta, slots, layer_idx, scale):
    return torch.empty_like(v)


def _bound_forward(forward, call: dict, hidden_name: str, cache_arg: str, view: _StateView,
                   bound: recurrent_families.Binding | None, module: torch.nn.Module):
    """`forward(**call)`; a bound mixer (`bound`, `recurrent_families`) gets `view`'s states where it keeps them
    first, and they are taken back into `view` after it."""
    if bound is None:
        return forward(**call)
    passed = bound.load(module, view.layers.states, call[hidden_name])
    if passed is not None:
        call[cache_arg] = passed
    try:
        return forward(**call)
    finally:
        bound.store(module, passed, view.layers.states)
