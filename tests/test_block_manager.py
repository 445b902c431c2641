"""Tests of hf_paged.core.block_manager: unit tests per method and error, plus a Hypothesis state machine.

The state machine keeps a shadow of the KV pools (slot -> token id) and performs the copies the manager asks for, so
it checks the end-to-end property that matters: every live sequence reads back exactly its own tokens, whatever
forks, copy-on-writes, truncations and swaps happened to its neighbours.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "hf_paged"
PACKAGE = "_hf_paged_block_manager_under_test"


def _load_by_path() -> ModuleType:
    """Load hf_paged's pure-Python `core` package without running hf_paged/__init__.py.

    The package __init__ imports torch and transformers (seconds); `hf_paged.core` is pure Python, so its tests load
    the package directory under a private name and run in about a second. It never collides with a normal
    ``import hf_paged``.
    """
    if PACKAGE not in sys.modules:
        package = ModuleType(PACKAGE)
        package.__path__ = [str(PACKAGE_DIR)]
        sys.modules[PACKAGE] = package
    return importlib.import_module(f"{PACKAGE}.core")


core = _load_by_path()
block_pool = importlib.import_module(f"{PACKAGE}.core.block_pool")
# where the prefix cache looks the hash function up (patched to force collisions)
prefix_caching = importlib.import_module(f"{PACKAGE}.core.prefix_caching")
AppendResult = core.AppendResult
BlockAllocator = core.BlockAllocator
BlockManager = core.BlockManager
BlockStats = core.BlockStats
NoFreeBlocksError = core.NoFreeBlocksError


def snapshot(bm: BlockManager) -> tuple:
    """Everything observable about a manager, to assert that a failed operation changed nothing."""
    seqs = tuple((s, tuple(bm.block_table(s)), bm.num_tokens(s), bm.is_swapped(s)) for s in bm.seq_ids())
    pools = tuple(
        (
            tuple(a.ref_count(b) for b in range(a.num_blocks)),
            tuple(a.free_blocks()),
            a.num_shared,
            tuple(a.is_cached(b) for b in range(a.num_blocks)),
            tuple(getattr(a, "evictable_blocks", list)()),
        )
        for a in (bm.gpu, bm.cpu)
    )
    return seqs, pools


# --------------------------------------------------------------------------------------------------- import hygiene


def test_module_does_not_import_torch() -> None:
    # Loaded by path so that hf_paged/__init__.py (which may import torch) is not executed.
    code = (
        "import importlib, sys, types\n"
        f"package = types.ModuleType('bm_isolated'); package.__path__ = [{str(PACKAGE_DIR)!r}]\n"
        "sys.modules['bm_isolated'] = package\n"
        "module = importlib.import_module('bm_isolated.core.block_manager')\n"
        "bm = module.BlockManager(4, 2)\n"
        "bm.allocate(0, 3)\n"
        "assert 'torch' not in sys.modules, 'block_manager imported torch'\n"
        "assert 'numpy' not in sys.modules, 'block_manager imported numpy'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_public_api_exported() -> None:
    assert set(core.__all__) == {
        "AppendResult",
        "BlockAllocator",
        "BlockManager",
        "BlockStats",
        "CachingBlockAllocator",
        "GroupedBlockManager",
        "LayerGroups",
        "NULL_BLOCK",
        "NoFreeBlocksError",
        "NoFreeSlotsError",
        "PrefixCacheStats",
        "PrefixMatch",
        "ScheduledSeq",
        "Scheduler",
        "SchedulerOutput",
        "Sequence",
        "SequenceGroup",
        "SequenceStatus",
        "SlotOps",
        "StateSlots",
        "hash_block",
        "plan_layer_groups",
    }
    assert all(hasattr(core, name) for name in core.__all__)
    assert issubclass(NoFreeBlocksError, RuntimeError)


# --------------------------------------------------------------------------------------------------- BlockAllocator


@pytest.mark.parametrize("bad", [-1, 1.5, "3", None, True])
def test_allocator_rejects_bad_num_blocks(bad: object) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(bad)  # type: ignore[arg-type]


def test_allocator_empty_pool() -> None:
    a = BlockAllocator(0)
    assert a.num_blocks == 0 and a.num_free == 0 and a.num_used == 0
    with pytest.raises(NoFreeBlocksError):
        a.allocate()


def test_allocator_allocate_order_and_exhaustion() -> None:
    a = BlockAllocator(3)
    assert a.num_free == 3
    assert [a.allocate() for _ in range(3)] == [0, 1, 2]
    assert a.num_free == 0 and a.num_used == 3
    assert all(a.ref_count(b) == 1 and not a.is_free(b) for b in range(3))
    with pytest.raises(NoFreeBlocksError, match="no free block"):
        a.allocate()


def test_allocator_incref_decref() -> None:
    a = BlockAllocator(2)
    b = a.allocate()
    a.incref(b)
    assert a.ref_count(b) == 2 and a.num_shared == 1
    a.incref(b)
    assert a.ref_count(b) == 3 and a.num_shared == 1
    assert a.decref(b) is False
    assert a.decref(b) is False
    assert a.num_shared == 0 and a.ref_count(b) == 1
    assert a.decref(b) is True
    assert a.is_free(b) and a.ref_count(b) == 0 and a.num_free == 2


def test_allocator_reuses_freed_block_first() -> None:
    a = BlockAllocator(4)
    first, second = a.allocate(), a.allocate()
    a.decref(first)
    assert a.allocate() == first
    assert a.allocate() not in (first, second)


def test_allocator_errors_name_block() -> None:
    a = BlockAllocator(2)
    with pytest.raises(ValueError, match="block 0 is free"):
        a.incref(0)
    with pytest.raises(ValueError, match="block 1 is already free"):
        a.decref(1)
    for bad in (-1, 2, 1.0, None, True):
        for method in (a.incref, a.decref, a.ref_count, a.is_free):
            with pytest.raises(ValueError, match="block must be"):
                method(bad)  # type: ignore[arg-type]


def test_allocator_free_blocks_is_a_copy() -> None:
    a = BlockAllocator(3)
    free = a.free_blocks()
    free.clear()
    assert len(a.free_blocks()) == 3
    assert "num_free=3" in repr(a)


def test_allocator_prefix_cache_seam() -> None:
    """All allocation and release goes through the two private hooks a prefix cache would override."""

    class Recording(BlockAllocator):
        def __init__(self, num_blocks: int) -> None:
            self.taken: list[int] = []
            self.released: list[int] = []
            super().__init__(num_blocks)

        def _take_free_block(self) -> int:
            block = super()._take_free_block()
            self.taken.append(block)
            return block

        def _release_block(self, block: int) -> None:
            self.released.append(block)
            super()._release_block(block)

    a = Recording(3)
    x, y = a.allocate(), a.allocate()
    a.incref(x)
    a.decref(x)
    a.decref(x)
    a.decref(y)
    assert a.taken == [x, y] and a.released == [x, y]


# --------------------------------------------------------------------------------------------------- construction


@pytest.mark.parametrize("bad", [0, 3, 6, -2, 1.5, True, None])
def test_manager_rejects_bad_block_size(bad: object) -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(8, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, 2.0, None])
def test_manager_rejects_bad_num_blocks(bad: object) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(bad, 4)  # type: ignore[arg-type]


def test_manager_rejects_bad_num_cpu_blocks() -> None:
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        BlockManager(4, 4, num_cpu_blocks=-1)


def test_manager_attributes() -> None:
    bm = BlockManager(8, 4, num_cpu_blocks=3)
    assert (bm.num_blocks, bm.block_size, bm.num_cpu_blocks) == (8, 4, 3)
    assert bm.gpu.num_blocks == 8 and bm.cpu.num_blocks == 3
    assert BlockManager(8, 1).cpu.num_blocks == 0
    assert "block_size=4" in repr(bm)


# --------------------------------------------------------------------------------------------------- sizing, allocate


def test_blocks_for() -> None:
    bm = BlockManager(8, 4)
    assert [bm.blocks_for(n) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert BlockManager(8, 1).blocks_for(7) == 7
    with pytest.raises(ValueError, match="num_tokens"):
        bm.blocks_for(-1)


def test_can_allocate() -> None:
    bm = BlockManager(2, 4)
    assert bm.can_allocate(8) and not bm.can_allocate(9)
    bm.allocate("a", 1)
    assert bm.can_allocate(4) and not bm.can_allocate(5)
    with pytest.raises(ValueError, match="num_tokens"):
        bm.can_allocate(-3)


def test_allocate_builds_table() -> None:
    bm = BlockManager(8, 4)
    table = bm.allocate("a", 6)
    assert table == [0, 1] == bm.block_table("a")
    assert bm.num_tokens("a") == 6
    assert bm.slot_mapping("a", 0, 6) == [0, 1, 2, 3, 4, 5]
    table.append(99)  # the returned list is a copy
    assert bm.block_table("a") == [0, 1]
    assert bm.gpu.num_free == 6


def test_allocate_zero_tokens() -> None:
    bm = BlockManager(2, 4)
    assert bm.allocate("a", 0) == []
    assert bm.num_tokens("a") == 0 and bm.gpu.num_free == 2
    result = bm.append_slots("a", 1)
    assert result.slots == [0] and result.copies == []


def test_allocate_errors() -> None:
    bm = BlockManager(2, 4)
    bm.allocate("a", 1)
    with pytest.raises(ValueError, match="seq_id 'a' already exists"):
        bm.allocate("a", 1)
    with pytest.raises(ValueError, match="num_tokens"):
        bm.allocate("b", -1)
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("b", 5)
    assert snapshot(bm) == before and not bm.has_seq("b")


# --------------------------------------------------------------------------------------------------- fork, CoW


def test_fork_shares_every_block() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("p", 6)
    bm.fork("p", "c")
    assert bm.block_table("c") == bm.block_table("p")
    assert bm.num_tokens("c") == 6
    assert all(bm.gpu.ref_count(b) == 2 for b in bm.block_table("p"))
    assert bm.gpu.num_free == 6  # fork never allocates


def test_fork_errors() -> None:
    bm = BlockManager(8, 4, num_cpu_blocks=4)
    bm.allocate("p", 3)
    bm.allocate("q", 3)
    with pytest.raises(ValueError, match="parent_id 'x' is unknown"):
        bm.fork("x", "c")
    with pytest.raises(ValueError, match="child_id 'q' already exists"):
        bm.fork("p", "q")
    with pytest.raises(ValueError, match="child_id 'p' already exists"):
        bm.fork("p", "p")
    bm.swap_out(["p"])
    with pytest.raises(ValueError, match="parent_id 'p' is swapped out"):
        bm.fork("p", "c")


def test_copy_on_write_after_fork() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("p", 6)  # blocks [0, 1], block 1 half full
    bm.fork("p", "c")
    parent_table = bm.block_table("p")
    assert bm.blocks_needed_to_append("c") == 1  # the copy, no new block
    result = bm.append_slots("c")
    new = bm.block_table("c")[-1]
    assert result.copies == [(1, new)] and new not in parent_table
    assert result.slots == [new * 4 + 2]
    assert bm.block_table("c") == [0, new]
    assert bm.block_table("p") == parent_table
    assert bm.gpu.ref_count(1) == 1 and bm.gpu.ref_count(0) == 2 and bm.gpu.ref_count(new) == 1
    # The parent is now the sole holder of block 1: it writes in place.
    assert bm.blocks_needed_to_append("p") == 0
    result = bm.append_slots("p")
    assert result.copies == [] and result.slots == [1 * 4 + 2]


def test_copy_on_write_with_new_block_in_same_append() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("p", 3)
    bm.fork("p", "c")
    assert bm.blocks_needed_to_append("c", 3) == 2  # copy + one new block
    result = bm.append_slots("c", 3)
    table = bm.block_table("c")
    assert result.copies == [(0, table[0])]
    assert result.slots == [table[0] * 4 + 3, table[1] * 4, table[1] * 4 + 1]


def test_full_shared_last_block_needs_no_copy() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("p", 8)
    bm.fork("p", "c")
    assert bm.blocks_needed_to_append("c") == 1
    result = bm.append_slots("c")
    assert result.copies == []
    table = bm.block_table("c")
    assert table[:2] == bm.block_table("p") and len(table) == 3
    assert result.slots == [table[2] * 4]
    assert bm.gpu.ref_count(table[1]) == 2


def test_cow_needs_a_free_block_and_fails_cleanly() -> None:
    bm = BlockManager(2, 4)
    bm.allocate("p", 5)  # both blocks used
    bm.fork("p", "c")
    assert bm.blocks_needed_to_append("c") == 1 and not bm.can_append("c")
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError, match="needs 1 blocks"):
        bm.append_slots("c")
    assert snapshot(bm) == before


def test_beam_like_fork_tree() -> None:
    bm = BlockManager(16, 2)
    bm.allocate(0, 3)
    for child in (1, 2, 3):
        bm.fork(0, child)
    assert bm.gpu.ref_count(bm.block_table(0)[-1]) == 4
    copies = [bm.append_slots(s).copies for s in (0, 1, 2, 3)]
    assert [len(c) for c in copies] == [1, 1, 1, 0]  # the last holder writes in place
    bm.free(0)
    bm.free(1)
    assert bm.gpu.ref_count(bm.block_table(2)[0]) == 2


def test_blocks_needed_to_append_many_counts_last_sibling_in_place() -> None:
    bm = BlockManager(16, 4)
    bm.allocate("p", 6)
    bm.fork("p", "c1")
    bm.fork("p", "c2")
    bm.allocate("x", 4)
    assert sum(bm.blocks_needed_to_append(s) for s in ("p", "c1", "c2")) == 3
    assert bm.blocks_needed_to_append_many([("p", 1), ("c1", 1), ("c2", 1)]) == 2
    assert bm.blocks_needed_to_append_many([("p", 1), ("c1", 1)]) == 2  # c2 still holds it: both copy
    assert bm.blocks_needed_to_append_many([("p", 3), ("c1", 1), ("c2", 0), ("x", 1)]) == 2 + 1 + 1
    assert bm.blocks_needed_to_append_many([]) == 0
    free = bm.gpu.num_free
    for s in ("c2", "p", "c1"):
        bm.append_slots(s)
    assert free - bm.gpu.num_free == 2
    with pytest.raises(ValueError, match="requests lists 'p' twice"):
        bm.blocks_needed_to_append_many([("p", 1), ("p", 1)])
    with pytest.raises(ValueError, match="requests entry 'q' is unknown"):
        bm.blocks_needed_to_append_many([("q", 1)])
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.blocks_needed_to_append_many([("p", -1)])


# --------------------------------------------------------------------------------------------------- append


def test_append_across_blocks() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("a", 3)
    assert bm.blocks_needed_to_append("a", 1) == 0
    assert bm.blocks_needed_to_append("a", 2) == 1
    assert bm.blocks_needed_to_append("a", 10) == 3
    result = bm.append_slots("a", 6)
    assert isinstance(result, AppendResult)
    assert bm.block_table("a") == [0, 1, 2]
    assert result.slots == [3, 4, 5, 6, 7, 8] and result.copies == []
    assert bm.num_tokens("a") == 9


def test_append_zero_tokens() -> None:
    bm = BlockManager(4, 4)
    bm.allocate("p", 2)
    bm.fork("p", "c")
    assert bm.blocks_needed_to_append("c", 0) == 0
    assert bm.append_slots("c", 0) == AppendResult(slots=[], copies=[])
    assert bm.block_table("c") == bm.block_table("p")


def test_append_errors() -> None:
    bm = BlockManager(2, 2, num_cpu_blocks=2)
    bm.allocate("a", 3)
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.append_slots("a", -1)
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.blocks_needed_to_append("a", -1)
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.can_append("a", 1.5)  # type: ignore[arg-type]
    for method in (bm.append_slots, bm.blocks_needed_to_append, bm.can_append):
        with pytest.raises(ValueError, match="seq_id 'zz' is unknown"):
            method("zz")
    assert bm.can_append("a", 1) and not bm.can_append("a", 2)
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots("a", 2)
    assert snapshot(bm) == before
    bm.swap_out(["a"])
    for method in (bm.append_slots, bm.blocks_needed_to_append, bm.can_append):
        with pytest.raises(ValueError, match="swapped out"):
            method("a")


# --------------------------------------------------------------------------------------------------- truncate, free


def test_truncate_frees_trailing_blocks() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("a", 10)
    bm.truncate("a", 10)
    assert bm.block_table("a") == [0, 1, 2]
    bm.truncate("a", 5)
    assert bm.block_table("a") == [0, 1] and bm.num_tokens("a") == 5
    assert bm.gpu.is_free(2)
    assert bm.append_slots("a", 1).slots == [5]
    bm.truncate("a", 0)
    assert bm.block_table("a") == [] and bm.gpu.num_free == 8


def test_truncate_errors() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("a", 5)
    with pytest.raises(ValueError, match="num_tokens must be <= 5"):
        bm.truncate("a", 6)
    with pytest.raises(ValueError, match="num_tokens"):
        bm.truncate("a", -1)
    with pytest.raises(ValueError, match="seq_id 'b' is unknown"):
        bm.truncate("b", 0)


def test_truncate_into_shared_block_then_append_copies() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("p", 8)
    bm.fork("p", "c")
    bm.truncate("c", 6)  # block 1 is full for the parent, half full for the child
    assert bm.block_table("c") == [0, 1] and bm.gpu.ref_count(1) == 2
    result = bm.append_slots("c")
    new = bm.block_table("c")[1]
    assert result.copies == [(1, new)] and result.slots == [new * 4 + 2]
    assert bm.block_table("p") == [0, 1]


def test_truncate_shared_blocks_drops_only_own_reference() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("p", 8)
    bm.fork("p", "c")
    bm.truncate("c", 3)
    assert bm.gpu.ref_count(1) == 1 and bm.gpu.ref_count(0) == 2
    assert not bm.gpu.is_free(1)


def test_free_returns_blocks() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("p", 6)
    bm.fork("p", "c")
    bm.append_slots("c", 3)
    bm.free("p")
    assert not bm.has_seq("p")
    assert all(bm.gpu.ref_count(b) == 1 for b in bm.block_table("c"))
    bm.free("c")
    assert bm.gpu.num_free == 8 and bm.seq_ids() == []


def test_free_unknown_is_value_error() -> None:
    bm = BlockManager(8, 4)
    with pytest.raises(ValueError, match="seq_id 7 is unknown") as info:
        bm.free(7)
    assert not isinstance(info.value, KeyError)
    with pytest.raises(ValueError, match="seq_id"):
        bm.free([1])  # unhashable


# --------------------------------------------------------------------------------------------------- queries


def test_queries() -> None:
    bm = BlockManager(8, 2)
    bm.allocate("b", 1)
    bm.allocate("a", 3)
    assert bm.seq_ids() == ["b", "a"]
    assert bm.has_seq("a") and not bm.has_seq("c") and not bm.has_seq([1])
    table = bm.block_table("a")
    table.clear()
    assert bm.block_table("a") == [1, 2]
    assert bm.num_tokens("a") == 3
    assert not bm.is_swapped("a")
    for method in (bm.block_table, bm.num_tokens, bm.is_swapped):
        with pytest.raises(ValueError, match="seq_id 'c' is unknown"):
            method("c")


def test_slot_mapping() -> None:
    bm = BlockManager(8, 2)
    bm.allocate("x", 1)  # takes block 0
    bm.allocate("a", 5)  # blocks 1, 2, 3
    assert bm.slot_mapping("a", 0, 5) == [2, 3, 4, 5, 6]
    assert bm.slot_mapping("a", 3, 4) == [5]
    assert bm.slot_mapping("a", 2, 2) == []
    with pytest.raises(ValueError, match="end must be <= 5"):
        bm.slot_mapping("a", 0, 6)
    with pytest.raises(ValueError, match="start must be <= end"):
        bm.slot_mapping("a", 3, 2)
    with pytest.raises(ValueError, match="start"):
        bm.slot_mapping("a", -1, 2)
    with pytest.raises(ValueError, match="seq_id 'q' is unknown"):
        bm.slot_mapping("q", 0, 0)


@pytest.mark.parametrize("block_size", [1, 2, 16, 32])
def test_slot_mapping_of_long_ranges_is_per_position(block_size: int) -> None:
    """Ranges longer than two blocks are built block by block (`BlockManager._slots`): every range of a shuffled table,
    partial first and last blocks included, gives table[p // bs] * bs + p % bs for each position p."""
    import random

    rng = random.Random(block_size)
    bm = BlockManager(400, block_size)
    bm.allocate("pad", 37 * block_size)
    for i in range(6):  # freed tables go back on the free stack: the next table's blocks are not consecutive
        bm.allocate(f"s{i}", rng.randint(1, 5) * block_size)
    for i in range(6):
        bm.free(f"s{i}")
    n = 50 * block_size + 3
    bm.allocate("a", n)
    table = bm.block_table("a")
    assert any(b != a + 1 for a, b in zip(table, table[1:]))
    ranges = [(0, n), (1, n), (block_size - 1, 3 * block_size + 1), (5, 5 + 2 * block_size + 1),
              (n - 2 * block_size - 2, n)]
    ranges += [(a, a + rng.randint(0, n - a)) for a in rng.sample(range(n), 20)]
    for start, end in ranges:
        want = [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        assert bm.slot_mapping("a", start, end) == want, (start, end)


def test_allocator_allocate_many_is_allocate_repeated() -> None:
    """`allocate_many(n)` takes the blocks `n` calls of `allocate` would, in order, evicting the least recently released
    cached block only when no block is truly free; all or nothing."""
    caching = core.CachingBlockAllocator
    for cls in (BlockAllocator, caching):
        a, b = cls(6), cls(6)
        for pool in (a, b):
            held = [pool.allocate() for _ in range(6)]
            if cls is caching:
                for k, block in enumerate(held[:3]):
                    pool.register(block, 100 + k, 0, (k,))
            for block in (held[4], held[1], held[2], held[0]):
                pool.decref(block)
        assert a.allocate_many(3) == [b.allocate() for _ in range(3)]
        assert [a.ref_count(x) for x in range(6)] == [b.ref_count(x) for x in range(6)]
        before = (a.free_blocks(), a.num_free)
        with pytest.raises(NoFreeBlocksError, match="2 blocks asked, only 1"):
            a.allocate_many(2)
        assert (a.free_blocks(), a.num_free) == before
        assert a.allocate_many(0) == []


def test_slot_mapping_of_swapped_sequence_is_refused() -> None:
    bm = BlockManager(4, 2, num_cpu_blocks=4)
    bm.allocate("a", 3)
    bm.swap_out(["a"])
    with pytest.raises(ValueError, match="swapped out"):
        bm.slot_mapping("a", 0, 1)


# --------------------------------------------------------------------------------------------------- stats, reset


def test_stats_empty() -> None:
    stats = BlockManager(8, 4, num_cpu_blocks=2).stats()
    assert stats == BlockStats(
        num_blocks=8,
        used_blocks=0,
        free_blocks=8,
        shared_blocks=0,
        logical_blocks=0,
        allocated_slots=0,
        used_slots=0,
        waste_slots=0,
        cpu_blocks=2,
        cpu_used_blocks=0,
        cpu_free_blocks=2,
    )
    assert stats.waste_fraction == 0.0 and stats.sharing_saving == 0.0


def test_stats_fragmentation_and_sharing() -> None:
    bm = BlockManager(16, 4)
    bm.allocate("a", 6)  # 2 blocks, 6 used slots
    bm.allocate("b", 4)  # 1 block, full
    s = bm.stats()
    assert (s.used_blocks, s.free_blocks, s.logical_blocks, s.shared_blocks) == (3, 13, 3, 0)
    assert (s.allocated_slots, s.used_slots, s.waste_slots) == (12, 10, 2)
    assert s.waste_fraction == pytest.approx(2 / 12) and s.sharing_saving == 0.0
    bm.fork("a", "a2")
    bm.fork("a", "a3")
    s = bm.stats()
    assert (s.used_blocks, s.logical_blocks, s.shared_blocks, s.used_slots) == (3, 7, 2, 10)
    assert s.sharing_saving == pytest.approx(1 - 3 / 7)
    bm.append_slots("a2")  # copy-on-write: a2 gets its own 3-token last block
    s = bm.stats()
    assert (s.used_blocks, s.logical_blocks, s.shared_blocks, s.used_slots) == (4, 7, 2, 13)


def test_stats_disagreeing_views_of_shared_block() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("p", 7)
    bm.fork("p", "c")
    bm.truncate("c", 5)  # block 1: 3 tokens for p, 1 for c -> 3 slots live
    assert bm.stats().used_slots == 7
    bm.truncate("p", 6)
    assert bm.stats().used_slots == 6
    bm.append_slots("p", 2)  # p now sees block 1 full (after copy-on-write p has its own block)
    assert bm.stats().used_slots == 4 + 4 + 1


def test_stats_exclude_swapped_tables() -> None:
    bm = BlockManager(8, 4, num_cpu_blocks=8)
    bm.allocate("a", 5)
    bm.allocate("b", 3)
    bm.fork("b", "b2")
    bm.swap_out(["b", "b2"])
    s = bm.stats()
    assert (s.used_blocks, s.logical_blocks, s.used_slots, s.cpu_used_blocks, s.cpu_free_blocks) == (2, 2, 5, 1, 7)


def test_reset() -> None:
    bm = BlockManager(4, 2, num_cpu_blocks=4)
    gpu, cpu = bm.gpu, bm.cpu
    bm.allocate("a", 3)
    bm.fork("a", "b")
    bm.allocate("c", 1)
    bm.swap_out(["c"])
    bm.reset()
    assert bm.seq_ids() == [] and bm.gpu is gpu and bm.cpu is cpu
    assert gpu.num_free == 4 and cpu.num_free == 4 and gpu.num_shared == 0
    assert bm.allocate("a", 8) == [0, 1, 2, 3]


# --------------------------------------------------------------------------------------------------- swapping


def test_swap_round_trip_preserves_sharing() -> None:
    bm = BlockManager(8, 2, num_cpu_blocks=8)
    bm.allocate("p", 5)  # 3 blocks
    bm.fork("p", "c")
    bm.append_slots("c")  # copy-on-write of the last block: 4 distinct blocks
    gpu_tables = {s: bm.block_table(s) for s in ("p", "c")}
    assert bm.blocks_needed_to_swap_out(["p", "c"]) == 4 and bm.can_swap_out(["p", "c"])
    pairs = bm.swap_out(["p", "c"])
    assert len(pairs) == 4 and len({g for g, _ in pairs}) == 4 and len({c for _, c in pairs}) == 4
    mapping = dict(pairs)
    for s, table in gpu_tables.items():
        assert bm.is_swapped(s)
        assert bm.block_table(s) == [mapping[b] for b in table]
    assert bm.gpu.num_free == 8 and bm.cpu.num_free == 4
    shared_cpu = bm.block_table("p")[0]
    assert bm.cpu.ref_count(shared_cpu) == 2 and bm.cpu.num_shared == 2

    assert bm.blocks_needed_to_swap_in(["c", "p"]) == 4 and bm.can_swap_in(["c", "p"])
    back = bm.swap_in(["c", "p"])
    assert {c for c, _ in back} == set(mapping.values())
    assert bm.cpu.num_free == 8 and bm.gpu.num_free == 4
    assert not bm.is_swapped("p")
    assert bm.gpu.ref_count(bm.block_table("p")[0]) == 2
    assert bm.block_table("p")[:2] == bm.block_table("c")[:2]
    assert bm.block_table("p")[2] != bm.block_table("c")[2]


@pytest.mark.parametrize("tokens, k", [(5, 1), (4, 1), (5, 3), (1, 1), (6, 2)])
def test_blocks_needed_to_swap_in_and_append_is_exact(tokens: int, k: int) -> None:
    """The scheduler's swap-in gate: predicted blocks == blocks a swap-in plus one append of every sibling take."""
    bm = BlockManager(16, 2, num_cpu_blocks=16)
    bm.allocate("p", tokens)
    for child in ("c1", "c2"):
        bm.fork("p", child)  # three holders of every block, the last one partial when tokens is odd
    group = ["p", "c1", "c2"]
    bm.swap_out(group)
    requests = [(s, k) for s in group]
    predicted = bm.blocks_needed_to_swap_in_and_append(requests)
    free = bm.gpu.num_free
    bm.swap_in(group)
    for seq_id, n in requests:
        bm.append_slots(seq_id, n)
    assert predicted == free - bm.gpu.num_free


def test_blocks_needed_to_swap_in_and_append_errors() -> None:
    bm = BlockManager(4, 2, num_cpu_blocks=4)
    bm.allocate("a", 3)
    with pytest.raises(ValueError, match="not swapped out"):
        bm.blocks_needed_to_swap_in_and_append([("a", 1)])
    bm.swap_out(["a"])
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.blocks_needed_to_swap_in_and_append([("a", -1)])


def test_swap_is_all_or_nothing() -> None:
    bm = BlockManager(8, 2, num_cpu_blocks=3)
    bm.allocate("a", 4)
    bm.allocate("b", 4)
    assert bm.can_swap_out(["a"]) and not bm.can_swap_out(["a", "b"])
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError, match="CPU"):
        bm.swap_out(["a", "b"])
    assert snapshot(bm) == before
    bm.swap_out(["a"])
    bm.allocate("c", 12)  # fill the GPU: 2 + 6 = 8
    assert not bm.can_swap_in(["a"])
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError, match="GPU"):
        bm.swap_in(["a"])
    assert snapshot(bm) == before


