"""Drop-in `hf_paged.PagedCache` inside transformers' own generate() / forward loop vs transformers' DynamicCache.

Golden rule: token-identical to DynamicCache on CPU float32 (greedy, beam search, seeded sampling); logits within
1e-4 in a manual forward loop. References are computed on the plain model (`dense`), the paged run on the enabled
model (`paged`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged.attention import functions as paged_attention
from hf_paged.testing import FAMILIES, tiny_batch, tiny_model

try:
    from tests.helpers import dense, dense_generate, model_for, paged
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import dense, dense_generate, model_for, paged

LENGTHS = (7, 13, 3)  # several blocks of 8, a partial last block, one very short prompt


def new_cache(model, num_blocks=64, block_size=8, **kwargs):
    return hf_paged.PagedCache(config=model.config, num_blocks=num_blocks, block_size=block_size, **kwargs)


def positions(mask: torch.Tensor, q_len: int) -> torch.Tensor:
    """Position ids of the last q_len tokens of a left-padded batch (what generate() computes)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -q_len:]


@torch.no_grad()
def forward(model, cache, ids, mask):
    """One forward of `ids` (the newest tokens) with the full 2-D mask; returns logits [B, q, V]."""
    kwargs = dict(input_ids=ids, past_key_values=cache, use_cache=True)
    if mask is not None:
        kwargs.update(attention_mask=mask, position_ids=positions(mask, ids.shape[1]))
    return model(**kwargs).logits


# ----------------------------------------------------------------------------------------------- greedy generate()


@pytest.mark.parametrize("family", FAMILIES)
def test_dropin_greedy_matches_dynamic_cache(family):
    model = model_for(family)
    batch = tiny_batch(model, lengths=LENGTHS, seed=1)
    width = batch["input_ids"].shape[1]
    kwargs = dict(**batch, do_sample=False, max_new_tokens=10)
    ref = dense_generate(model, **kwargs)
    with paged(model):
        cache = new_cache(model, num_blocks=32, block_size=8)
        out = model.generate(**kwargs, past_key_values=cache)
    assert out.shape == ref.shape
    assert torch.equal(out, ref), f"{family}: paged drop-in greedy differs from DynamicCache"
    # every row holds its (left-padded) prompt + 9 fed tokens; no sharing in greedy
    stats = cache.stats()
    assert cache.get_seq_length() == width + 9
    assert stats.used_blocks == len(LENGTHS) * math.ceil((width + 9) / 8)
    assert stats.shared_blocks == 0 and stats.logical_blocks == stats.used_blocks


@pytest.mark.parametrize("block_size", [16, 32])
def test_dropin_greedy_other_block_sizes(block_size):
    model = model_for("qwen2")
    batch = tiny_batch(model, lengths=(21, 5, 34), seed=2)  # crosses 16- and 32-token blocks
    kwargs = dict(**batch, do_sample=False, max_new_tokens=10)
    ref = dense_generate(model, **kwargs)
    with paged(model):
        out = model.generate(**kwargs, past_key_values=new_cache(model, num_blocks=16, block_size=block_size))
    assert torch.equal(out, ref)


def test_dropin_default_block_size_and_auto_pool_size():
    """No num_blocks: the pool is sized from kv_cache_memory; default block_size 16."""
    model = model_for("mistral")
    batch = tiny_batch(model, lengths=LENGTHS, seed=3)
    kwargs = dict(**batch, do_sample=False, max_new_tokens=6)
    ref = dense_generate(model, **kwargs)
    with paged(model):
        cache = hf_paged.PagedCache(config=model.config, kv_cache_memory="1MiB")
        out = model.generate(**kwargs, past_key_values=cache)
    assert torch.equal(out, ref)
    assert cache.block_size == 16
    assert cache.num_blocks == (1024**2) // cache.bytes_per_block(torch.float32)


