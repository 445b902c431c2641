"""Layer groups and the grouped block manager (issue 54, item 2): the plan of a mixed stack's groups, and a
hypothesis state machine over `GroupedBlockManager` with a shadow of the pool.

The shadow pool is what the slot tensors hold: one value per slot, shared by every group (layers of different groups
alias one slot tensor), written as ``(group, token)``. Reading each group's table back proves that no group wrote into
another group's blocks, that copy-on-write and swap pairs were enough, and that a sliding group's released entries
are a prefix of its table and that it still reads everything after them.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hf_paged.core import NULL_BLOCK, GroupedBlockManager, NoFreeBlocksError, plan_layer_groups, prefix_caching
from hf_paged.core.block_groups import group_salt
from hf_paged.core.layer_groups import MAX_GROUPS, config_layer_windows

# ------------------------------------------------------------------------------------------------------ the plan


def gemma3_27b_windows(window: int = 1024) -> list[int | None]:
    """Gemma-3-27B's 62 layers: every sixth one global (`sliding_window_pattern` 6), the others local."""
    return [None if (i + 1) % 6 == 0 else window for i in range(62)]


def test_plan_of_gemma3_27b() -> None:
    plan = plan_layer_groups(gemma3_27b_windows())
    assert plan.group_size == 10 and plan.num_groups == 7
    assert plan.windows == (None,) + (1024,) * 6
    assert [len(m) for m in plan.members] == [10, 10, 10, 10, 10, 10, 2]  # the last local group padded
    assert plan.members[0] == tuple(range(5, 62, 6))
    assert plan.matches(gemma3_27b_windows()) and not plan.matches(gemma3_27b_windows(512))
    # every layer once, and no two layers of one group on one slot tensor
    assert sorted(i for m in plan.members for i in m) == list(range(62))
    for members in plan.members:
        assert sorted(plan.slot_of[i] for i in members) == list(range(len(members)))
        assert {plan.group_of[i] for i in members} == {plan.members.index(members)}


@pytest.mark.parametrize("windows", [[None] * 4, [8] * 4, [], [4, 8, 8]])
def test_no_plan_where_one_table_does(windows) -> None:
    assert plan_layer_groups(windows) is None


def test_a_plan_of_too_many_groups_keeps_one_table() -> None:
    assert plan_layer_groups([None] + [8] * (MAX_GROUPS - 1)).num_groups == MAX_GROUPS
    assert plan_layer_groups([None] + [8] * MAX_GROUPS) is None


def test_plan_with_two_windows_and_bad_windows() -> None:
    plan = plan_layer_groups([None, 4, 8, 4, None, 8])
    assert plan.windows == (None, 4, 8) and plan.group_size == 2
    with pytest.raises(ValueError, match="sliding window"):
        plan_layer_groups([None, 0])


def test_config_layer_windows() -> None:
    class Config:
        layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
        sliding_window = 16

    assert config_layer_windows(Config, 3) == [16, None, 16]
    assert config_layer_windows(Config, 4) is None  # a length that is not the model's
    Config.layer_types = ["sliding_attention", "chunked_attention", "full_attention"]
    assert config_layer_windows(Config, 3) is None
    Config.sliding_window = None
    assert config_layer_windows(Config, 3) is None


def test_group_salts_differ_without_hashing_and_fit_a_token() -> None:
    salts = {group_salt(s, g) for s in (0, 1, 5, 255, 256) for g in range(8)}
    assert len(salts) == 40 and all(0 <= s < 2**63 for s in salts)
    assert {group_salt(s, 0) for s in (0, 1, 5)} == {0, 1, 5}  # group 0 keeps the request's salt
    with pytest.raises(ValueError, match="group_salt"):
        group_salt(0, 256)


def test_bad_windows_are_refused() -> None:
    with pytest.raises(ValueError, match="full group"):
        GroupedBlockManager(8, 4, [8, None])
    with pytest.raises(ValueError, match="positive int"):
        GroupedBlockManager(8, 4, [None, 0])