def test_swap_without_cpu_pool() -> None:
    bm = BlockManager(4, 2)
    bm.allocate("a", 1)
    bm.allocate("empty", 0)
    assert not bm.can_swap_out(["a"])
    assert bm.can_swap_out(["empty"]) and bm.swap_out(["empty"]) == []
    assert bm.is_swapped("empty") and bm.swap_in(["empty"]) == []


def test_swap_group_errors() -> None:
    bm = BlockManager(8, 2, num_cpu_blocks=8)
    bm.allocate("a", 2)
    bm.allocate("b", 2)
    for method in (bm.swap_out, bm.can_swap_out, bm.blocks_needed_to_swap_out):
        with pytest.raises(ValueError, match="seq_ids entry 'x' is unknown"):
            method(["a", "x"])
        with pytest.raises(ValueError, match="seq_ids lists 'a' twice"):
            method(["a", "a"])
        with pytest.raises(TypeError, match="seq_ids"):
            method("ab")
    for method in (bm.swap_in, bm.can_swap_in, bm.blocks_needed_to_swap_in):
        with pytest.raises(ValueError, match="seq_ids entry 'a' is not swapped out"):
            method(["a"])
    bm.swap_out(["a"])
    with pytest.raises(ValueError, match="seq_ids entry 'a' is already swapped out"):
        bm.swap_out(["b", "a"])
    assert not bm.is_swapped("b")  # the failed group changed nothing
    with pytest.raises(ValueError, match="seq_ids entry 'b' is not swapped out"):
        bm.swap_in(["a", "b"])
    assert bm.swap_out([]) == [] and bm.swap_in([]) == []