@pytest.mark.parametrize("family", FAMILIES)
def test_enabled_model_without_paged_cache_is_exact(family):
    """After enable(), transformers' default DynamicCache takes the attention function's exact SDPA fallback."""
    model = model_for(family)
    batch = tiny_batch(model, lengths=LENGTHS, seed=20)
    kwargs = dict(**batch, do_sample=False, max_new_tokens=6)
    ref = dense_generate(model, **kwargs)
    with dense(model), torch.no_grad():
        ref_logits = model(**batch, use_cache=False).logits
    with paged(model), torch.no_grad():
        out = model.generate(**kwargs)
        logits = model(**batch, use_cache=False).logits
    assert torch.equal(out, ref)
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(logits[valid], ref_logits[valid], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------- manual forward loop


@pytest.mark.parametrize("padding", ["left", "none"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_manual_forward_loop_logits_match(family, padding):
    model = model_for(family)
    if padding == "left":
        batch = tiny_batch(model, lengths=LENGTHS, seed=4)
        ids, mask = batch["input_ids"], batch["attention_mask"]
    else:
        ids, mask = tiny_batch(model, lengths=(9, 9), seed=4)["input_ids"], None
    steps = 12  # crosses a block boundary for every row
    # reference: DynamicCache on the plain model, greedy tokens fed back
    ref_logits, fed = [], []
    with dense(model):
        dc = DynamicCache(config=model.config)
        cur, cur_mask = ids, mask
        for _ in range(steps):
            logits = forward(model, dc, cur, cur_mask)
            ref_logits.append(logits)
            cur = logits[:, -1].argmax(-1, keepdim=True)
            fed.append(cur)
            if cur_mask is not None:
                cur_mask = torch.cat([cur_mask, torch.ones_like(cur)], dim=1)
    with paged(model):
        cache = new_cache(model, num_blocks=32, block_size=8)
        assert cache.get_seq_length() == 0
        cur, cur_mask = ids, mask
        for step in range(steps):
            logits = forward(model, cache, cur, cur_mask)
            expected = ref_logits[step]
            if step == 0 and mask is not None:
                valid = mask.bool()
                torch.testing.assert_close(logits[valid], expected[valid], atol=1e-4, rtol=1e-4)
            else:
                torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
            assert cache.get_seq_length() == ids.shape[1] + step
            cur = fed[step]
            if cur_mask is not None:
                cur_mask = torch.cat([cur_mask, torch.ones_like(cur)], dim=1)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_right_padded_forward_uses_exact_fallback(family, monkeypatch):
    """A mask with trailing zeros is not left padding: the attention function gathers a dense copy and runs SDPA."""
    model = model_for(family)
    batch = tiny_batch(model, lengths=LENGTHS, seed=5, padding_side="right")
    valid = batch["attention_mask"].bool()
    with dense(model), torch.no_grad():
        ref = model(**batch, past_key_values=DynamicCache(config=model.config), use_cache=True).logits
    calls = []
    original = paged_attention._gather_dense

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(paged_attention, "_gather_dense", spy)
    with paged(model), torch.no_grad():
        out = model(**batch, past_key_values=new_cache(model), use_cache=True).logits
    assert calls, "right padding should take the dense fallback"
    torch.testing.assert_close(out[valid], ref[valid], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------- beam search


BEAM_VARIANTS = {
    "plain": dict(),
    "early_stopping_length_penalty": dict(early_stopping=True, length_penalty=0.6),
    "length_penalty_only": dict(length_penalty=1.8),
}


@pytest.mark.parametrize("variant", sorted(BEAM_VARIANTS))
@pytest.mark.parametrize("family", ["llama", "gpt2", "opt", "qwen3"])
def test_beam_search_matches_dynamic_cache_and_shares_blocks(family, variant):
    model = model_for(family)
    batch = tiny_batch(model, lengths=LENGTHS, seed=6)
    kwargs = dict(**batch, num_beams=4, num_return_sequences=2, do_sample=False, max_new_tokens=9)
    kwargs.update(BEAM_VARIANTS[variant])
    ref = dense_generate(model, **kwargs)
    with paged(model):
        cache = new_cache(model, num_blocks=96, block_size=8)
        out = model.generate(**kwargs, past_key_values=cache)
    assert out.shape == ref.shape == (2 * len(LENGTHS), out.shape[1])
    assert torch.equal(out, ref)
    stats = cache.stats()
    assert len(cache._rows) == 4 * len(LENGTHS)
    assert stats.shared_blocks > 0 and stats.logical_blocks > stats.used_blocks, stats  # forks, not copies


# ----------------------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("family", ["llama", "phi3", "gpt2"])
def test_seeded_sampling_matches_dynamic_cache(family):
    """transformers' own sampler draws from the same RNG; the cache only changes logits, which are equal."""
    model = model_for(family)
    batch = tiny_batch(model, lengths=LENGTHS, seed=7)
    kwargs = dict(**batch, do_sample=True, top_k=50, max_new_tokens=10)
    refs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        refs.append(dense_generate(model, **kwargs))
    with paged(model):
        for seed, ref in zip((0, 1), refs):
            torch.manual_seed(seed)
            out = model.generate(**kwargs, past_key_values=new_cache(model))
            assert torch.equal(out, ref)
    assert not torch.equal(refs[0], refs[1])  # the seed matters, so the comparison means something


def test_sampling_num_return_sequences_expands_rows():
    model = model_for("llama")
    batch = tiny_batch(model, lengths=LENGTHS, seed=8)
    kwargs = dict(**batch, do_sample=True, num_return_sequences=2, max_new_tokens=6)
    torch.manual_seed(5)
    ref = dense_generate(model, **kwargs)
    with paged(model):
        torch.manual_seed(5)
        cache = new_cache(model)
        out = model.generate(**kwargs, past_key_values=cache)
    assert torch.equal(out, ref)
    assert len(cache._rows) == 2 * len(LENGTHS)


# ----------------------------------------------------------------------------------------------- batch reshaping / CoW


def _pool_block(cache, block):
    """Contents of one physical block over all layers, K and V: [layers, 2, kv_heads, block_size, head_dim]."""
    return cache.pool[:, :, block].clone()


def _tables(cache):
    return [cache.block_manager.block_table(seq) for seq in cache._rows]


def test_reorder_cache_shares_blocks_and_copies_on_write():
    model = model_for("llama")
    ids = tiny_batch(model, lengths=(5, 5), seed=9)["input_ids"]  # 5 tokens: a partial block of 8
    beam_idx = torch.tensor([1, 0, 0])
    step_tokens = torch.tensor([[11], [22], [33]])  # the two forks of row 0 diverge
    with dense(model):
        dc = DynamicCache(config=model.config)
        forward(model, dc, ids, None)
        dc.reorder_cache(beam_idx)
        ref = forward(model, dc, step_tokens, None)
        ref2 = forward(model, dc, torch.tensor([[44], [55], [66]]), None)
    with paged(model):
        cache = new_cache(model, num_blocks=16, block_size=8)
        forward(model, cache, ids, None)
        old = _tables(cache)
        assert len(old[0]) == len(old[1]) == 1
        cache.reorder_cache(beam_idx)
        tables = _tables(cache)
        assert tables == [old[1], old[0], old[0]]  # forks share the physical blocks: nothing copied
        stats = cache.stats()
        assert stats.used_blocks == 2 and stats.shared_blocks == 1 and stats.logical_blocks == 3
        shared = old[0][0]
        before = _pool_block(cache, shared)
        before_other = _pool_block(cache, old[1][0])

        out = forward(model, cache, step_tokens, None)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        after = _tables(cache)
        assert after[0] == old[1]  # unshared: written in place
        assert after[1] != after[2] and shared in (after[1][0], after[2][0])  # exactly one fork moved (CoW)
        fresh = after[1][0] if after[1][0] != shared else after[2][0]
        assert fresh not in old[0] + old[1]
        # the 5 cached tokens of the shared block are untouched, and the copy starts with the same 5 tokens
        now = _pool_block(cache, shared)
        copy = _pool_block(cache, fresh)
        torch.testing.assert_close(now[..., :5, :], before[..., :5, :], atol=0, rtol=0)
        torch.testing.assert_close(copy[..., :5, :], before[..., :5, :], atol=0, rtol=0)
        torch.testing.assert_close(_pool_block(cache, old[1][0])[..., :5, :], before_other[..., :5, :], atol=0, rtol=0)
        # each fork wrote its own (different) token at offset 5 of its own block
        assert not torch.equal(now[..., 5, :], copy[..., 5, :])
        stats = cache.stats()
        assert stats.used_blocks == 3 and stats.shared_blocks == 0

        out2 = forward(model, cache, torch.tensor([[44], [55], [66]]), None)
        torch.testing.assert_close(out2, ref2, atol=1e-4, rtol=1e-4)


def test_batch_repeat_interleave_and_select_indices_share_blocks():
    model = model_for("qwen2")
    batch = tiny_batch(model, lengths=(6, 3), seed=10)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(3, 384, (4, 1), generator=g) for _ in range(6)] + [
        torch.randint(3, 384, (2, 1), generator=g) for _ in range(6)
    ]
    select = torch.tensor([3, 0])

    def run(cache, check=None):
        outs = []
        m = mask
        forward(model, cache, ids, m)
        cache.batch_repeat_interleave(2)
        m = m.repeat_interleave(2, dim=0)
        if check:
            check("repeat", cache)
        for i, tok in enumerate(tokens):
            if i == 6:
                cache.batch_select_indices(select)
                m = m[select]
                if check:
                    check("select", cache)
            m = torch.cat([m, torch.ones_like(tok)], dim=1)
            outs.append(forward(model, cache, tok, m))
        return outs

    with dense(model):
        ref = run(DynamicCache(config=model.config))

    def check(stage, cache):
        tables = _tables(cache)
        stats = cache.stats()
        if stage == "repeat":
            assert len(tables) == 4 and tables[0] == tables[1] and tables[2] == tables[3]
            assert stats.used_blocks == 2 and stats.shared_blocks == 2  # 1 block per prompt, shared by 2 rows
        else:  # forks of rows 3 and 0: same tables, the dropped rows' private blocks are freed
            assert len(tables) == 2
            assert stats.used_blocks == stats.logical_blocks

    with paged(model):
        cache = new_cache(model, num_blocks=16, block_size=8)
        outs = run(cache, check)
        for got, expected in zip(outs, ref):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        cache.reset()
        assert cache.stats().used_blocks == 0


def test_batch_select_indices_with_bool_mask():
    model = model_for("llama")
    batch = tiny_batch(model, lengths=(4, 9, 6), seed=11)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    keep = torch.tensor([True, False, True])
    tok = torch.tensor([[7], [8]])

    def run(cache):
        forward(model, cache, ids, mask)
        cache.batch_select_indices(keep)
        m = torch.cat([mask[keep], torch.ones_like(tok)], dim=1)
        return forward(model, cache, tok, m)

    with dense(model):
        ref = run(DynamicCache(config=model.config))
    with paged(model):
        cache = new_cache(model)
        out = run(cache)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        assert len(cache._rows) == 2


# ----------------------------------------------------------------------------------------------- crop


@pytest.mark.parametrize("reorder_first", [False, True])
def test_crop_then_continue_matches_dynamic_cache(reorder_first):
    """crop(-n) then decoding again; with reorder_first the crop cuts into blocks shared by two forks."""
    model = model_for("gpt2")
    batch = tiny_batch(model, lengths=(6, 11), seed=12)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    g = torch.Generator().manual_seed(1)
    rows = 3 if reorder_first else 2
    first = [torch.randint(3, 384, (rows, 1), generator=g) for _ in range(7)]
    second = [torch.randint(3, 384, (rows, 1), generator=g) for _ in range(6)]
    crop_n = 4

    def run(cache):
        m = mask
        forward(model, cache, ids, m)
        if reorder_first:
            cache.reorder_cache(torch.tensor([0, 1, 1]))
            m = m[[0, 1, 1]]
        for tok in first:
            m = torch.cat([m, torch.ones_like(tok)], dim=1)
            forward(model, cache, tok, m)
        length = cache.get_seq_length()
        cache.crop(-crop_n)
        assert cache.get_seq_length() == length - crop_n
        m = m[:, :-crop_n]
        outs = []
        for tok in second:
            m = torch.cat([m, torch.ones_like(tok)], dim=1)
            outs.append(forward(model, cache, tok, m))
        return outs

    with dense(model):
        ref = run(DynamicCache(config=model.config))
    with paged(model):
        cache = new_cache(model, num_blocks=16, block_size=8)
        outs = run(cache)
    for got, expected in zip(outs, ref):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_prompt_lookup_decoding_through_paged_cache():
    """transformers' prompt-lookup (speculative) decoding crops the cache after rejected candidates."""
    model = model_for("llama")
    prompt = tiny_batch(model, lengths=(10,), seed=13)["input_ids"]
    ids = torch.cat([prompt, prompt, prompt[:, :4]], dim=1)  # repeats give the lookup candidates
    kwargs = dict(input_ids=ids, prompt_lookup_num_tokens=3, max_new_tokens=16, do_sample=False)
    ref = dense_generate(model, **kwargs)
    crops = []
    with paged(model):
        cache = new_cache(model, num_blocks=16, block_size=8)
        original = cache.crop
        cache.crop = lambda n: (crops.append(n), original(n))[1]
        out = model.generate(**kwargs, past_key_values=cache)
    assert torch.equal(out, ref)
    assert crops, "prompt lookup should have cropped the cache at least once"


# ----------------------------------------------------------------------------------------------- reuse and leaks


def test_reset_frees_every_block_and_cache_is_reusable():
    model = model_for("granite")
    batch = tiny_batch(model, lengths=LENGTHS, seed=14)
    kwargs = dict(**batch, do_sample=False, max_new_tokens=8)
    ref = dense_generate(model, **kwargs)
    beam_kwargs = dict(**batch, do_sample=False, max_new_tokens=5, num_beams=3)
    beam_ref = dense_generate(model, **beam_kwargs)
    with paged(model):
        cache = new_cache(model, num_blocks=48, block_size=8)
        assert torch.equal(model.generate(**kwargs, past_key_values=cache), ref)
        assert cache.stats().used_blocks > 0
        cache.reset()
        stats = cache.stats()
        assert stats.used_blocks == 0 and stats.free_blocks == 48 and stats.logical_blocks == 0
        assert cache.get_seq_length() == 0 and cache.batch_size == 0
        assert torch.equal(model.generate(**beam_kwargs, past_key_values=cache), beam_ref)
        cache.reset()
        assert cache.stats().used_blocks == 0
        assert torch.equal(model.generate(**kwargs, past_key_values=cache), ref)


def test_multi_turn_reuse_of_the_cache_matches_dynamic_cache():
    """A second generate() on the same cache continues the conversation (transformers skips the cached prefix)."""
    model = model_for("llama")
    ids = tiny_batch(model, lengths=(12,), seed=15)["input_ids"]
    extra = torch.tensor([[17, 18, 19]])

    def run(model, cache):
        first = model.generate(ids, max_new_tokens=5, do_sample=False, past_key_values=cache)
        second = model.generate(torch.cat([first, extra], 1), max_new_tokens=5, do_sample=False, past_key_values=cache)
        return first, second

    with dense(model):
        dc = DynamicCache(config=model.config)
        ref = run(model, dc)
    with paged(model):
        cache = new_cache(model, num_blocks=16, block_size=8)
        out = run(model, cache)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert cache.get_seq_length() == dc.get_seq_length()


# ----------------------------------------------------------------------------------------------- bad input


def test_block_size_not_power_of_two_raises():
    model = model_for("llama")
    with pytest.raises(ValueError, match="block_size"):
        hf_paged.PagedCache(config=model.config, num_blocks=8, block_size=12)
    with pytest.raises((TypeError, ValueError), match="block_size"):
        hf_paged.PagedCache(config=model.config, num_blocks=8, block_size=0)


@pytest.mark.parametrize("num_blocks", [0, -3])
def test_non_positive_num_blocks_raises(num_blocks):
    model = model_for("llama")
    with pytest.raises(ValueError, match="num_blocks"):
        hf_paged.PagedCache(config=model.config, num_blocks=num_blocks)


@pytest.mark.parametrize("bad,error", [(0, ValueError), (1.2, ValueError), ("0.9", TypeError), (None, TypeError),
                                       (True, TypeError)])
def test_bad_memory_fraction_is_refused_as_the_engine_refuses_it(bad, error):
    """`PagedCache` and the engine's pool sizing share one rule: a real number in (0, 1]; "0.9" is a TypeError in both
    (float() alone used to accept it here)."""
    from hf_paged.engine.pool_sizing import pool_blocks

    model = model_for("llama")
    with pytest.raises(error, match="gpu_memory_utilization"):
        hf_paged.PagedCache(config=model.config, num_blocks=8, gpu_memory_utilization=bad)
    with pytest.raises(error, match="gpu_memory_utilization"):
        pool_blocks(4096, bad, total=1 << 30, peak=0, allocated=0, free=1 << 30)
    assert hf_paged.PagedCache(config=model.config, num_blocks=8, gpu_memory_utilization=np.float32(0.5)
                               ).gpu_memory_utilization == 0.5


def test_cache_without_config_raises():
    with pytest.raises(ValueError, match="config"):
        hf_paged.PagedCache(num_blocks=4)


def test_pool_too_small_for_the_prompt_raises_cache_full():
    model = model_for("llama")
    batch = tiny_batch(model, lengths=LENGTHS, seed=16)  # 3 rows x 13 tokens = 6 blocks of 8
    with paged(model):
        cache = new_cache(model, num_blocks=4, block_size=8)
        with pytest.raises(hf_paged.CacheFullError, match=r"PagedCache is full.*num_blocks"):
            model.generate(**batch, past_key_values=cache, do_sample=False, max_new_tokens=4)
        # the failed reservation took no block
        assert cache.stats().used_blocks == 0


def test_pool_too_small_for_decoding_raises_cache_full():
    model = model_for("llama")
    batch = tiny_batch(model, lengths=(8, 8), seed=17)  # exactly 2 full blocks: the next token needs 2 more
    with paged(model):
        cache = new_cache(model, num_blocks=3, block_size=8)
        with pytest.raises(hf_paged.CacheFullError, match="full"):
            model.generate(**batch, past_key_values=cache, do_sample=False, max_new_tokens=4)


def test_batch_mismatch_raises_value_error():
    model = model_for("llama")
    ids = tiny_batch(model, lengths=(5, 5), seed=18)["input_ids"]
    with paged(model):
        cache = new_cache(model)
        forward(model, cache, ids, None)
        with pytest.raises(ValueError, match="batch"):
            forward(model, cache, torch.tensor([[5]]), None)
        with pytest.raises(ValueError, match="out of range"):
            cache.batch_select_indices(torch.tensor([0, 2]))


def test_paged_cache_on_a_model_that_was_not_enabled_gives_a_clear_error():
    model = tiny_model("llama", seed=0)  # a fresh, never enabled model
    batch = tiny_batch(model, lengths=LENGTHS, seed=19)
    with pytest.raises(Exception) as info:
        model.generate(**batch, past_key_values=new_cache(model), do_sample=False, max_new_tokens=3)
    assert "enable" in str(info.value), f"unclear error: {type(info.value).__name__}: {info.value}"


def test_lazy_pool_takes_the_kv_heads_it_is_given():
    """A rank of a tensor-parallel model writes its share of the KV heads: a pool allocated on first use follows it
    (a divisor of the config's heads); an explicit num_kv_heads, or a non-divisor, is refused with a clear error."""
    config = hf_paged.enable(tiny_model("llama")).config  # 2 KV heads, head_dim 16
    cache = hf_paged.PagedCache(config=config, num_blocks=4, block_size=4)
    keys = torch.randn(1, 1, 3, 16)
    cache.update(keys, keys.clone(), 0)
    assert cache.num_kv_heads == 1 and cache.pool.shape[3] == 1
    with pytest.raises(ValueError, match="KV heads"):
        cache.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), 1)
    fixed = hf_paged.PagedCache(config=config, num_blocks=4, block_size=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="KV heads"):
        fixed.update(keys, keys.clone(), 0)
    odd = hf_paged.PagedCache(config=hf_paged.enable(tiny_model("llama", num_key_value_heads=4)).config,
                              num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV heads"):
        odd.update(torch.randn(1, 3, 1, 16), torch.randn(1, 3, 1, 16), 0)