def test_a_sequence_takes_blocks_in_every_group_and_releases_the_sliding_ones() -> None:
    bm = GroupedBlockManager(64, 4, [None, 8, 8])
    bm.allocate("a", 20)  # 5 blocks a group
    assert bm.gpu.num_used == 15 and bm.blocks_for(20) == 15

    class Seq:
        seq_id, num_computed, token_ids = "a", 20, list(range(20))

    assert bm.release_out_of_window([Seq], 8) == 2 * 3  # keys from 13 on: blocks 0-2 go in both sliding groups
    tables = bm.group_tables("a")
    assert tables[0].count(NULL_BLOCK) == 0 and tables[1][:3] == [NULL_BLOCK] * 3 == tables[2][:3]
    assert bm.held_blocks("a") == 5 + 2 + 2 and bm.stats().released_blocks == 6
    with pytest.raises(ValueError, match="released"):
        bm.truncate("a", 8)
    assert bm.num_tokens("a") == 20  # nothing changed
    bm.truncate("a", 13)
    bm.free("a")
    assert bm.gpu.num_used == 0


@settings(max_examples=200, deadline=None)
@given(windows=st.lists(st.sampled_from([None, 1, 3, 8, 13]), min_size=1, max_size=3),
       block_size=st.sampled_from([1, 2, 4, 8]), chunk=st.integers(1, 20), num_tokens=st.integers(1, 80))
def test_blocks_to_hold_bounds_a_chunked_prefill(windows, block_size, chunk, num_tokens) -> None:
    """A sequence prefilled in chunks, releasing before each (as the scheduler does), never holds more than
    `blocks_to_hold`; `token_capacity` is the longest such sequence of whole blocks a pool holds."""
    bm = GroupedBlockManager(10_000, block_size, [None] + windows)
    bm.allocate("s", 0)

    class Seq:
        seq_id, num_computed, token_ids = "s", 0, ()

    peak = 0
    while Seq.num_computed < num_tokens:
        bm.release_out_of_window([Seq], 0)
        step = min(chunk, num_tokens - Seq.num_computed)
        bm.append_slots("s", step)
        Seq.num_computed += step
        peak = max(peak, bm.held_blocks("s"))
    assert peak <= bm.blocks_to_hold(num_tokens, chunk)
    small = GroupedBlockManager(max(1, peak), block_size, [None] + windows)
    capacity = small.token_capacity(chunk)
    assert small.blocks_to_hold(capacity, chunk) <= small.num_blocks
    assert small.blocks_to_hold(capacity + block_size, chunk) > small.num_blocks


# ------------------------------------------------------------------------------------------------------ the machine


def snapshot(bm: GroupedBlockManager) -> tuple:
    """Everything observable about the manager's tables and pools (failed operations must leave it unchanged)."""
    inner = bm.inner
    seqs = tuple((s, tuple(inner.block_table(s)), inner.num_tokens(s), inner.is_swapped(s)) for s in inner.seq_ids())
    pools = tuple((tuple(a.ref_count(b) for b in range(a.num_blocks)), tuple(a.free_blocks()), a.num_shared)
                  for a in (inner.gpu, inner.cpu))
    return seqs, pools


