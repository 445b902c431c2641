"""Moshi: the window transformers applies through its cache, handed to the paged attention as `cache_window`.

What Moshi does differently: its config has a `sliding_window` (3000 in the checkpoints: its context) and no
`layer_types`, yet `MoshiAttention` never passes `sliding_window` to the attention function and its model builds a
plain causal mask (`create_causal_mask`). The window comes from the cache alone: `DynamicCache(config=...)` makes every
layer a `DynamicSlidingWindowLayer`, which hands a forward the keys it cached (the last `sliding_window - 1`) followed
by the forward's own keys, and the mask is causal over those. So a query of a forward that starts at position `c`
reads the keys at `[c - sliding_window + 1, its own position]`: a decode step (one token at `p = c`) reads the usual
window `(p - W, p]`, while a prompt of any length prefilled in one forward attends to all of itself (transformers'
`generate()`: the window masks nothing within the prompt, and only generated tokens slide).

The adapter keeps `MoshiAttention.forward` as it is and adds one keyword, `cache_window=config.sliding_window`, which
the forward passes through `**kwargs` to the attention function: hf-paged's turns it into each sequence's first key,
`max(0, c - W + 1)` with `c` the tokens it had cached before this forward (`hf_paged.attention.functions`, and the
compiled step's fused op, `compiled_op.window_starts`; the standard `sliding_window` of `W` on decode steps, where
both agree). That is
transformers' computation for the same forwards, so greedy tokens equal its `generate()`'s for prompts longer than
the window too. The engine's blocks out of the window are released as for a sliding model (a sequence's next query
starts at its computed length, whose first key is the one the window keeps). One difference remains and is
transformers' own: a prompt longer than the window that the engine prefills in several chunks (`max_num_batched_tokens`
smaller than the prompt, several prompts sharing a step's budget, a prefix-cache hit) computes what transformers
computes for those chunks, which is not what one forward over the whole prompt gives, and a sequence preempted by
recompute prefills its generated tokens again in one forward, where they attend to all of it. The tokens would then
depend on how the engine scheduled the prompt (a tiny Moshi with a window of 4: 9 of 13 requests differed from
transformers' `generate()` under chunking and prefix hits). So a config whose window is shorter than its context
(`sliding_window < max_position_embeddings`) is refused (`refuse`: the gate then reports `mask_only_window` with
this reason); Moshi's checkpoints have a window of 3000 = `max_position_embeddings`, which no sequence within the
context reaches, and run.
"""

from __future__ import annotations

import torch

from .registry import Adapter, register

__all__ = ["moshi_forward", "refuse"]


def moshi_forward(module: torch.nn.Module, *args, **kwargs):
    """`MoshiAttention.forward`, with the window its cache would apply passed to the attention function."""
    window = getattr(module.config, "sliding_window", None)
    if window is not None:
        kwargs["cache_window"] = window
    return module._hf_paged_original(*args, **kwargs)


def refuse(module: torch.nn.Module) -> str | None:
    """Why this Moshi config is not adapted: a window shorter than the context (module docstring), else None."""
    window = getattr(module.config, "sliding_window", None)
    context = getattr(module.config, "max_position_embeddings", None)
    if window is not None and context is not None and window < context:
        return (f"sliding_window={window} < max_position_embeddings={context}: transformers applies Moshi's window "
                "through its cache, so what a prompt longer than the window attends to depends on how it is split into "
                "forwards (chunked prefill, prefix-cache hits, recompute), which the engine's scheduling decides")
    return None


register("transformers.models.moshi.modeling_moshi.MoshiAttention",
         adapter=Adapter("moshi", "forward", moshi_forward, refuse=refuse))