def test_swap_out_block_shared_with_outsider_stays_on_gpu() -> None:
    bm = BlockManager(8, 2, num_cpu_blocks=8)
    bm.allocate("p", 4)
    bm.fork("p", "c")
    pairs = bm.swap_out(["c"])
    assert [g for g, _ in pairs] == bm.block_table("p")
    assert all(bm.gpu.ref_count(b) == 1 for b in bm.block_table("p"))  # the outsider keeps them
    assert bm.gpu.num_free == 6
    bm.swap_in(["c"])  # comes back on fresh blocks: sharing outside the group is not restored
    assert set(bm.block_table("c")).isdisjoint(bm.block_table("p"))


def test_swapped_sequence_truncate_and_free_use_cpu_pool() -> None:
    bm = BlockManager(8, 2, num_cpu_blocks=8)
    bm.allocate("a", 5)
    bm.swap_out(["a"])
    bm.truncate("a", 2)
    assert len(bm.block_table("a")) == 1 and bm.cpu.num_free == 7 and bm.num_tokens("a") == 2
    bm.free("a")
    assert bm.cpu.num_free == 8 and bm.gpu.num_free == 8


def test_swap_in_with_partial_group_splits_sharing() -> None:
    bm = BlockManager(8, 2, num_cpu_blocks=8)
    bm.allocate("p", 3)
    bm.fork("p", "c")
    bm.swap_out(["p", "c"])
    bm.swap_in(["p"])
    assert bm.cpu.ref_count(bm.block_table("c")[0]) == 1
    bm.swap_in(["c"])
    assert bm.cpu.num_free == 8 and bm.gpu.num_free == 4


