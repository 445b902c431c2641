"""A fast path for Qwen3.5's gated DeltaNet layers on the GPU: one call per layer and step, states updated in place.

The generic adapter (`hf_paged.attention.recurrent`) runs a recurrent layer's own forward once per prefill chunk and
once for the decoding rows, with each group's states gathered from their slots and scattered back. On an H200 with a
Qwen3.5-9B shape that cost a prefill step seconds of host time (a forward per sequence and layer) and a decode step
six passes over the float32 delta-rule states, the largest tensor the step touches. This path keeps the module's own
projections, convolution weights, gates, norm and output projection, and runs, for all rows of a step at once:

* the depthwise causal convolution over each sequence's rows, its window starting from the sequence's convolution
  state (`varlen_conv`: one gather per tap, every sequence apart);
* decode rows: `kernels.gdn_decode`, which reads each state from its slot and writes it back, once;
* prefill chunks: flash-linear-attention's `chunk_gated_delta_rule` over all chunks in one variable-length call,
  from each sequence's state (its slot's, or zeros), or transformers' torch reference chunk by chunk without it.

It is installed (`install`, from `recurrent.install`) on modules with Qwen3.5's layout, and used on CUDA (the CPU
runs the module's own code, which the architecture sweep compares with transformers token for token).

`warm_up` runs the variable-length call at the engine's warm-up over the token and sequence counts that make Triton
compile (or flash-linear-attention autotune) a kernel anew. Triton specialises a kernel's integer arguments (the
step's tokens, sequences and chunks) on being 1, a multiple of 16 or neither, and fla's l2 norm autotunes per
``cdiv(tokens * heads, 65536)``: on an H200 (Qwen3.5-9B shape, 200 requests sharing a system prompt, prefix hits) the
first step of ~130 sequences took 12.7 s for 12,912 prompt tokens, 11.2 s of it fla's host time compiling and
autotuning (`benchmarks/results/h200_2026-11-29d/`), where the engine's warm-up had run only a few sequences of a
few hundred tokens.
`tests/test_gated_delta.py` runs this path on the CPU (`FORCE` on) against transformers' tokens and recurrent rule.
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ..kernels.gated_delta import gdn_decode
from .varlen import Sequences, enabled, fla_function, ragged_conv, run_packed, varlen_conv

__all__ = ["FORCE", "GatedDeltaNetPath", "varlen_conv", "warm_up", "warm_up_counts"]

FORCE = False  # run the fast path on the CPU too (tests)
_ATTRIBUTES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj",
               "num_v_heads", "num_k_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "conv_kernel_size",
               "activation", "layer_idx")


class GatedDeltaNetPath:
    """The fast path of one gated DeltaNet module (Qwen3.5's layout: `in_proj_qkv`, `in_proj_z`, `in_proj_b`,
    `in_proj_a`, a depthwise `conv1d`, `A_log` / `dt_bias` gates, a gated RMS norm, `out_proj`)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.act = ACT2FN[module.activation]
        self.ratio = module.num_v_heads // module.num_k_heads
        self.kernel = int(module.conv_kernel_size)
        self.scale = module.head_k_dim ** -0.5
        modeling = sys.modules[type(module).__module__]
        self.chunk_reference = getattr(modeling, "torch_chunk_gated_delta_rule", None)

    @staticmethod
    def supports(module: torch.nn.Module) -> bool:
        return all(hasattr(module, name) for name in _ATTRIBUTES) and module.conv1d.groups == module.conv1d.in_channels

    # ------------------------------------------------------------------ shared pieces
    def _project(self, module, hidden: torch.Tensor):
        """The module's own projections of `hidden` `[T, H]`: (conv input `[T, C]`, z, beta, g)."""
        mixed = module.in_proj_qkv(hidden)
        z = module.in_proj_z(hidden)
        beta = module.in_proj_b(hidden).sigmoid()
        g = -module.A_log.float().exp() * F.softplus(module.in_proj_a(hidden).float() + module.dt_bias)
        return mixed, z, beta, g

    def _split(self, module, mixed: torch.Tensor):
        """q, k `[T, HV, K]` (repeated to the value heads, as transformers does) and v `[T, HV, V]`."""
        rows = mixed.shape[0]
        q, k, v = torch.split(self.act(mixed), [module.key_dim, module.key_dim, module.value_dim], dim=-1)
        q = q.reshape(rows, -1, module.head_k_dim)
        k = k.reshape(rows, -1, module.head_k_dim)
        v = v.reshape(rows, -1, module.head_v_dim)
        if self.ratio > 1:
            q = q.repeat_interleave(self.ratio, dim=1)
            k = k.repeat_interleave(self.ratio, dim=1)
        return q, k, v

    def _finish(self, module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        rows = core.shape[0]
        out = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
        return module.out_proj(out.reshape(rows, -1))

    # ------------------------------------------------------------------ decode rows
    def decode(self, module, hidden: torch.Tensor, slots: torch.Tensor, pool, compiled: bool) -> torch.Tensor:
        """Rows `hidden` `[B, H]` each decoding one token from its slot's states; returns `[B, H]`. `compiled`: traced
        in the compiled step, the states go through the opaque ops (`recurrent.gather_state`, `gdn_decode_slots`)."""
        layer = module.layer_idx
        mixed, z, beta, g = self._project(module, hidden)
        weight = module.conv1d.weight[:, 0]
        if compiled:
            state = torch.ops.hf_paged.gather_state(slots, layer, "conv", 0, list(weight.shape[:1]) + [self.kernel],
                                                    mixed.dtype)
        else:
            state = pool.tensors[(layer, "conv", 0)].index_select(0, slots)
        window = torch.cat([state[:, :, 1:].to(mixed.dtype), mixed[:, :, None]], dim=-1)  # the last K inputs
        conv = (window.float() * weight.float()).sum(-1)
        if module.conv1d.bias is not None:
            conv = conv + module.conv1d.bias.float()
        q, k, v = self._split(module, conv.to(mixed.dtype))
        if compiled:
            core = torch.ops.hf_paged.gdn_decode_slots(q, k, v, g, beta.to(g.dtype), slots, layer, self.scale)
            out = self._finish(module, core, z)
            return torch.ops.hf_paged.commit_states(out, [window], slots, layer, [0], [0])
        pool.tensors[(layer, "conv", 0)].index_copy_(0, slots, window.to(pool.tensors[(layer, "conv", 0)].dtype))
        core = gdn_decode(q, k, v, g, beta.to(g.dtype), pool.tensors[(layer, "recurrent", 0)], slots, self.scale)
        return self._finish(module, core, z)

    # ------------------------------------------------------------------ a ragged step
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
        mixed, z, beta, g = self._project(module, hidden)
        conv = ragged_conv(mixed, module.conv1d.weight[:, 0], module.conv1d.bias, pool.tensors[(layer, "conv", 0)],
                           state_slots, seqs)
        q, k, v = self._split(module, conv)
        core = torch.zeros_like(v)
        decoding = seqs.decoding
        if decoding.any():
            pick = torch.as_tensor(seqs.rows_of(np.flatnonzero(decoding)), device=device)
            slots = state_slots[torch.as_tensor(np.flatnonzero(decoding), device=device)]
            core.index_copy_(0, pick, gdn_decode(q[pick], k[pick], v[pick], g[pick], beta[pick].to(g.dtype),
                                                 state_pool, slots, self.scale))
        chunks = np.flatnonzero(~decoding)
        if len(chunks):
            self._prefill(q, k, v, g, beta, core, chunks, seqs, state_slots, state_pool)
        return self._finish(module, core, z)

    def _prefill(self, q, k, v, g, beta, core, chunks, seqs: Sequences, state_slots, state_pool) -> None:
        """The delta rule over the prefill chunks, from each one's state, into `core`; new states into the pool."""
        device = q.device
        lens = seqs.lens
        which = torch.as_tensor(chunks, device=device)
        slots = state_slots[which]
        initial = state_pool.index_select(0, slots) * seqs.prev[which][:, None, None, None]
        rows = torch.as_tensor(seqs.rows_of(chunks), device=device)
        qs, ks, vs, gs, bs = (t.index_select(0, rows)[None] for t in (q, k, v, g, beta))
        fla = _fla_chunk() if q.is_cuda else None
        if fla is not None:  # one variable-length call
            cu = seqs.cu_seqlens(chunks)
            out, final = fla(qs, ks, vs, gs, bs, initial_state=initial.float(), output_final_state=True,
                             cu_seqlens=cu.to(device), cu_seqlens_cpu=cu, use_qk_l2norm_in_kernel=True)
            core.index_copy_(0, rows, out[0].to(core.dtype))
        else:  # transformers' own kernel, chunk by chunk
            outs, finals, start = [], [], 0
            for j, i in enumerate(chunks):
                stop = start + int(lens[i])
                out, final = self.chunk_reference(
                    qs[:, start:stop], ks[:, start:stop], vs[:, start:stop], g=gs[:, start:stop],
                    beta=bs[:, start:stop].to(gs.dtype), initial_state=initial[j : j + 1], output_final_state=True,
                    use_qk_l2norm_in_kernel=True)
                outs.append(out[0])
                finals.append(final)
                start = stop
            core.index_copy_(0, rows, torch.cat(outs).to(core.dtype))
            final = torch.cat(finals)
        state_pool.index_copy_(0, slots, final.to(state_pool.dtype))


def warm_up_counts(max_tokens: int, heads: int) -> list[tuple[int, int]]:
    """(tokens, sequences) of the warm-up's calls: for every l2-norm block count up to `max_tokens` (tokens * heads
    per 65,536), its largest token count as a multiple of 16 and not, over 1, 3 and 16 sequences; and short steps
    (1, 17 and 48 tokens)."""
    counts = {(1, 1), (17, 1), (48, 3)}
    for blocks in range(1, -(-max_tokens * heads // 65536) + 1):
        top = max(16, min(max_tokens, blocks * 65536 // heads) // 16 * 16)
        counts |= {(top, 1), (top, 16), (top - 3, 3), (top - 1, 1)}
    return sorted((t, n) for t, n in counts if 0 < n <= t <= max_tokens)


def warm_up(model: torch.nn.Module, max_tokens: int) -> int:
    """Run flash-linear-attention's variable-length chunk call once for each of `warm_up_counts` and each distinct
    layer shape of `model`'s fast paths (CUDA, fla installed), on random inputs, so that its kernels compile and
    autotune now, not in a serving step (module docstring). Returns the number of calls (0: nothing to warm)."""
    fla = _fla_chunk()
    shapes = _fast_shapes(model)
    if fla is None or not shapes:
        return 0
    calls = 0
    with torch.inference_mode():
        for heads, key_dim, value_dim, dtype, device in sorted(shapes, key=str):
            for tokens, seqs in warm_up_counts(max_tokens, heads):
                cu = torch.from_numpy(np.linspace(0, tokens, seqs + 1).round().astype(np.int64))
                q, k = (torch.randn(1, tokens, heads, key_dim, dtype=dtype, device=device) for _ in range(2))
                v = torch.randn(1, tokens, heads, value_dim, dtype=dtype, device=device)
                g = -torch.rand(1, tokens, heads, device=device)  # log decays, float32 as `_project` makes them
                beta = torch.rand(1, tokens, heads, dtype=dtype, device=device)
                initial = torch.zeros(seqs, heads, key_dim, value_dim, device=device)
                fla(q, k, v, g, beta, initial_state=initial, output_final_state=True, cu_seqlens=cu.to(device),
                    cu_seqlens_cpu=cu, use_qk_l2norm_in_kernel=True)
                calls += 1
    return calls


def _fast_shapes(model: torch.nn.Module) -> set[tuple]:
    """(value heads, key dim, value dim, dtype, device) of every fast path of `model` on CUDA."""
    shapes = set()
    for module in model.modules():
        if module.__dict__.get("_hf_paged_fast") is not None and module.in_proj_qkv.weight.is_cuda:
            weight = module.in_proj_qkv.weight
            shapes.add((module.num_v_heads, module.head_k_dim, module.head_v_dim, weight.dtype, weight.device))
    return shapes


@functools.cache
def _fla_chunk():
    """flash-linear-attention's variable-length `chunk_gated_delta_rule`, when it is installed.

    Without it, prefill runs transformers' torch reference one chunk at a time, which is correct but much slower on a
    GPU. fla-core installed but failing to import (e.g. its dependency einops missing) would make that fallback
    silent, so a failed import is said once, with its reason, not swallowed."""
    return fla_function("fla.ops.gated_delta_rule", "chunk_gated_delta_rule",
                        "gated DeltaNet prefill runs transformers' torch reference, chunk by chunk (much slower)")


def install(module: torch.nn.Module) -> None:
    """Give `module` its fast path (`module._hf_paged_fast`) when it has Qwen3.5's layout."""
    if GatedDeltaNetPath.supports(module):
        module._hf_paged_fast = GatedDeltaNetPath(module)


def uninstall(module: torch.nn.Module) -> None:
    module.__dict__.pop("_hf_paged_fast", None)


def applies(module: torch.nn.Module, hidden: torch.Tensor) -> GatedDeltaNetPath | None:
    """The module's fast path if it has one and the step runs on CUDA (or `FORCE`; none with `varlen.FAST_PATHS`
    off)."""
    fast = module.__dict__.get("_hf_paged_fast")
    return fast if fast is not None and enabled(hidden, FORCE) else None
