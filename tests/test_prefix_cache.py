"""Automatic prefix caching in the block manager and the scheduler (pure Python, no torch: runs in about a second).

The random-operation coverage is the ``PrefixCachingMachine`` of ``test_block_manager.py`` (ref counts, the three
pools, verified hits under colliding hashes); here each rule of the design has a focused test: chained keys, verified
hits, forced collisions, LRU eviction order, free-before-evict, hits after free, the last-token back-off (the block
holding the last prompt token is never mapped, so a cached block is never written), copy-on-write of a cached block
after a truncate, forks, swaps, stats, and the scheduler's admission (cached prefix skipped, waiting for a prefix being
computed, recompute hitting its own blocks).
"""

from __future__ import annotations

import importlib
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "hf_paged"
PACKAGE = "_hf_paged_prefix_cache_under_test"


def _load():
    """hf_paged.core's block pool, sequences and scheduler, loaded under a private package (hf_paged/__init__.py
    imports torch)."""
    if PACKAGE not in sys.modules:
        package = types.ModuleType(PACKAGE)
        package.__path__ = [str(PACKAGE_DIR)]
        sys.modules[PACKAGE] = package
    return tuple(importlib.import_module(f"{PACKAGE}.core.{name}") for name in ("block_pool", "sequence", "scheduler"))


block_pool, sequence, scheduler = _load()  # block_pool: where the digest function is cached
core = importlib.import_module(f"{PACKAGE}.core")
prefix_caching = importlib.import_module(f"{PACKAGE}.core.prefix_caching")  # where hash_block is looked up
BlockManager = core.BlockManager
Scheduler = scheduler.Scheduler
Sequence = sequence.Sequence
SequenceGroup = sequence.SequenceGroup
SequenceStatus = sequence.SequenceStatus


def manager(num_blocks: int = 16, block_size: int = 4, **kwargs) -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_prefix_caching=True, **kwargs)


def run(bm: BlockManager, seq_id, tokens: list[int], commit: bool = True) -> int:
    """Admit ``tokens`` through the cache, reserve the rest, (pretend to) compute it and commit; return cached."""
    cached = bm.allocate_prefix(seq_id, tokens)
    bm.append_slots(seq_id, len(tokens) - cached)
    if commit:
        bm.commit(seq_id, tokens, len(tokens))
    return cached


def check_pools(bm: BlockManager) -> None:
    """free + used + evictable == total, disjoint; ref counts equal the tables holding each block."""
    gpu = bm.gpu
    holders = [0] * bm.num_blocks
    for seq in bm.seq_ids():
        if not bm.is_swapped(seq):
            for block in bm.block_table(seq):
                holders[block] += 1
    free, evictable = set(gpu.free_blocks()), set(gpu.evictable_blocks())
    used = {b for b in range(bm.num_blocks) if holders[b]}
    assert not free & evictable and not free & used and not evictable & used
    assert len(free) + len(evictable) + len(used) == bm.num_blocks
    assert gpu.num_free == len(free) + len(evictable) and gpu.num_used == len(used)
    assert all(gpu.ref_count(b) == holders[b] for b in range(bm.num_blocks))
    assert all(gpu.is_cached(b) for b in evictable)


# ------------------------------------------------------------------------------------------------------ hashing


