"""The drop-in `PagedCache` in grad mode (issue 13, item 3): same logits as `DynamicCache`; gradients stop at the cache.

The decision (documented in `hf_paged.cache.gradients.cut_gradients` and the README): K/V stored in the pool and
the paged attention's output are constants for autograd, so backward runs through everything else, and no gradient
reaches the query/key/value projections through attention.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged.cache import gradients
from hf_paged.testing import FAMILIES, tiny_model

_QKV = ("q_proj", "k_proj", "v_proj", "c_attn", "qkv_proj", "query_key_value")


def _loop(model, cache, ids):
    """Prefill then three decode steps, grad mode on: the logits of every step."""
    logits = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits]
    for token in (7, 8, 9):
        step = torch.full((ids.shape[0], 1), token)
        logits.append(model(input_ids=step, past_key_values=cache, use_cache=True).logits)
    return logits


@pytest.mark.parametrize("family", FAMILIES)
def test_grad_mode_logits_equal_dynamic_cache(family):
    model = tiny_model(family)
    hf_paged.enable(model)
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.is_grad_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        paged = _loop(model, hf_paged.PagedCache(config=model.config), ids)
    dense = _loop(model, DynamicCache(config=model.config), ids)
    for p, d in zip(paged, dense):
        assert p.requires_grad
        torch.testing.assert_close(p, d, rtol=1e-4, atol=1e-4)  # float32, other summation order


def test_gradients_stop_at_the_paged_cache():
    model = tiny_model("llama")
    hf_paged.enable(model)
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    gradients.GRAD_WARNED[0] = False
    with pytest.warns(UserWarning, match="gradients do not flow"):
        logits = _loop(model, hf_paged.PagedCache(config=model.config), ids)
    sum(x.float().sum() for x in logits).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert grads["lm_head.weight"] is not None and grads["lm_head.weight"].abs().sum() > 0
    assert grads["model.layers.0.mlp.up_proj.weight"].abs().sum() > 0
    assert grads["model.layers.0.self_attn.o_proj.weight"].abs().sum() > 0  # its input is a constant, not its weight
    for name, grad in grads.items():
        if any(part in name for part in _QKV):
            assert grad is None, f"{name} got a gradient through the paged cache"
    # the same loop with DynamicCache does train the projections: the difference is the documented decision
    model.zero_grad(set_to_none=True)
    sum(x.float().sum() for x in _loop(model, DynamicCache(config=model.config), ids)).backward()
    assert model.model.layers[0].self_attn.k_proj.weight.grad is not None
