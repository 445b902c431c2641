"""A fast path for the Mamba 2 mixers of hybrid models (Granite 4 hybrid, Bamba, Falcon-H1, Nemotron-H) on the GPU:
one call per layer and step for every row, states read from and written to their slots once.

The generic adapter (`hf_paged.attention.recurrent`) runs the mixer's own forward once per prefill chunk (a call per
sequence and layer in a step) plus once for the decoding rows, each time gathering and scattering the states; on a
GPU that makes a prefill step host-bound, and transformers' torch `mamba2_chunk_scan` (what runs without mamba_ssm)
is slow. This path keeps the module's own `in_proj`, convolution weights, `dt_bias`, `A_log`, `D`, gated norm and
`out_proj`, and reproduces the family's forward (transformers 5.17) for all rows of a step at once:

* the projection (Falcon-H1: its input multiplier and `mup_vector` first), split into gate, conv input and `dt`;
* the depthwise causal convolution over each sequence's rows from its convolution state, then the activation
  (`varlen.ragged_conv`, shared with `gated_deltanet`); the new convolution states go to the slots;
* decode rows (one token with a state): `kernels.mamba2_decode` over all of them in one call, transformers'
  `mamba2_selective_state_update` (`dt` not clamped there, as transformers does) on each state in its slot, read
  once and written once (Triton on CUDA);
* prefill chunks: the SSD scan over all chunks in one variable-length call, from each chunk's state (its slot's, or
  zeros). Mamba 2 is a scalar-gated linear recurrence per head, so on CUDA it is flash-linear-attention's
  `chunk_simple_gla` with `cu_seqlens`: q = C, k = B (groups repeated to the heads), v = x * dt, g = dt * A,
  scale 1, states `[K, V]` = transformers' `[head_dim, state]` transposed; `dt = softplus(dt + dt_bias)` clamped to
  `time_step_limit` as transformers' chunk scan does, and the `D * x` skip added after. Elsewhere (the CPU, no fla)
  `kernels.reference_gla` runs the same contract in torch;
* the gate: the module's gated norm (Falcon-H1 without `mamba_rms_norm`: `silu(gate)`), then `out_proj`.

Decode-only steps over the static buffers (what CUDA graphs record, eager or compiled) run `decode`: the same
pieces for one token a row; traced in the compiled step, the convolution states go through the opaque ops
(`recurrent.gather_state`, `commit_states`) and the recurrent update through `mamba2_decode_slots`, so Dynamo never
sees the pool written in place. The module's own decode form would do the same work, but Falcon-H1's
gated norm (`mamba_rms_norm`, what its checkpoints use) squeezes a one-token batch `[B, 1, I]` to `[B, I]`, which
breaks it for more than one row (transformers' own batched generate too); here the norm gets `[B, I]` rows.

It is installed (`install`, from `recurrent.install`) only on those four classes of transformers whose layout
`Mamba2Path.supports` checks, and used on CUDA (`FORCE`: on the CPU too, for the tests).

transformers clamps `dt` in its chunk scan but not in its one-token update, and this path does the same, so where a
model's `time_step_limit` bites, tokens that transformers' generate() decoded one at a time come out otherwise when
they are prefilled (a sequence recomputed after preemption, a forward over a sampled sequence): as with the generic
adapter, which runs transformers' own code.

fla's kernels for this call do not specialise on the step's token count (``do_not_specialize=['T']``) and autotune by
heads and head sizes only (fla-core 0.6.0), so `warm_up` runs the call a few times per layer shape at the engine's
warm-up: the compilation and autotuning then happen there, not in the first serving step.
`tests/test_mamba2_fast.py` runs this path on the CPU against transformers' tokens and chunk scan.
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ..kernels.mamba2_decode import mamba2_decode
from ..kernels.reference_gla import chunk_simple_gla_reference
from .compiled_op import active_state_pool
from .varlen import Sequences, enabled, fla_function, ragged_conv, run_packed

__all__ = ["FORCE", "Mamba2Path", "applies", "install", "mamba2_decode_slots", "reference_scan", "uninstall",
           "warm_up"]

FORCE = False  # run the fast path on the CPU too (tests)
# the mixers whose forward this path reproduces (read in transformers 5.17), by class and modeling module
_FAMILIES = {
    "BambaMixer": "transformers.models.bamba.modeling_bamba",
    "GraniteMoeHybridMambaLayer": "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
    "FalconH1Mixer": "transformers.models.falcon_h1.modeling_falcon_h1",
    "NemotronHMamba2Mixer": "transformers.models.nemotron_h.modeling_nemotron_h",
}
_ATTRIBUTES = ("in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj", "num_heads", "head_dim", "n_groups",
               "ssm_state_size", "intermediate_size", "conv_dim", "conv_kernel_size", "activation", "time_step_limit",
               "layer_idx")
_FALCON = ("mup_vector", "ssm_in_multiplier", "mamba_rms_norm")


class Mamba2Path:
    """The fast path of one Mamba 2 mixer module (module docstring)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.act = ACT2FN[module.activation]
        self.falcon = type(module).__name__ == "FalconH1Mixer"
        self.limit = (float(module.time_step_limit[0]), float(module.time_step_limit[1]))

    @staticmethod
    def supports(module: torch.nn.Module) -> bool:
        """Whether `module` is one of the mixers this path reproduces, with the layout it reads."""
        cls = type(module)
        if _FAMILIES.get(cls.__name__) != cls.__module__ or not all(hasattr(module, a) for a in _ATTRIBUTES):
            return False
        if cls.__name__ == "FalconH1Mixer" and not all(hasattr(module, a) for a in _FALCON):
            return False
        conv, heads, groups = module.conv1d, module.num_heads, module.n_groups
        return (conv.groups == conv.in_channels == module.conv_dim and conv.kernel_size[0] == module.conv_kernel_size
                and module.conv_dim == module.intermediate_size + 2 * groups * module.ssm_state_size
                and heads * module.head_dim == module.intermediate_size and heads % groups == 0
                and module.in_proj.out_features == module.intermediate_size + module.conv_dim + heads
                and hasattr(sys.modules[cls.__module__], "mamba2_selective_state_update"))

    def _project(self, module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate `[T, I]`, conv input `[T, C]`, dt `[T, H]`): the module's own projection of `hidden` `[T, H]`."""
        if self.falcon:  # Falcon-H1's multipliers, before and after the projection
            hidden = hidden * module.ssm_in_multiplier
        projected = module.in_proj(hidden)
        if self.falcon:
            projected = projected * module.mup_vector.reshape(-1)
        return projected.split([module.intermediate_size, module.conv_dim, module.num_heads], dim=-1)

    def ragged(self, module, hidden: torch.Tensor, rows: list[tuple[int, int, bool]], state_slots: torch.Tensor,
               pool) -> torch.Tensor:
        """All sequences of a ragged step (`hidden` `[T, H]`, `rows` = (first row, tokens, continues a state)); rows
        of no sequence (a CUDA step's token grid pads the step) get zeros. Returns `[T, H]`."""
        packed = run_packed(lambda h, r: self.ragged(module, h, r, state_slots, pool), hidden, rows)
        if packed is not None:  # padding rows (a CUDA step's token grid) or rows out of order: run on them packed
            return packed
        layer = module.layer_idx
        device = hidden.device
        seqs = Sequences(rows, device)
        state_pool = pool.tensors[(layer, "recurrent", 0)]
        gate, xbc, dt = self._project(module, hidden)
        xbc = self.act(ragged_conv(xbc, module.conv1d.weight[:, 0], module.conv1d.bias,
                                   pool.tensors[(layer, "conv", 0)], state_slots, seqs))
        tokens, heads, groups, size = hidden.shape[0], module.num_heads, module.n_groups, module.ssm_state_size
        x, b, c = xbc.split([module.intermediate_size, groups * size, groups * size], dim=-1)
        x = x.reshape(tokens, heads, module.head_dim)
        b, c = b.reshape(tokens, groups, size), c.reshape(tokens, groups, size)
        out = torch.zeros(tokens, module.intermediate_size, dtype=hidden.dtype, device=device)
        decoding = seqs.decoding
        if decoding.any():
            which = np.flatnonzero(decoding)
            pick = torch.as_tensor(seqs.rows_of(which), device=device)
            slots = state_slots[torch.as_tensor(which, device=device)]
            y = mamba2_decode(x[pick], dt[pick], _decay(module), b[pick], c[pick], module.D, module.dt_bias,
                              state_pool, slots)
            out.index_copy_(0, pick, self._gate(module, y.reshape(len(pick), -1), gate[pick]).to(out.dtype))
        chunks = np.flatnonzero(~decoding)
        if len(chunks):
            rows, y = self._prefill(module, x, dt, b, c, chunks, seqs, state_slots, state_pool)
            out.index_copy_(0, rows, self._gate(module, y.reshape(len(rows), -1), gate[rows]).to(out.dtype))
        return module.out_proj(out)

    def _gate(self, module, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The module's gated norm of the scan's output `y` `[n, I]` (Falcon-H1 without `mamba_rms_norm`: the gate
        alone), applied to decode rows and prefill rows apart: transformers gives its norm the one-token update's
        output in the model's dtype and the chunk scan's in float32, and the norm rounds to its input's dtype."""
        if self.falcon and not module.mamba_rms_norm:
            return y * F.silu(gate)
        return module.norm(y, gate)

    def decode(self, module, hidden: torch.Tensor, slots: torch.Tensor, pool, compiled: bool) -> torch.Tensor:
        """A decode-only step over the static buffers (what CUDA graphs record): rows `hidden` `[B, H]` each decoding
        one token from its slot's states; returns `[B, H]`. `compiled`: traced in the compiled step, the states go
        through the opaque ops (`recurrent.gather_state` with the layer's state layout (`_hf_paged_state_layout`),
        `mamba2_decode_slots`, `commit_states`)."""
        layer = module.layer_idx
        gate, xbc, dt = self._project(module, hidden)
        if compiled:
            shape, dtype = next((shape, dtype) for kind, index, shape, dtype in module._hf_paged_state_layout
                                if kind == "conv" and index == 0)
            conv_state = torch.ops.hf_paged.gather_state(slots, layer, "conv", 0, list(shape), dtype)
        else:
            conv_state = pool.tensors[(layer, "conv", 0)].index_select(0, slots)
        window = torch.cat([conv_state[:, :, 1:].to(xbc.dtype), xbc[:, :, None]], dim=-1)  # the last K inputs
        conv = (window.float() * module.conv1d.weight[:, 0].float()).sum(-1)
        if module.conv1d.bias is not None:
            conv = conv + module.conv1d.bias.float()
        rows, heads, groups, size = hidden.shape[0], module.num_heads, module.n_groups, module.ssm_state_size
        x, b, c = self.act(conv.to(xbc.dtype)).split([module.intermediate_size, groups * size, groups * size], -1)
        args = (x.reshape(rows, heads, module.head_dim), dt, _decay(module), b.reshape(rows, groups, size),
                c.reshape(rows, groups, size), module.D, module.dt_bias)
        if compiled:
            y = torch.ops.hf_paged.mamba2_decode_slots(*args, slots, layer)
            out = module.out_proj(self._gate(module, y.reshape(rows, -1), gate).to(hidden.dtype))
            return torch.ops.hf_paged.commit_states(out, [window], slots, layer, [0], [0])
        conv_pool = pool.tensors[(layer, "conv", 0)]
        conv_pool.index_copy_(0, slots, window.to(conv_pool.dtype))
        y = mamba2_decode(*args, pool.tensors[(layer, "recurrent", 0)], slots)
        return module.out_proj(self._gate(module, y.reshape(rows, -1), gate).to(hidden.dtype))

    def _prefill(self, module, x, dt, b, c, chunks, seqs: Sequences, state_slots,
                 state_pool) -> tuple[torch.Tensor, torch.Tensor]:
        """The SSD scan over the prefill chunks `chunks`, each from its state; new states into the pool. Returns (the
        chunks' rows, their output `[t, heads, head_dim]` float32, the `D * x` skip added, as transformers' scan)."""
        device = x.device
        which = torch.as_tensor(chunks, device=device)
        slots = state_slots[which]
        initial = state_pool.index_select(0, slots).float() * seqs.prev[which][:, None, None, None]
        initial = initial.transpose(-1, -2).contiguous()  # [n, heads, state, head_dim]: fla's [N, H, K, V]
        rows = torch.as_tensor(seqs.rows_of(chunks), device=device)
        xs = x.index_select(0, rows)
        step = F.softplus(dt.index_select(0, rows) + module.dt_bias.to(dt.dtype)).clamp(*self.limit)
        repeat = module.num_heads // module.n_groups
        q = c.index_select(0, rows).repeat_interleave(repeat, dim=1)
        k = b.index_select(0, rows).repeat_interleave(repeat, dim=1)
        v = xs.float() * step.float()[..., None]
        g = step.float() * -torch.exp(module.A_log.float())  # the log decays, float32
        cu = seqs.cu_seqlens(chunks)
        scan = (_fla_simple_gla() if x.is_cuda else None) or reference_scan
        if scan is not reference_scan:  # fla's kernels take q, k, v of one dtype (the reference keeps v in float32)
            v = v.to(q.dtype)
        out, final = scan(q[None], k[None], v[None], g[None], scale=1.0, initial_state=initial,
                          output_final_state=True, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
        state_pool.index_copy_(0, slots, final.transpose(-1, -2).to(state_pool.dtype))
        return rows, out[0].float() + module.D.float()[:, None] * xs.float()


def _decay(module) -> torch.Tensor:
    """The heads' `A` = -exp(A_log) in float32, as transformers' decode form computes it."""
    return -torch.exp(module.A_log.float())


@torch.library.custom_op("hf_paged::mamba2_decode_slots", mutates_args=())
def mamba2_decode_slots(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                        d: torch.Tensor, dt_bias: torch.Tensor, slots: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """`kernels.mamba2_decode` on layer `layer_idx`'s Mamba 2 states in the active cache's pool (updated in place,
    which the op hides from Dynamo, as `recurrent.gdn_decode_slots` does): the compiled decode step (`decode`)."""
    return mamba2_decode(x, dt, a, b, c, d, dt_bias, active_state_pool().tensors[(layer_idx, "recurrent", 0)], slots)


@mamba2_decode_slots.register_fake
def _(x, dt, a, b, c, d, dt_bias, slots, layer_idx):
    return x.new_empty(x.shape)


def reference_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
                   initial_state: torch.Tensor, output_final_state: bool, cu_seqlens: torch.Tensor,
                   cu_seqlens_cpu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.reference_gla` called as fla's `chunk_simple_gla` is (its keywords), so the CPU runs the very call
    the GPU makes; the final states always."""
    return chunk_simple_gla_reference(q, k, v, g, cu_seqlens_cpu, initial_state, scale=scale)


def warm_up(model: torch.nn.Module, max_tokens: int) -> int:
    """Run fla's variable-length `chunk_simple_gla` a few times for each distinct layer shape of `model`'s fast paths
    (CUDA, fla installed), on random inputs, so that its kernels compile and autotune now, not in a serving step
    (module docstring). Returns the number of calls (0: nothing to warm)."""
    fla = _fla_simple_gla()
    shapes = _fast_shapes(model)
    if fla is None or not shapes:
        return 0
    top = max(1, int(max_tokens))
    counts = sorted({(t, n) for t, n in ((1, 1), (17, 1), (48, 3), (top, 1), (top, min(16, top))) if n <= t <= top})
    calls = 0
    with torch.inference_mode():
        for heads, size, dim, dtype, device in sorted(shapes, key=str):
            for tokens, seqs in counts:
                cu = torch.from_numpy(np.linspace(0, tokens, seqs + 1).round().astype(np.int64))
                q, k = (torch.randn(1, tokens, heads, size, dtype=dtype, device=device) for _ in range(2))
                v = torch.randn(1, tokens, heads, dim, dtype=dtype, device=device)
                g = -torch.rand(1, tokens, heads, device=device)  # log decays, float32 as `_prefill` makes them
                initial = torch.zeros(seqs, heads, size, dim, device=device)
                fla(q, k, v, g, scale=1.0, initial_state=initial, output_final_state=True, cu_seqlens=cu.to(device),
                    cu_seqlens_cpu=cu)
                calls += 1
    return calls


def _fast_shapes(model: torch.nn.Module) -> set[tuple]:
    """(heads, state size, head dim, dtype, device) of every Mamba 2 fast path of `model` on CUDA."""
    shapes = set()
    for module in model.modules():
        if module.__dict__.get("_hf_paged_mamba2") is not None and module.in_proj.weight.is_cuda:
            weight = module.in_proj.weight
            shapes.add((module.num_heads, module.ssm_state_size, module.head_dim, weight.dtype, weight.device))
    return shapes


@functools.cache
def _fla_simple_gla():
    """flash-linear-attention's variable-length `chunk_simple_gla`, when it is installed (`varlen.fla_function`)."""
    return fla_function("fla.ops.simple_gla", "chunk_simple_gla",
                        "Mamba 2 prefill runs hf_paged's torch reference scan (much slower)")


def install(module: torch.nn.Module) -> None:
    """Give `module` its fast path (`module._hf_paged_mamba2`) when it is a Mamba 2 mixer of a verified layout."""
    if Mamba2Path.supports(module):
        module._hf_paged_mamba2 = Mamba2Path(module)


def uninstall(module: torch.nn.Module) -> None:
    module.__dict__.pop("_hf_paged_mamba2", None)


def applies(module: torch.nn.Module, hidden: torch.Tensor) -> Mamba2Path | None:
    """The module's fast path if it has one and the step runs on CUDA (or `FORCE`; none with `varlen.FAST_PATHS`
    off)."""
    fast = module.__dict__.get("_hf_paged_mamba2")
    return fast if fast is not None and enabled(hidden, FORCE) else None