def test_hash_block_is_chained_and_deterministic() -> None:
    h = core.hash_block
    assert h(1, [5, 6]) == h(1, [5, 6])
    assert h(1, [5, 6]) != h(2, [5, 6])  # same tokens, other parent
    assert h(1, [5, 6]) != h(1, [6, 5])
    assert 0 <= h(block_pool.ROOT_KEY, [0, 1, 2]) < 2**64


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_chain_hashes_equal_hash_block_chained(block_size: int, monkeypatch) -> None:
    """`chain_hashes` (a prompt's keys from one buffer of its tokens, what `match_prefix` uses) gives the keys of
    `hash_block` chained block by block, with xxhash and with the fallback digest; a tail shorter than a block is not
    keyed. With `hash_block` patched (the collision tests), `match_prefix` keys through the patched function."""
    import random

    rng = random.Random(block_size)
    tokens = [rng.randrange(2**31) for _ in range(20 * block_size + block_size // 2)]

    def chained(n):
        keys, key = [], block_pool.ROOT_KEY
        for i in range(n):
            key = core.hash_block(key, tokens[i * block_size : (i + 1) * block_size])
            keys.append(key)
        return keys

    for digest in ("xxhash", "fallback"):
        if digest == "fallback":
            monkeypatch.setitem(sys.modules, "xxhash", None)
            monkeypatch.setattr(block_pool, "_digest", None)
        for n in (0, 1, 7, 20):
            assert block_pool.chain_hashes(block_pool.ROOT_KEY, tokens, n, block_size) == chained(n), (digest, n)
    bm = manager(num_blocks=64, block_size=block_size)
    assert list(bm.match_prefix(tokens).keys) == chained(20)
    monkeypatch.setattr(prefix_caching, "hash_block", lambda parent, chunk: hash((parent, tuple(chunk))))
    patched = manager(num_blocks=64, block_size=block_size).match_prefix(tokens).keys
    assert list(patched) != chained(20) and len(patched) == 20


@pytest.mark.parametrize("patched", [False, True])
def test_match_prefix_with_keys_hashed_ahead_is_the_same_match(patched: bool, monkeypatch) -> None:
    """`match_prefix(known_keys=...)` with the keys of any leading blocks (a prompt's, from `chain_keys`) gives the
    match it gives without them; only the blocks after the known ones are hashed (a wrong known key shows)."""
    if patched:  # the collision tests' path: keys through a patched `hash_block`
        monkeypatch.setattr(prefix_caching, "hash_block", lambda parent, chunk: hash((parent, tuple(chunk))))
    rng = random.Random(3)
    bm = manager(num_blocks=64, block_size=4)
    cached = [rng.randrange(1000) for _ in range(22)]
    run(bm, "a", cached)
    tokens = cached[:13] + [rng.randrange(1000) for _ in range(14)]  # 3 blocks shared, then a miss; 6 full blocks
    plain = bm.match_prefix(tokens)
    assert plain.num_cached_tokens == 12 and len(plain.keys) == 6
    for prompt_len in (0, 3, 8, 13, 27):
        known = bm.chain_keys(tokens[:prompt_len])
        assert known == list(plain.keys[: prompt_len // 4])
        assert bm.match_prefix(tokens, known_keys=known) == plain, prompt_len
    wrong = bm.chain_keys(tokens[:8])
    wrong[1] ^= 1
    assert bm.match_prefix(tokens, known_keys=wrong).num_cached_tokens == 4  # the known keys are taken as given
    assert BlockManager(8, 4).chain_keys(tokens) == []  # no prefix caching: nothing to key


def test_xxhash_is_used_and_the_fallback_works(monkeypatch) -> None:
    import xxhash

    data = (7).to_bytes(8, "little") + b"".join(t.to_bytes(8, "little") for t in (3, 4))
    assert core.hash_block(7, [3, 4]) == xxhash.xxh64_intdigest(data)
    monkeypatch.setitem(sys.modules, "xxhash", None)  # import xxhash now raises ImportError
    monkeypatch.setattr(block_pool, "_digest", None)
    fallback = core.hash_block(7, [3, 4])
    assert fallback == core.hash_block(7, [3, 4]) != core.hash_block(7, [4, 3])
    assert 0 <= fallback < 2**64


def test_module_imports_and_caches_without_xxhash_torch_or_numpy() -> None:
    code = (
        "import importlib, sys\n"
        "sys.modules['xxhash'] = None\n"
        "import types\n"
        f"package = types.ModuleType('bm_isolated'); package.__path__ = [{str(PACKAGE_DIR)!r}]\n"
        "sys.modules['bm_isolated'] = package\n"
        "module = importlib.import_module('bm_isolated.core.block_manager')\n"
        "bm = module.BlockManager(8, 2, enable_prefix_caching=True)\n"
        "bm.allocate_prefix('a', [1, 2, 3, 4, 5]); bm.append_slots('a', 5); bm.commit('a', [1, 2, 3, 4, 5], 5)\n"
        "assert bm.allocate_prefix('b', [1, 2, 3, 4, 9]) == 4\n"
        "assert not {'torch', 'numpy'} & set(sys.modules), 'block_manager imported torch or numpy'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------------------------------------------ matching


def test_longest_whole_block_prefix_is_mapped_by_reference() -> None:
    bm = manager()
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    assert run(bm, "a", prompt) == 0
    table_a = bm.block_table("a")
    other = prompt[:8] + [7, 7, 7]
    assert run(bm, "b", other, commit=False) == 8
    assert bm.block_table("b")[:2] == table_a[:2] and bm.block_table("b")[2] not in table_a
    assert [bm.gpu.ref_count(b) for b in table_a] == [2, 2, 1]
    # a prefix ending inside a block only uses the blocks before it
    assert bm.match_prefix(prompt[:7] + [1, 1, 1]).num_cached_tokens == 4
    assert bm.match_prefix([1] + prompt[1:]).num_cached_tokens == 0
    check_pools(bm)


def test_same_block_tokens_after_another_prefix_do_not_hit() -> None:
    bm = manager()
    run(bm, "a", [1, 2, 3, 4, 9, 9, 9, 9, 5])
    match = bm.match_prefix([7, 7, 7, 7, 9, 9, 9, 9, 5])
    assert match.num_hit_blocks == 0 and match.num_cached_tokens == 0
    assert bm.match_prefix([1, 2, 3, 4, 9, 9, 9, 9, 6]).num_cached_tokens == 8
    assert bm.match_prefix([1, 2, 3, 4, 9, 9, 9, 9, 6]).keys[1] != match.keys[1]  # chained keys differ


def test_partial_last_block_is_never_cached() -> None:
    bm = manager()
    run(bm, "a", [1, 2, 3, 4, 5, 6])
    assert bm.gpu.num_cached == 1  # only the full block
    assert bm.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]).num_hit_blocks == 1


def test_only_written_blocks_are_keyed() -> None:
    bm = manager()
    tokens = list(range(12))
    bm.allocate_prefix("a", tokens)
    bm.append_slots("a", 12)
    assert bm.gpu.num_cached == 0  # reserved, not computed yet
    assert bm.commit("a", tokens, 6) == 1  # the forward wrote 6 tokens: one full block
    assert bm.commit("a", tokens, 6) == 0
    assert bm.match_prefix(tokens + [1]).num_cached_tokens == 4
    assert bm.commit("a", tokens, 12) == 2
    assert bm.match_prefix(tokens + [1]).num_cached_tokens == 12


def test_hits_are_verified_against_the_stored_tokens(monkeypatch) -> None:
    monkeypatch.setattr(prefix_caching, "hash_block", lambda parent, tokens: 42)  # every block collides
    bm = manager()
    run(bm, "a", [1, 2, 3, 4, 5])
    assert bm.match_prefix([1, 2, 3, 5, 5]).num_cached_tokens == 0  # same key, other tokens: a miss
    assert bm.match_prefix([1, 2, 3, 4, 6]).num_cached_tokens == 4
    # the second block [1, 2, 3, 4] after [1, 2, 3, 4] has the key of the first block: a collision, never a hit
    bm.free("a")
    run(bm, "b", [1, 2, 3, 4, 1, 2, 3, 4, 0])
    match = bm.match_prefix([1, 2, 3, 4, 1, 2, 3, 4, 0])
    assert match.num_hit_blocks == 1 and match.blocks == (bm.block_table("b")[0],)
    check_pools(bm)


def test_forced_collision_with_equal_tokens_after_another_prefix_is_not_reused(monkeypatch) -> None:
    """The hash ignores the parent: the entry's parent must still be checked (tokens alone are not enough)."""
    monkeypatch.setattr(prefix_caching, "hash_block", lambda parent, tokens: hash(tuple(tokens)))
    bm = manager()
    run(bm, "a", [1, 1, 1, 1, 9, 9, 9, 9, 0])  # [9,9,9,9] after [1,1,1,1] is cached under key(9,9,9,9)
    run(bm, "c", [2, 2, 2, 2, 9, 9, 9, 9, 0])  # [9,9,9,9] after [2,2,2,2]: same key, in use -> not cached
    x_block = bm.block_table("a")[1]
    bm.free("a")
    match = bm.match_prefix([2, 2, 2, 2, 9, 9, 9, 9, 5])
    assert match.num_hit_blocks == 1 and x_block not in match.blocks
    assert run(bm, "d", [2, 2, 2, 2, 9, 9, 9, 9, 5]) == 4
    assert x_block not in bm.block_table("d")
    check_pools(bm)


def test_random_prompts_under_a_constant_hash_read_back_their_own_prefix(monkeypatch) -> None:
    """A seeded walk with every key equal: each admitted sequence's mapped blocks hold exactly its prefix."""
    import random

    monkeypatch.setattr(prefix_caching, "hash_block", lambda parent, tokens: 0)
    rng = random.Random(5)
    bm = manager(num_blocks=12, block_size=2)
    content: dict[int, tuple] = {}  # slot -> the prefix its K/V was computed from
    live: dict[int, list[int]] = {}
    history = [[0, 1, 0, 1, 0, 1]]
    hits = 0
    for step in range(400):
        if live and (rng.random() < 0.4 or bm.gpu.num_free < 4):
            seq = rng.choice(sorted(live))
            bm.free(seq)
            history.append(live.pop(seq))
            continue
        source = rng.choice(history)
        tokens = source[: rng.randint(0, len(source))] + [rng.randrange(2) for _ in range(rng.randint(1, 5))]
        match = bm.match_prefix(tokens)
        if bm.blocks_needed_to_admit([(match, len(tokens) - match.num_cached_tokens)]) > bm.gpu.num_free:
            continue
        cached = bm.allocate_prefix(step, tokens, match)
        hits += cached > 0
        for p, slot in enumerate(bm.slot_mapping(step, 0, cached)):
            assert content[slot] == tuple(tokens[: p + 1]), "a hit mapped K/V of another prefix"
        result = bm.append_slots(step, len(tokens) - cached)
        for p, slot in enumerate(result.slots, cached):
            content[slot] = tuple(tokens[: p + 1])
        bm.commit(step, tokens, len(tokens))
        live[step] = tokens
        check_pools(bm)
    assert hits > 20


# ------------------------------------------------------------------------------------------------------ back-off


@pytest.mark.parametrize("block_size", [1, 4])
def test_fully_cached_prompt_recomputes_its_last_block_in_a_new_block(block_size) -> None:
    bm = manager(block_size=block_size)
    prompt = list(range(50, 58))  # a whole number of blocks
    run(bm, "a", prompt)
    cached_blocks = bm.block_table("a")
    bm.free("a")
    match = bm.match_prefix(prompt)
    assert match.num_hit_blocks == len(cached_blocks)
    assert match.num_cached_tokens == len(prompt) - block_size  # the last token's block is not mapped
    assert bm.allocate_prefix("b", prompt, match) == len(prompt) - block_size
    result = bm.append_slots("b", block_size)
    assert result.copies == []
    last = bm.block_table("b")[-1]
    assert last != cached_blocks[-1] and not bm.gpu.is_cached(last)
    assert all(slot // block_size == last for slot in result.slots)
    assert bm.gpu.is_cached(cached_blocks[-1]) and bm.gpu.ref_count(cached_blocks[-1]) == 0  # untouched, evictable
    bm.commit("b", prompt, len(prompt))  # a duplicate of the cached content: the new block stays unkeyed
    assert not bm.gpu.is_cached(last)
    check_pools(bm)


def test_prompt_with_a_partial_last_block_maps_every_full_block() -> None:
    bm = manager()
    run(bm, "a", list(range(9)))
    assert bm.match_prefix(list(range(9))).num_cached_tokens == 8  # only token 8 is computed


def test_one_token_prompt_and_empty_prompt() -> None:
    bm = manager(block_size=1)
    run(bm, "a", [3])
    assert bm.match_prefix([3]).num_cached_tokens == 0 and bm.match_prefix([3]).num_hit_blocks == 1
    assert bm.match_prefix([3, 4]).num_cached_tokens == 1
    assert bm.allocate_prefix("e", []) == 0 and bm.block_table("e") == []


# ------------------------------------------------------------------------------------------------------ writes


def test_truncate_into_a_cached_block_then_append_never_writes_the_cache() -> None:
    bm = manager()
    tokens = list(range(8))
    run(bm, "a", tokens)
    first, second = bm.block_table("a")
    # sole holder: the entry is dropped, then the block is written in place
    bm.truncate("a", 6)
    result = bm.append_slots("a", 1)
    assert result.copies == [] and result.slots == [second * 4 + 2]
    assert not bm.gpu.is_cached(second) and bm.gpu.is_cached(first)
    assert bm.match_prefix(tokens + [1]).num_cached_tokens == 4
    # shared holder: copy-on-write, the cached original keeps its entry
    run(bm, "b", [9] * 8)
    bm.fork("b", "c")
    shared = bm.block_table("b")[1]
    bm.truncate("b", 5)
    result = bm.append_slots("b", 1)
    assert result.copies == [(shared, bm.block_table("b")[1])]
    assert bm.gpu.is_cached(shared) and bm.match_prefix([9] * 8 + [1]).num_cached_tokens == 8
    check_pools(bm)


def test_fork_shares_committed_state_and_commits_dedupe() -> None:
    bm = manager()
    tokens = list(range(6))
    run(bm, "p", tokens)
    bm.fork("p", "c")
    bm.append_slots("p", 2)
    bm.append_slots("c", 2)  # copy-on-write of the shared partial block
    bm.commit("p", tokens + [1, 1], 8)
    bm.commit("c", tokens + [2, 2], 8)
    assert bm.match_prefix(tokens + [1, 1, 0]).num_cached_tokens == 8
    assert bm.match_prefix(tokens + [2, 2, 0]).num_cached_tokens == 8
    assert bm.block_table("p")[0] == bm.block_table("c")[0] and bm.gpu.num_cached == 3
    # a child forked after the parent's block filled but before the commit: both commit it, one entry
    run(bm, "q", list(range(20, 28)), commit=False)
    bm.fork("q", "r")
    bm.commit("q", list(range(20, 28)), 8)
    bm.commit("r", list(range(20, 28)), 8)
    assert bm.gpu.num_cached == 5
    for seq in ("p", "c", "q", "r"):
        bm.free(seq)
    assert bm.stats().used_blocks == 0 and bm.gpu.num_evictable == 5
    check_pools(bm)


# ------------------------------------------------------------------------------------------------------ eviction


def test_free_keeps_blocks_cached_and_a_later_request_hits_them() -> None:
    bm = manager(num_blocks=8)
    prompt = list(range(13))
    run(bm, "a", prompt)
    bm.free("a")
    assert bm.stats().used_blocks == 0 and bm.gpu.num_free == 8 and bm.gpu.num_evictable == 3
    assert bm.stats().cached_blocks == 3 and bm.stats().free_blocks == 8
    assert run(bm, "b", prompt[:12] + [0]) == 12  # every cached block, taken back from the evictable pool
    assert bm.gpu.num_evictable == 0
    check_pools(bm)


def test_allocation_takes_truly_free_blocks_before_evicting() -> None:
    bm = manager(num_blocks=4, block_size=2)
    run(bm, "a", [1, 2, 3, 4])
    bm.free("a")
    assert len(bm.gpu.free_blocks()) == 2 and bm.gpu.num_evictable == 2
    bm.allocate("x", 4)  # two blocks: both truly free, the cache survives
    assert bm.gpu.num_evictable == 2 and bm.match_prefix([1, 2, 3, 4, 0]).num_cached_tokens == 4
    bm.allocate("y", 2)  # one more: evicts the least recently released cached block
    assert bm.gpu.num_evictable == 1
    assert bm.match_prefix([1, 2, 3, 4, 0]).num_cached_tokens == 2  # the tail block went first
    assert bm.prefix_cache_stats().evictions == 1
    check_pools(bm)


def test_eviction_order_is_least_recently_released_first_tail_blocks_first() -> None:
    bm = manager(num_blocks=4, block_size=2)
    run(bm, "a", [1, 2, 3, 4])
    a0, a1 = bm.block_table("a")
    run(bm, "b", [5, 6, 7, 8])
    b0, b1 = bm.block_table("b")
    bm.free("a")
    bm.free("b")
    assert bm.gpu.evictable_blocks() == [a1, a0, b1, b0]
    # a hit takes a0 out of the pool; c's second block evicts the least recent one (a1)
    assert run(bm, "c", [1, 2, 0]) == 2
    assert bm.block_table("c") == [a0, a1] and not bm.gpu.is_cached(a1)
    assert bm.gpu.evictable_blocks() == [b1, b0]
    bm.free("c")  # a1 (unkeyed now) becomes truly free; a0, released again, is the most recent
    assert bm.gpu.free_blocks() == [a1] and bm.gpu.evictable_blocks() == [b1, b0, a0]
    taken = [bm.allocate(f"n{i}", 2)[0] for i in range(4)]
    assert taken == [a1, b1, b0, a0]  # free first, then least recently released first
    assert bm.gpu.num_cached == 0 and bm.prefix_cache_stats().evictions == 4
    check_pools(bm)


def test_pool_full_of_cached_blocks_is_all_allocatable() -> None:
    bm = manager(num_blocks=3, block_size=2)
    run(bm, "a", [1, 2, 3, 4, 5, 6])
    bm.free("a")
    assert bm.can_allocate(6) and not bm.can_allocate(7)
    bm.allocate("b", 6)
    assert bm.gpu.num_free == 0 and bm.gpu.num_cached == 0
    check_pools(bm)


def test_blocks_needed_to_admit_counts_evictable_hits_once() -> None:
    bm = manager(num_blocks=8, block_size=2)
    run(bm, "a", [1, 2, 3, 4, 5])
    match = bm.match_prefix([1, 2, 3, 4, 9, 9])
    assert bm.blocks_needed_to_admit([(match, 2)]) == 1  # in use by "a": free; one new block
    bm.free("a")
    match = bm.match_prefix([1, 2, 3, 4, 9, 9])
    assert bm.blocks_needed_to_admit([(match, 2)]) == 3  # two evictable hits + one new block
    assert bm.blocks_needed_to_admit([(match, 2), (match, 1)]) == 4  # shared hits count once
    free = bm.gpu.num_free
    bm.allocate_prefix("b", [1, 2, 3, 4, 9, 9], match)
    bm.append_slots("b", 2)
    assert free - bm.gpu.num_free == 3


def test_stale_match_is_refused() -> None:
    bm = manager(num_blocks=2, block_size=2)
    run(bm, "a", [1, 2, 3])
    bm.free("a")
    match = bm.match_prefix([1, 2, 3])
    bm.allocate("x", 4)  # evicts the matched block
    with pytest.raises(ValueError, match="stale match"):
        bm.allocate_prefix("b", [1, 2, 3], match)
    assert not bm.has_seq("b")


# ------------------------------------------------------------------------------------------------------ swap, stats


def test_swapped_out_blocks_stay_cached_on_the_gpu_only() -> None:
    bm = manager(num_blocks=8, block_size=2, num_cpu_blocks=8)
    run(bm, "a", [1, 2, 3, 4, 5])
    gpu_blocks = bm.block_table("a")
    bm.swap_out(["a"])
    assert bm.gpu.num_evictable == 2 and bm.match_prefix([1, 2, 3, 4, 0]).blocks == tuple(gpu_blocks[:2])
    assert not any(bm.cpu.is_cached(b) for b in bm.block_table("a"))
    assert bm.commit("a", [1, 2, 3, 4, 5], 5) == 0  # no-op while swapped
    bm.swap_in(["a"])
    assert not any(bm.gpu.is_cached(b) for b in bm.block_table("a"))  # fresh copies, unkeyed
    bm.append_slots("a", 1)
    bm.commit("a", [1, 2, 3, 4, 5, 6], 6)  # its next block chains on the entries it had
    assert bm.match_prefix([1, 2, 3, 4, 5, 6, 0]).num_cached_tokens == 6
    check_pools(bm)


def test_stats_and_counters() -> None:
    bm = manager(num_blocks=8, block_size=2)
    run(bm, "a", [1, 2, 3, 4, 5])
    run(bm, "b", [1, 2, 3, 4, 6])
    stats = bm.prefix_cache_stats()
    assert stats.enabled and stats.queries == 2 and stats.query_tokens == 10 and stats.hit_tokens == 4
    assert stats.hit_rate == 0.4 and stats.cached_blocks == 2 and stats.evictable_blocks == 0
    block_stats = bm.stats()
    assert block_stats.prefix_query_tokens == 10 and block_stats.prefix_hit_tokens == 4
    assert block_stats.prefix_hit_rate == 0.4 and block_stats.shared_blocks == 2
    assert block_stats.sharing_saving > 0


def test_caching_off_by_default_and_switchable_only_when_empty() -> None:
    bm = BlockManager(8, 2)
    assert not bm.enable_prefix_caching and type(bm.gpu) is core.BlockAllocator
    assert bm.match_prefix([1, 2, 3]) == core.PrefixMatch(num_tokens=3)
    assert bm.allocate_prefix("a", [1, 2, 3]) == 0 and bm.block_table("a") == []
    bm.append_slots("a", 3)
    assert bm.commit("a", [1, 2, 3], 3) == 0
    assert bm.allocate_prefix("b", [1, 2, 3]) == 0 and bm.prefix_cache_stats().query_tokens == 0
    with pytest.raises(ValueError, match="while sequences"):
        bm.set_prefix_caching(True)
    bm.free("a")
    bm.free("b")
    bm.set_prefix_caching(True)
    assert isinstance(bm.gpu, core.CachingBlockAllocator)
    with pytest.raises(ValueError, match="bool"):
        bm.set_prefix_caching(1)  # type: ignore[arg-type]
    bm.reset()
    assert bm.enable_prefix_caching and bm.gpu.num_free == 8


# ------------------------------------------------------------------------------------------------------ scheduler


def group(tokens: list[int], arrival: int, request_id=None) -> SequenceGroup:
    seq = Sequence(token_ids=list(tokens), prompt_len=len(tokens))
    return SequenceGroup(request_id or f"r{arrival}", [seq], arrival)


def finish_step(sched: Scheduler, out, sample: int = 7) -> None:
    """The engine's part of a step: tokens computed, sampling sequences get a token."""
    for item in out.scheduled:
        item.seq.num_computed += item.num_tokens
    for item in out.scheduled:
        if item.sample:
            item.seq.token_ids.append(sample)


def test_scheduler_admits_past_the_cached_prefix_and_waits_for_one_being_computed() -> None:
    bm = manager(num_blocks=32, block_size=4)
    sched = Scheduler(bm, max_num_batched_tokens=64)
    system = list(range(100, 112))  # 3 blocks
    first, second, third = group(system + [1, 2], 0), group(system + [3], 1), group(system + [4, 4, 4, 4, 4], 2)
    for g in (first, second, third):
        sched.add(g)
    out = sched.schedule()
    # the second request's next block is being computed by the first one right now: it waits a step
    assert [(i.group, i.start, i.num_tokens) for i in out.scheduled] == [(first, 0, 14)]
    assert second in sched.waiting and second.seqs[0].num_computed == 0
    finish_step(sched, out)
    out = sched.schedule()  # commits the first request's blocks, then admits both with 12 cached tokens
    starts = {i.group.request_id: (i.start, i.num_tokens) for i in out.scheduled}
    assert starts == {"r0": (14, 1), "r1": (12, 1), "r2": (12, 5)}
    assert bm.block_table(second.seqs[0].seq_id)[:3] == bm.block_table(first.seqs[0].seq_id)[:3]
    assert bm.prefix_hit_tokens == 24
    finish_step(sched, out)
    for g in (first, second, third):
        sched.finish_group(g, SequenceStatus.FINISHED_STOPPED)
    assert bm.stats().used_blocks == 0
    check_pools(bm)


@pytest.mark.parametrize("num_blocks", [64, 16])
def test_keying_a_launched_step_and_hashing_admissions_ahead_change_no_decision(num_blocks: int) -> None:
    """The engine keys a step's blocks once its forward is launched (`commit_launched`) and hashes the next
    admissions' prompts ahead (`prepare_admissions`). Two schedulers fed the same requests, one doing both after
    every step, schedule the same items, slots, copies and hits at every step; the launched step's full blocks are
    cached before the next `schedule()`; prompts are hashed ahead only within one step's budgets, and their keys are
    dropped once admitted. The small pool preempts (recompute: prompts and outputs hashed again)."""
    rng = random.Random(5)
    system = [rng.randrange(1000) for _ in range(10)]
    prompts = [system + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))] for _ in range(12)]
    runs = []
    for ahead in (False, True):
        bm = manager(num_blocks=num_blocks, block_size=4)
        sched = Scheduler(bm, max_num_batched_tokens=24, max_num_seqs=4)
        groups = [group(p, i) for i, p in enumerate(prompts)]
        for g in groups:
            g.params = 6  # output tokens
            sched.add(g)
        trace = []
        for _ in range(200):
            if not sched.has_unfinished():
                break
            out = sched.schedule()
            trace.append([(i.group.request_id, i.start, i.num_tokens, tuple(i.slots)) for i in out.scheduled]
                         + [tuple(out.copies), bm.prefix_hit_tokens])
            assert all(g.seqs[0].prompt_keys is None for g in sched.running)  # admitted: the record holds them
            if ahead:
                sched.commit_launched(out)
                for item in out.scheduled:  # every full block the step computes is keyed now
                    end = (item.start + item.num_tokens) // 4
                    if item.num_tokens > 1:
                        assert all(bm.gpu.is_cached(b) for b in bm.block_table(item.seq.seq_id)[:end])
                sched.prepare_admissions()
                hashed = [g for g in sched.waiting if g.seqs[0].prompt_keys is not None]
                assert hashed == sched.waiting[: len(hashed)] and len(hashed) <= 4
                for g in hashed:
                    seq = g.seqs[0]
                    assert seq.prompt_keys == bm.chain_keys(seq.token_ids[: seq.prompt_len])
            finish_step(sched, out)
            for g in list(sched.running):
                if g.seqs[0].num_tokens - g.seqs[0].prompt_len >= g.params:
                    sched.finish_group(g, SequenceStatus.FINISHED_LENGTH)
        assert not sched.has_unfinished()
        check_pools(bm)
        runs.append(trace)
        assert (sched.num_preemptions["recompute"] > 0) == (num_blocks < 64)
    assert runs[0] == runs[1]
    assert runs[1][-1][-1] > 0  # the shared system prompt was hit


def test_scheduler_fully_cached_prompt_computes_its_last_block() -> None:
    bm = manager(num_blocks=16, block_size=4)
    sched = Scheduler(bm)
    prompt = list(range(8))
    g = group(prompt, 0)
    sched.add(g)
    finish_step(sched, sched.schedule())
    sched.finish_group(g, SequenceStatus.FINISHED_STOPPED)  # commits, frees: its blocks stay cached
    again = group(prompt, 1)
    sched.add(again)
    out = sched.schedule()
    assert [(i.start, i.num_tokens, i.sample) for i in out.scheduled] == [(4, 4, True)]
    assert out.copies == [] and all(not bm.gpu.is_cached(slot // 4) for slot in out.scheduled[0].slots)


def test_recompute_preemption_hits_its_own_blocks_on_readmission() -> None:
    bm = manager(num_blocks=7, block_size=2)  # both fit (3 + 3 blocks + 1 of headroom), then run out
    sched = Scheduler(bm, max_num_batched_tokens=32)
    old, new = group(list(range(10, 16)), 0), group(list(range(20, 25)), 1)
    sched.add(old)
    sched.add(new)
    out = sched.schedule()
    finish_step(sched, out)
    preempted = []
    for _ in range(6):
        out = sched.schedule()
        preempted += out.preempted
        finish_step(sched, out)
        if preempted:
            break
    assert preempted == [new] and new in sched.waiting
    hits_before = bm.prefix_hit_tokens
    while new in sched.waiting:  # finish the old request to make room
        if old.seqs[0].num_tokens >= 9:
            sched.finish_group(old, SequenceStatus.FINISHED_LENGTH)
        out = sched.schedule()
        finish_step(sched, out)
    assert bm.prefix_hit_tokens - hits_before >= 4  # the preempted request's own computed blocks
    check_pools(bm)




def test_commit_rows_keys_what_commit_keys() -> None:
    """`commit_rows` (the blocks a decode batch's rows just filled, by record) gives every sequence the keys, entries
    and cache entries that `commit` gives it: on its own path (one new block after the keyed ones, stale or not) and
    through `commit` for the rows it hands over (a prompt's keys still pending, a lag of two blocks)."""
    rng = random.Random(5)
    shared = [rng.randrange(1000) for _ in range(8)]
    tokens = {k: shared + [rng.randrange(1000) for _ in range(20)] for k in range(5)}
    # (keyed after admission, tokens reserved, end of the filled block)
    plans = {0: (True, 12, 12), 1: (True, 16, 16), 2: (False, 12, 12), 3: (True, 12, 12), 4: (True, 13, 12)}

    def build() -> BlockManager:
        bm = manager(num_blocks=40)
        for k, (keyed, reserved, _) in plans.items():
            bm.append_slots(k, 10 - bm.allocate_prefix(k, tokens[k][:10]))
            if keyed:
                bm.commit(k, tokens[k], 10)
            bm.append_slots(k, reserved - bm.num_tokens(k))
        bm._seqs[3].stale = True  # e.g. the weights changed while it ran: its blocks are never offered
        return bm

    one, rows = build(), build()
    for k, (_, _, end) in plans.items():
        one.commit(k, tokens[k], end)
    rows.commit_rows([rows._seqs[k] for k in plans], [tokens[k] for k in plans], [end for _, _, end in plans.values()])
    for k in plans:
        a, b = one._seqs[k], rows._seqs[k]
        assert (a.keys, a.entries, a.committed) == (b.keys, b.entries, b.committed), k
        assert b.committed == plans[k][2] // 4
    assert rows._seqs[3].entries[-1] is None and rows._seqs[0].entries[-1] is not None
    for k in plans:
        probe = tokens[k][:12] + [1]
        assert one.match_prefix(probe).num_cached_tokens == rows.match_prefix(probe).num_cached_tokens
    assert rows.match_prefix(tokens[0][:12] + [1]).num_cached_tokens == 12
    check_pools(rows)


@pytest.mark.parametrize("collide", [False, True])
def test_salted_sequences_share_only_within_their_salt(monkeypatch, collide):
    """A salt (a LoRA adapter's id) roots the key chain: the same tokens under another salt never hit, also when every
    key collides (the parent entry is verified too); the same salt hits, forks keep it."""
    if collide:
        monkeypatch.setattr(prefix_caching, "hash_block", lambda parent, tokens: 7)
    bm = manager(num_blocks=32)
    tokens = list(range(1, 14))  # 3 full blocks and a partial one
    m0 = bm.match_prefix(tokens)
    bm.allocate_prefix("base", tokens, m0)
    bm.append_slots("base", len(tokens))
    bm.commit("base", tokens, len(tokens))
    for salt in (3, 4):
        match = bm.match_prefix(tokens, salt=salt)
        assert match.num_cached_tokens == 0 and match.salt == salt
        assert bm.allocate_prefix(("s", salt), tokens, match) == 0
        bm.append_slots(("s", salt), len(tokens))
        bm.commit(("s", salt), tokens, len(tokens))
    bm.fork(("s", 3), "child")
    bm.free(("s", 3))
    if not collide:  # (colliding keys: each salt's registration took the key over from the last, as collisions do)
        assert bm.match_prefix(tokens).num_cached_tokens == 12
        assert bm.match_prefix(tokens, salt=4).num_cached_tokens == 12
    assert bm.match_prefix(tokens, salt=5).num_cached_tokens == 0
    for key in ("base", ("s", 4), "child"):
        bm.free(key)
    check_pools(bm)