class GroupedMachine(RuleBasedStateMachine):
    """Random operations on a small grouped pool (group 0 full, the others sliding) with a shadow pool."""

    def __init__(self) -> None:
        super().__init__()
        self.bm: GroupedBlockManager
        self.expected: dict[int, list[int]] = {}
        self.memory: dict[str, dict[int, tuple[int, int]]] = {"gpu": {}, "cpu": {}}
        self.next_seq = 0
        self.next_token = 0

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4]), num_cpu_blocks=st.integers(0, 16),
                windows=st.lists(st.sampled_from([None, 2, 3, 5, 8]), min_size=0, max_size=3),
                caching=st.booleans(), colliding=st.booleans())
    def setup(self, num_blocks, block_size, num_cpu_blocks, windows, caching, colliding) -> None:
        """`colliding`: every chain key is the same (a patched hash): a hit must still be verified per group."""
        self.bm = GroupedBlockManager(num_blocks, block_size, [None] + windows, num_cpu_blocks,
                                      enable_prefix_caching=caching)
        self.saved_hash = prefix_caching.hash_block
        if colliding:
            prefix_caching.hash_block = lambda parent, tokens: 7

    # ------------------------------------------------------------------ helpers
    def resident(self) -> list[int]:
        return [s for s in self.bm.seq_ids() if not self.bm.is_swapped(s)]

    def swapped(self) -> list[int]:
        return [s for s in self.bm.seq_ids() if self.bm.is_swapped(s)]

    def tokens(self, count: int) -> list[int]:
        out = list(range(self.next_token, self.next_token + count))
        self.next_token += count
        return out

    def write(self, seq: int, start: int) -> None:
        """Every group writes the shadow of tokens ``[start, len)`` of `seq` at its slots (as each layer would)."""
        bm, bs = self.bm, self.bm.block_size
        tokens = self.expected[seq]
        for g in range(bm.num_groups):
            for position, slot in enumerate(bm.group_slots(seq, g, start, len(tokens)), start):
                block = slot // bs
                assert bm.gpu.ref_count(block) == 1, "a shared block is written"
                assert not bm.gpu.is_cached(block), "a cached block is written in place"
                self.memory["gpu"][slot] = (g, tokens[position])

    def copy(self, pairs, src: str, dst: str) -> None:
        bs = self.bm.block_size
        for a, b in pairs:
            for off in range(bs):
                value = self.memory[src].get(a * bs + off)
                if value is None:
                    self.memory[dst].pop(b * bs + off, None)
                else:
                    self.memory[dst][b * bs + off] = value

    def refused(self, call, *args) -> None:
        before = snapshot(self.bm)
        with pytest.raises((NoFreeBlocksError, ValueError)):
            call(*args)
        assert snapshot(self.bm) == before

    # ------------------------------------------------------------------ rules
    @rule(num_tokens=st.integers(0, 12))
    def allocate(self, num_tokens: int) -> None:
        seq = self.next_seq
        self.next_seq += 1
        if self.bm.blocks_for(num_tokens) > self.bm.gpu.num_free:
            self.refused(self.bm.allocate, seq, num_tokens)
            return
        self.bm.allocate(seq, num_tokens)
        self.expected[seq] = self.tokens(num_tokens)
        self.write(seq, 0)

    @precondition(lambda self: self.bm.enable_prefix_caching)
    @rule(data=st.data(), extra=st.integers(0, 5))
    def admit_with_prefix(self, data, extra: int) -> None:
        """A new sequence that repeats a known one's tokens (plus some): its cached prefix, the same in every group."""
        known = [s for s in self.bm.seq_ids()] or [None]
        source = data.draw(st.sampled_from(known))
        tokens = (list(self.expected[source]) if source is not None else []) + self.tokens(extra)
        match = self.bm.match_prefix(tokens)
        assert all(m.num_cached_tokens == match.num_cached_tokens for m in match.groups)
        need = self.bm.blocks_needed_to_admit([(match, len(tokens) - match.num_cached_tokens)])
        if need > self.bm.gpu.num_free:
            return
        seq = self.next_seq
        self.next_seq += 1
        free = self.bm.gpu.num_free
        cached = self.bm.allocate_prefix(seq, tokens, match)
        self.expected[seq] = tokens[:cached]
        for g, m in enumerate(match.groups):  # a hit maps blocks holding exactly these tokens, in this group
            for p in range(cached):
                block = m.blocks[p // self.bm.block_size]
                assert self.memory["gpu"][block * self.bm.block_size + p % self.bm.block_size] == (g, tokens[p])
        self.bm.append_slots(seq, len(tokens) - cached)
        assert free - self.bm.gpu.num_free == need, "blocks_needed_to_admit is not what admission took"
        self.expected[seq] = tokens
        self.write(seq, cached)

    @precondition(lambda self: self.bm.enable_prefix_caching and bool(self.resident()))
    @rule(data=st.data())
    def commit(self, data) -> None:
        seq = data.draw(st.sampled_from(self.resident()))
        self.bm.commit(seq, self.expected[seq], len(self.expected[seq]))

    @precondition(lambda self: bool(self.resident()))
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(self.resident()))
        child = self.next_seq
        self.next_seq += 1
        free = self.bm.gpu.num_free
        self.bm.fork(parent, child)
        assert self.bm.gpu.num_free == free
        self.expected[child] = list(self.expected[parent])

    @precondition(lambda self: bool(self.resident()))
    @rule(data=st.data(), count=st.integers(0, 6))
    def append(self, data, count: int) -> None:
        seq = data.draw(st.sampled_from(self.resident()))
        needed = self.bm.blocks_needed_to_append(seq, count)
        if not self.bm.can_append(seq, count):
            self.refused(self.bm.append_slots, seq, count)
            return
        free = self.bm.gpu.num_free
        start = len(self.expected[seq])
        result = self.bm.append_slots(seq, count)
        assert free - self.bm.gpu.num_free == needed
        assert result.slots == self.bm.group_slots(seq, 0, start, start + count)
        self.copy(result.copies, "gpu", "gpu")
        self.expected[seq].extend(self.tokens(count))
        self.write(seq, start)

    @precondition(lambda self: bool(self.resident()))
    @rule(data=st.data())
    def append_decode(self, data) -> None:
        bm = self.bm
        seqs = data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, unique=True))
        needed = bm.blocks_needed_to_append_many([(s, 1) for s in seqs])
        starts = [len(self.expected[s]) for s in seqs]
        before = None if bm.enable_prefix_caching else snapshot(bm)  # (with caching it commits first)
        result = bm.append_decode_slots(seqs, [self.expected[s] for s in seqs], starts)
        if result is None:
            assert before is None or snapshot(bm) == before
            return
        assert len(result.slots) == len(seqs)
        self.copy(result.copies, "gpu", "gpu")
        for seq, start in zip(seqs, starts):
            self.expected[seq].extend(self.tokens(1))
            self.write(seq, start)
        assert needed >= 0

    @precondition(lambda self: bool(self.resident()))
    @rule(data=st.data())
    def release(self, data) -> None:
        """The scheduler's release: each sliding group frees what its window no longer reads."""

        class Seq:
            def __init__(self, seq_id, tokens):
                self.seq_id, self.num_computed, self.token_ids = seq_id, len(tokens), tokens

        seqs = data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, unique=True))
        self.bm.release_out_of_window([Seq(s, self.expected[s]) for s in seqs], 0)

    @precondition(lambda self: bool(self.bm.seq_ids()))
    @rule(data=st.data())
    def truncate(self, data) -> None:
        seq = data.draw(st.sampled_from(self.bm.seq_ids()))
        keep = data.draw(st.integers(0, self.bm.num_tokens(seq)))
        released = max(self.bm.inner._get((seq, g)).released for g in range(self.bm.num_groups))
        if keep < released * self.bm.block_size:
            self.refused(self.bm.truncate, seq, keep)
            return
        self.bm.truncate(seq, keep)
        del self.expected[seq][keep:]

    @precondition(lambda self: bool(self.bm.seq_ids()))
    @rule(data=st.data())
    def free(self, data) -> None:
        seq = data.draw(st.sampled_from(self.bm.seq_ids()))
        self.bm.free(seq)
        del self.expected[seq]

    @precondition(lambda self: bool(self.resident()))
    @rule(data=st.data())
    def swap_out_family(self, data) -> None:
        """A sequence and every sequence sharing a block with it (a real sequence group) go to the CPU pool."""
        bm = self.bm
        resident = self.resident()
        family = {data.draw(st.sampled_from(resident))}
        grew = True
        while grew:
            blocks = {b for s in family for t in bm.group_tables(s) for b in t if b != NULL_BLOCK}
            more = {s for s in resident if blocks.intersection(b for t in bm.group_tables(s) for b in t)}
            grew = not more <= family
            family |= more
        family = sorted(family)
        if not bm.can_swap_out(family):
            self.refused(bm.swap_out, family)
            return
        self.copy(bm.swap_out(family), "gpu", "cpu")

    @precondition(lambda self: bool(self.swapped()))
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        group = data.draw(st.lists(st.sampled_from(self.swapped()), min_size=1, unique=True))
        if not self.bm.can_swap_in(group):
            self.refused(self.bm.swap_in, group)
            return
        self.copy(self.bm.swap_in(group), "cpu", "gpu")

    # ------------------------------------------------------------------ invariants
    @invariant()
    def every_group_reads_its_tokens(self) -> None:
        bm, bs = self.bm, self.bm.block_size
        assert set(bm.seq_ids()) == set(self.expected)
        for seq, tokens in self.expected.items():
            memory = self.memory["cpu" if bm.is_swapped(seq) else "gpu"]
            assert bm.num_tokens(seq) == len(tokens)
            for g, table in enumerate(bm.group_tables(seq)):
                released = table.count(NULL_BLOCK)
                assert table[:released] == [NULL_BLOCK] * released, "released entries are not a prefix"
                assert g or not released, "the full group released a block"
                assert len(table) == bm.inner.blocks_for(len(tokens))
                for p in range(released * bs, len(tokens)):
                    assert memory.get(table[p // bs] * bs + p % bs) == (g, tokens[p]), (seq, g, p)

    @invariant()
    def a_block_belongs_to_one_group_and_ref_counts_match(self) -> None:
        bm = self.bm
        for device, allocator in (("gpu", bm.gpu), ("cpu", bm.cpu)):
            holders = [0] * allocator.num_blocks
            owner: dict[int, int] = {}
            for seq in bm.seq_ids():
                if bm.is_swapped(seq) != (device == "cpu"):
                    continue
                for g, table in enumerate(bm.group_tables(seq)):
                    for block in table:
                        if block != NULL_BLOCK:
                            holders[block] += 1
                            assert owner.setdefault(block, g) == g, f"block {block} in two groups' tables"
            for block in range(allocator.num_blocks):
                assert allocator.ref_count(block) == holders[block]

    def teardown(self) -> None:
        if hasattr(self, "saved_hash"):
            prefix_caching.hash_block = self.saved_hash
        bm = getattr(self, "bm", None)
        if bm is None:
            return
        for seq in bm.seq_ids():
            bm.free(seq)
        assert bm.gpu.num_free == bm.num_blocks and bm.cpu.num_free == bm.num_cpu_blocks


GroupedMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
TestGroupedMachine = GroupedMachine.TestCase


class _LongRun(GroupedMachine):
    """The same machine with more runs (``-m slow``): $HF_PAGED_LONG_EXAMPLES of them, 150 by default."""


_LongRun.TestCase.settings = settings(max_examples=int(os.environ.get("HF_PAGED_LONG_EXAMPLES", "150")),
                                      stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
TestGroupedMachineLong = pytest.mark.slow(_LongRun.TestCase)


def test_a_prefix_hit_maps_each_groups_own_blocks() -> None:
    """Every group of a new sequence maps the blocks that group computed (salted keys), never another group's."""
    bm = GroupedBlockManager(64, 4, [None, 8, 8, 16], enable_prefix_caching=True)
    tokens = list(range(100, 114))
    bm.allocate("a", len(tokens))
    bm.commit("a", tokens, len(tokens))
    match = bm.match_prefix(tokens + [1, 2])
    assert match.num_cached_tokens == 12
    for g, (m, table) in enumerate(zip(match.groups, bm.group_tables("a"))):
        assert list(m.blocks) == table[:3], g
    bm.allocate_prefix("b", tokens + [1, 2], match)
    owners = {}
    for seq in ("a", "b"):
        for g, table in enumerate(bm.group_tables(seq)):
            for block in table:
                if block != NULL_BLOCK:
                    assert owners.setdefault(block, g) == g