# --------------------------------------------------------------------------------------------------- property tests


class BlockManagerMachine(RuleBasedStateMachine):
    """Random operation sequences on a small pool with a shadow of the pool contents.

    ``memory[device][slot]`` holds the token id written there; tokens are globally unique, so reading a sequence back
    through its table proves no neighbour overwrote it and every copy the manager asked for was sufficient.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager
        self.expected: dict[int, list[int]] = {}
        self.memory: dict[str, dict[int, int]] = {"gpu": {}, "cpu": {}}
        self.next_seq = 0
        self.next_token = 0

    @initialize(
        num_blocks=st.integers(1, 10),
        block_size=st.sampled_from([1, 2, 4]),
        num_cpu_blocks=st.integers(0, 10),
    )
    def setup(self, num_blocks: int, block_size: int, num_cpu_blocks: int) -> None:
        self.bm = BlockManager(num_blocks, block_size, num_cpu_blocks)

    # ------------------------------------------------------------------ helpers

    def resident(self) -> list[int]:
        return [s for s in self.bm.seq_ids() if not self.bm.is_swapped(s)]

    def swapped(self) -> list[int]:
        return [s for s in self.bm.seq_ids() if self.bm.is_swapped(s)]

    def tokens(self, count: int) -> list[int]:
        out = list(range(self.next_token, self.next_token + count))
        self.next_token += count
        return out

    def shadow(self, tokens: list[int], position: int) -> object:
        """What the KV of ``tokens[position]`` stands for in the shadow pool (here: the token, globally unique)."""
        return tokens[position]

    def write(self, seq: int, slots: list[int]) -> None:
        """Write the shadow of the last ``len(slots)`` tokens of ``self.expected[seq]`` (already extended)."""
        bs = self.bm.block_size
        table = self.bm.block_table(seq)
        tokens = self.expected[seq]
        start = len(tokens) - len(slots)
        for position, slot in enumerate(slots, start):
            block = slot // bs
            # Copy-on-write protects neighbours: a written block is held by this table alone.
            assert self.bm.gpu.ref_count(block) == 1
            assert not self.bm.gpu.is_cached(block), "a cached block is written in place"
            assert block in table
            assert all(block not in self.bm.block_table(o) for o in self.resident() if o != seq)
            self.memory["gpu"][slot] = self.shadow(tokens, position)

    def copy(self, pairs: list[tuple[int, int]], src: str, dst: str) -> None:
        bs = self.bm.block_size
        for a, b in pairs:
            for off in range(bs):
                value = self.memory[src].get(a * bs + off)
                if value is None:
                    self.memory[dst].pop(b * bs + off, None)
                else:
                    self.memory[dst][b * bs + off] = value

    def expect_no_free_blocks(self, call: Callable[..., object], *args: object) -> None:
        before = snapshot(self.bm)
        try:
            call(*args)
        except NoFreeBlocksError:
            pass
        else:
            raise AssertionError(f"{call.__name__} succeeded although can_* said no")
        assert snapshot(self.bm) == before

    # ------------------------------------------------------------------ rules

    @rule(num_tokens=st.integers(0, 12))
    def allocate(self, num_tokens: int) -> None:
        seq = self.next_seq
        self.next_seq += 1
        if not self.bm.can_allocate(num_tokens):
            self.expect_no_free_blocks(self.bm.allocate, seq, num_tokens)
            return
        table = self.bm.allocate(seq, num_tokens)
        assert len(table) == self.bm.blocks_for(num_tokens)
        assert all(self.bm.gpu.ref_count(b) == 1 for b in table)
        self.expected[seq] = self.tokens(num_tokens)
        self.write(seq, self.bm.slot_mapping(seq, 0, num_tokens))

    @precondition(lambda self: any(not self.bm.is_swapped(s) for s in self.bm.seq_ids()))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.resident()))
        child = self.next_seq
        self.next_seq += 1
        free_before = self.bm.gpu.num_free
        self.bm.fork(parent, child)
        assert self.bm.gpu.num_free == free_before
        self.expected[child] = list(self.expected[parent])

    @precondition(lambda self: any(not self.bm.is_swapped(s) for s in self.bm.seq_ids()))
    @rule(data=st.data(), count=st.integers(0, 6))
    def append(self, data: st.DataObject, count: int) -> None:
        seq = data.draw(st.sampled_from(self.resident()))
        needed = self.bm.blocks_needed_to_append(seq, count)
        if not self.bm.can_append(seq, count):
            assert needed > self.bm.gpu.num_free
            self.expect_no_free_blocks(self.bm.append_slots, seq, count)
            return
        free_before = self.bm.gpu.num_free
        result = self.bm.append_slots(seq, count)
        assert len(result.slots) == count and len(result.copies) <= 1
        assert free_before - self.bm.gpu.num_free == needed
        self.copy(result.copies, "gpu", "gpu")
        self.expected[seq].extend(self.tokens(count))
        self.write(seq, result.slots)

    @precondition(lambda self: any(not self.bm.is_swapped(s) for s in self.bm.seq_ids()))
    @rule(data=st.data())
    def append_many(self, data: st.DataObject) -> None:
        """Append to several sequences (siblings often share a last block): the batch estimate must be exact."""
        seqs = data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, unique=True))
        counts = [data.draw(st.integers(0, 3)) for _ in seqs]
        needed = self.bm.blocks_needed_to_append_many(list(zip(seqs, counts)))
        assert needed <= sum(self.bm.blocks_needed_to_append(s, n) for s, n in zip(seqs, counts))
        if needed > self.bm.gpu.num_free:
            return
        free_before = self.bm.gpu.num_free
        for seq, count in zip(seqs, counts):
            result = self.bm.append_slots(seq, count)
            self.copy(result.copies, "gpu", "gpu")
            self.expected[seq].extend(self.tokens(count))
            self.write(seq, result.slots)
        assert free_before - self.bm.gpu.num_free == needed

    @precondition(lambda self: any(not self.bm.is_swapped(s) for s in self.bm.seq_ids()))
    @rule(data=st.data())
    def append_decode(self, data: st.DataObject) -> None:
        """The batched decode path: one token for each of several sequences (siblings often share a partial last
        block: copy-on-write), all or nothing, taking exactly the blocks the per-sequence path would."""
        bm = self.bm
        seqs = data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, unique=True))
        requests = [(s, 1) for s in seqs]
        tokens = [self.expected[s] for s in seqs]
        computed = [bm.num_tokens(s) for s in seqs]
        needed = bm.blocks_needed_to_append_many(requests)
        before = snapshot(bm) if not bm.enable_prefix_caching else None  # with caching it commits first
        free_before = bm.gpu.num_free
        result = bm.append_decode_slots(seqs, tokens, computed)
        if result is None:
            if before is not None:
                assert snapshot(bm) == before
            writes_cached = any(
                bm.num_tokens(s) % bm.block_size and bm.gpu.is_cached(bm.block_table(s)[-1]) for s in seqs
            )
            assert writes_cached or needed > bm.gpu.num_free
            return
        assert len(result.slots) == len(seqs)
        assert free_before - bm.gpu.num_free == needed
        self.copy(result.copies, "gpu", "gpu")
        for seq, slot in zip(seqs, result.slots):
            self.expected[seq].extend(self.tokens(1))
            self.write(seq, [slot])

    @precondition(lambda self: bool(self.bm.seq_ids()))
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.bm.seq_ids()))
        keep = data.draw(st.integers(0, self.bm.num_tokens(seq)))
        self.bm.truncate(seq, keep)
        del self.expected[seq][keep:]

    @precondition(lambda self: bool(self.bm.seq_ids()))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.bm.seq_ids()))
        self.bm.free(seq)
        del self.expected[seq]

    def _swap_out(self, group: list[int]) -> None:
        if not self.bm.can_swap_out(group):
            self.expect_no_free_blocks(self.bm.swap_out, group)
            return
        distinct = {b for s in group for b in self.bm.block_table(s)}
        pairs = self.bm.swap_out(group)
        assert {g for g, _ in pairs} == distinct and len({c for _, c in pairs}) == len(pairs)
        self.copy(pairs, "gpu", "cpu")

    @precondition(lambda self: any(not self.bm.is_swapped(s) for s in self.bm.seq_ids()))
    @rule(data=st.data())
    def swap_out_subset(self, data: st.DataObject) -> None:
        self._swap_out(data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, unique=True)))

    @precondition(lambda self: any(not self.bm.is_swapped(s) for s in self.bm.seq_ids()))
    @rule(data=st.data())
    def swap_out_family(self, data: st.DataObject) -> None:
        """Swap a sequence with everything sharing a block with it, transitively (a real sequence group)."""
        resident = self.resident()
        group = {data.draw(st.sampled_from(resident))}
        grew = True
        while grew:
            blocks = {b for s in group for b in self.bm.block_table(s)}
            more = {s for s in resident if blocks.intersection(self.bm.block_table(s))}
            grew = not more <= group
            group |= more
        self._swap_out(sorted(group))

    @precondition(lambda self: any(self.bm.is_swapped(s) for s in self.bm.seq_ids()))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        group = data.draw(st.lists(st.sampled_from(self.swapped()), min_size=1, unique=True))
        if not self.bm.can_swap_in(group):
            self.expect_no_free_blocks(self.bm.swap_in, group)
            return
        distinct = {b for s in group for b in self.bm.block_table(s)}
        pairs = self.bm.swap_in(group)
        assert {c for c, _ in pairs} == distinct and len({g for _, g in pairs}) == len(pairs)
        self.copy(pairs, "cpu", "gpu")

    # ------------------------------------------------------------------ invariants

    @invariant()
    def contents_are_intact(self) -> None:
        bm, bs = self.bm, self.bm.block_size
        assert set(bm.seq_ids()) == set(self.expected)
        for seq, tokens in self.expected.items():
            table = bm.block_table(seq)
            memory = self.memory["cpu" if bm.is_swapped(seq) else "gpu"]
            assert bm.num_tokens(seq) == len(tokens)
            assert len(table) == bm.blocks_for(len(tokens))
            assert len(set(table)) == len(table)
            read = [memory.get(table[p // bs] * bs + p % bs) for p in range(len(tokens))]
            want = [self.shadow(tokens, p) for p in range(len(tokens))]
            assert read == want, f"seq {seq} reads {read}, expected {want}"

    @invariant()
    def ref_counts_match_tables(self) -> None:
        bm = self.bm
        for device, allocator in (("gpu", bm.gpu), ("cpu", bm.cpu)):
            holders = [0] * allocator.num_blocks
            for seq in bm.seq_ids():
                if bm.is_swapped(seq) == (device == "cpu"):
                    for block in bm.block_table(seq):
                        holders[block] += 1
            free = allocator.free_blocks()
            evictable = getattr(allocator, "evictable_blocks", list)()  # prefix cache: ref 0, entry kept
            assert len(set(free)) == len(free) and len(set(evictable)) == len(evictable)
            assert not set(free) & set(evictable), "a block is both free and evictable"
            assert set(free) | set(evictable) == {b for b in range(allocator.num_blocks) if holders[b] == 0}
            assert len(free) + len(evictable) + allocator.num_used == allocator.num_blocks
            assert all(allocator.is_cached(b) for b in evictable) and not any(allocator.is_cached(b) for b in free)
            for block in range(allocator.num_blocks):
                assert allocator.ref_count(block) == holders[block]
                assert allocator.is_free(block) == (holders[block] == 0)
            assert allocator.num_free + allocator.num_used == allocator.num_blocks
            assert allocator.num_used == sum(1 for h in holders if h)
            assert allocator.num_shared == sum(1 for h in holders if h > 1)

    @invariant()
    def stats_match_brute_force(self) -> None:
        bm, bs = self.bm, self.bm.block_size
        fill: dict[int, int] = {}
        logical = 0
        for seq in self.resident():
            table, n = bm.block_table(seq), bm.num_tokens(seq)
            logical += len(table)
            for i, block in enumerate(table):
                fill[block] = max(fill.get(block, 0), min(bs, n - i * bs))
        cpu_used = {b for s in self.swapped() for b in bm.block_table(s)}
        shared = sum(1 for b in fill if bm.gpu.ref_count(b) > 1)
        assert bm.usage() == (len(fill), logical), "the O(1) counters drifted from the tables"
        expected = BlockStats(
            num_blocks=bm.num_blocks,
            used_blocks=len(fill),
            free_blocks=bm.num_blocks - len(fill),
            shared_blocks=shared,
            logical_blocks=logical,
            allocated_slots=len(fill) * bs,
            used_slots=sum(fill.values()),
            waste_slots=len(fill) * bs - sum(fill.values()),
            cpu_blocks=bm.num_cpu_blocks,
            cpu_used_blocks=len(cpu_used),
            cpu_free_blocks=bm.num_cpu_blocks - len(cpu_used),
            cached_blocks=len(getattr(bm.gpu, "evictable_blocks", list)()),
            prefix_query_tokens=bm.prefix_query_tokens,
            prefix_hit_tokens=bm.prefix_hit_tokens,
        )
        stats = bm.stats()
        assert stats == expected
        assert 0.0 <= stats.waste_fraction < 1.0 or stats.allocated_slots == 0
        assert 0.0 <= stats.sharing_saving < 1.0

    def teardown(self) -> None:
        bm = getattr(self, "bm", None)
        if bm is None:
            return
        for seq in bm.seq_ids():
            bm.free(seq)
        assert bm.gpu.num_free == bm.num_blocks and bm.cpu.num_free == bm.num_cpu_blocks
        assert bm.gpu.num_shared == 0 and bm.cpu.num_shared == 0
        assert bm.stats().used_blocks == 0


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachine = pytest.mark.slow(BlockManagerMachine.TestCase)


class _LongRun(BlockManagerMachine):
    """The same machine with more and longer runs, random each time (``-m slow``): 0.75 x $HF_PAGED_LONG_EXAMPLES
    runs (112 by default, about 6 s of one worker on the 2-core CI machine); a soak run asks for more."""


_LongRun.TestCase.settings = settings(
    max_examples=int(0.75 * int(os.environ.get("HF_PAGED_LONG_EXAMPLES", "150"))),
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachineLong = pytest.mark.slow(_LongRun.TestCase)


# --------------------------------------------------------------------------------------------------- prefix caching

#: hash functions the prefix-caching machine runs under: the real one, and two that collide all the time
_HASHES: dict[str, Callable[[int, list[int]], int] | None] = {
    "xxhash": None,
    "constant": lambda parent, tokens: 7,
    "weak": lambda parent, tokens: (parent + sum(tokens)) % 5,
}
PREFIX_TOTALS: dict[str, int] = {"admits": 0, "hit_admits": 0, "hit_tokens": 0, "collision_runs": 0}


class PrefixCachingMachine(BlockManagerMachine):
    """The machine above with prefix caching on, plus admission through the cache and commits.

    Tokens come from a 3-letter alphabet, so equal blocks after different prefixes are common, and the shadow value of
    a token is its whole prefix (what its K/V depend on): a hit that maps K/V computed after another prefix reads back
    wrong in ``contents_are_intact``. New sequences reuse a prefix of any earlier token list (prefix hits), and the hash
    function may be patched to collide constantly: hits must then still be verified, never wrong.
    """

    @initialize(
        num_blocks=st.integers(1, 12),
        block_size=st.sampled_from([1, 2, 4]),
        num_cpu_blocks=st.integers(0, 8),
        hashing=st.sampled_from(list(_HASHES)),
        rnd=st.randoms(use_true_random=False),
    )
    def setup(  # type: ignore[override]
        self, num_blocks: int, block_size: int, num_cpu_blocks: int, hashing: str, rnd
    ) -> None:
        self.bm = BlockManager(num_blocks, block_size, num_cpu_blocks, enable_prefix_caching=True)
        self.rnd = rnd
        self.history: list[list[int]] = [[]]
        self.saved_hash = prefix_caching.hash_block
        if _HASHES[hashing] is not None:
            prefix_caching.hash_block = _HASHES[hashing]
            PREFIX_TOTALS["collision_runs"] += 1

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            if hasattr(self, "saved_hash"):
                prefix_caching.hash_block = self.saved_hash

    def tokens(self, count: int) -> list[int]:
        return [self.rnd.randrange(3) for _ in range(count)]

    def shadow(self, tokens: list[int], position: int) -> object:
        return tuple(tokens[: position + 1])

    @rule(data=st.data(), extra=st.integers(0, 6))
    def admit(self, data: st.DataObject, extra: int) -> None:
        """A new sequence: a prefix of an earlier token list plus new tokens, its cached prefix mapped."""
        bm, bs = self.bm, self.bm.block_size
        source = data.draw(st.sampled_from(self.history[-4:]) | st.sampled_from(self.history))
        cut = data.draw(st.just(len(source)) | st.integers(0, len(source)))
        tokens = source[:cut] + self.tokens(extra)
        n = len(tokens)
        match = bm.match_prefix(tokens)
        cached = match.num_cached_tokens
        assert cached % bs == 0 and cached <= max(0, n - 1) and len(match.blocks) == cached // bs
        assert match.num_hit_blocks >= cached // bs and len(match.keys) == n // bs
        assert all(bm.gpu.is_cached(b) for b in match.blocks)
        needed = bm.blocks_needed_to_admit([(match, n - cached)])
        if needed > bm.gpu.num_free:
            return
        seq = self.next_seq
        self.next_seq += 1
        free_before, hits_before = bm.gpu.num_free, bm.prefix_hit_tokens
        assert bm.allocate_prefix(seq, tokens, match) == cached
        assert bm.block_table(seq) == list(match.blocks) and bm.num_tokens(seq) == cached
        result = bm.append_slots(seq, n - cached)
        assert result.copies == []  # mapped blocks are full: nothing cached is ever written
        assert free_before - bm.gpu.num_free == needed
        assert bm.prefix_hit_tokens - hits_before == cached
        self.expected[seq] = list(tokens)
        self.write(seq, result.slots)
        self.history.append(list(tokens))
        if data.draw(st.booleans()):  # the forward that wrote them is done (the scheduler commits next step)
            bm.commit(seq, tokens, n)
        PREFIX_TOTALS["admits"] += 1
        PREFIX_TOTALS["hit_admits"] += cached > 0
        PREFIX_TOTALS["hit_tokens"] += cached

    @rule(data=st.data(), extra=st.integers(0, 3))
    def admit_again(self, data: st.DataObject, extra: int) -> None:
        """Admission is the point of this machine: give it twice the weight of the other rules."""
        self.admit(data, extra)

    @precondition(lambda self: any(not self.bm.is_swapped(s) for s in self.bm.seq_ids()))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        """Key the full blocks among the first ``upto`` (written) tokens of a resident sequence."""
        seq = data.draw(st.sampled_from(self.resident()))
        upto = data.draw(st.integers(0, self.bm.num_tokens(seq)))
        self.bm.commit(seq, self.expected[seq], upto)
        self.history.append(list(self.expected[seq]))

    @precondition(lambda self: bool(self.bm.seq_ids()))
    @rule(data=st.data())
    def commit_and_free(self, data: st.DataObject) -> None:
        """What the scheduler does when a sequence finishes: key its written blocks, free it (they stay cached)."""
        seq = data.draw(st.sampled_from(self.bm.seq_ids()))
        self.bm.commit(seq, self.expected[seq], self.bm.num_tokens(seq))  # no-op while swapped out
        self.history.append(self.expected.pop(seq))
        self.bm.free(seq)

    @invariant()
    def cache_is_truthful(self) -> None:
        """Every entry describes its block's content: its tokens, one consistent prefix, after its parent entry."""
        bm, bs = self.bm, self.bm.block_size
        gpu = bm.gpu
        entries = {b: gpu._entry_of[b] for b in range(bm.num_blocks) if gpu._entry_of[b] is not None}
        assert len(entries) == len(gpu._by_key) == gpu.num_cached
        by_id = {e.id: b for b, e in entries.items()}
        memory = self.memory["gpu"]
        for block, entry in entries.items():
            assert gpu._by_key[entry.key] is entry and entry.block == block
            values = [memory.get(block * bs + i) for i in range(bs)]
            assert None not in values, f"cached block {block} holds unwritten slots"
            assert tuple(v[-1] for v in values) == entry.tokens
            assert all(values[i] == values[-1][: len(values[-1]) - bs + 1 + i] for i in range(bs))
            if entry.parent == block_pool.ROOT_ENTRY:
                assert len(values[0]) == 1
            elif entry.parent in by_id:
                assert memory[by_id[entry.parent] * bs + bs - 1] == values[0][:-1]


PREFIX_MACHINE_SETTINGS = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.slow
def test_prefix_caching_machine_really_hits() -> None:
    """The machine's runs, then what they did: admissions through real hits, and runs under a colliding hash (one
    test, so the check never depends on which process or in which order the tests ran)."""
    PREFIX_TOTALS.update(dict.fromkeys(PREFIX_TOTALS, 0))
    run_state_machine_as_test(PrefixCachingMachine, settings=PREFIX_MACHINE_SETTINGS)
    print(f"\nprefix-caching machine: {PREFIX_TOTALS}")
    assert PREFIX_TOTALS["hit_admits"] > 20 and PREFIX_TOTALS["collision_runs"] > 0, PREFIX_TOTALS
