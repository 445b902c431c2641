"""`hf_paged.core.StateSlots`: the recurrent-state slots of hybrid models, and their deferred copies.

The slots' contents are simulated by labels. A reference applies every operation at once (a fork copies the parent's
label now, a checkpoint keeps the sequence's label now, a restore takes the checkpoint's); `StateSlots` only records
them and hands them out with `take_ops()` before each forward, applied in two phases (reads, then writes) as
`StatePool.apply` does. After every forward each sequence's slot, and each checkpoint, must hold the reference's label,
whatever the interleaving: forks of forks, frees and re-allocations of a source slot, swaps of a just-forked
sequence, checkpoints of a just-restored one, evictions.
"""

from __future__ import annotations

import itertools
import random

import pytest

from hf_paged.core import BlockManager, NoFreeBlocksError, NoFreeSlotsError, SlotOps, StateSlots


def _apply(ops: SlotOps, gpu: dict, cpu: dict) -> None:
    for src, dst in ops.swap_out:
        cpu[dst] = gpu.get(src, "?") if src >= 0 else 0
    gathered = [gpu.get(src, "?") for src, _ in ops.copies]
    for (_, dst), value in zip(ops.copies, gathered):
        gpu[dst] = value
    for dst in ops.zeros:
        gpu[dst] = 0
    for src, dst in ops.swap_in:
        gpu[dst] = cpu.get(src, "?")


class _Run:
    def __init__(self, rng: random.Random, slots: int, cpu: int, checkpoints: int) -> None:
        self.rng = rng
        self.state = StateSlots(slots, num_cpu_slots=cpu, num_checkpoints=checkpoints)
        self.gpu: dict[int, object] = {}
        self.cpu: dict[int, object] = {}
        self.value: dict[int, object] = {}  # the reference: sequence -> label
        self.ckpt: dict[int, object] = {}  # key -> label
        self.resident: set[int] = set()
        self.swapped: set[int] = set()
        self.fresh: set[int] = set()  # swapped in since the last forward: read only after their swap-in ran
        self.ids = itertools.count()
        self.labels = itertools.count(1)

    def forward(self) -> None:
        _apply(self.state.take_ops(), self.gpu, self.cpu)
        self.fresh.clear()
        for seq in self.resident:
            slot = self.state.slot(seq)
            assert self.gpu.get(slot) == self.value[seq], (seq, slot)
        for key, label in self.ckpt.items():
            if self.state.has_checkpoint(key):
                assert self.gpu.get(self.state._ckpt[key]) == label, key
        for seq in self.resident:  # the model advances every resident state
            label = next(self.labels)
            self.gpu[self.state.slot(seq)] = self.value[seq] = label

    def step(self) -> None:
        rng, state = self.rng, self.state
        op = rng.choice(["alloc", "alloc", "fork", "fork", "free", "swap_out", "swap_in", "save", "restore",
                         "forward", "forward", "drop"])
        if op == "alloc" and state.num_free:
            seq = next(self.ids)
            state.allocate(seq)
            self.value[seq] = 0
            self.resident.add(seq)
        elif op == "restore" and state.num_free and self.ckpt:
            key = rng.choice(sorted(self.ckpt))
            seq = next(self.ids)
            if state.has_checkpoint(key):
                state.allocate(seq, key)
                self.value[seq] = self.ckpt[key]
                self.resident.add(seq)
            else:
                with pytest.raises(ValueError, match="no state checkpoint"):
                    state.allocate(seq, key)
        elif op == "fork" and self.resident - self.fresh:
            parent = rng.choice(sorted(self.resident - self.fresh))
            child = next(self.ids)
            if state.num_free:
                state.fork(parent, child)
                self.value[child] = self.value[parent]
                self.resident.add(child)
            else:
                with pytest.raises(NoFreeSlotsError):
                    state.fork(parent, child)
        elif op == "free" and (self.resident or self.swapped):
            seq = rng.choice(sorted(self.resident | self.swapped))
            state.free(seq)
            self.resident.discard(seq)
            self.swapped.discard(seq)
            self.fresh.discard(seq)
        elif op == "swap_out" and self.resident - self.fresh:
            ready = sorted(self.resident - self.fresh)
            group = rng.sample(ready, min(len(ready), rng.randint(1, 3)))
            if state.can_swap_out(group):
                state.swap_out(group)
                self.resident -= set(group)
                self.swapped |= set(group)
        elif op == "swap_in" and self.swapped:
            group = rng.sample(sorted(self.swapped), min(len(self.swapped), rng.randint(1, 3)))
            if len(group) <= state.num_free:
                state.swap_in(group)
                self.swapped -= set(group)
                self.resident |= set(group)
                self.fresh |= set(group)
        elif op == "save" and self.resident - self.fresh:
            seq = rng.choice(sorted(self.resident - self.fresh))
            key = rng.randrange(6)
            existed = state.has_checkpoint(key)
            if state.save_checkpoint(seq, key):
                self.ckpt[key] = self.value[seq]
            elif not existed:  # no room: every checkpoint pinned by a pending restore (or none at all)
                assert state.num_checkpoints == 0 or all(s in state._pinned for s in state._ckpt.values())
        elif op == "drop":
            state.drop_checkpoints()
        elif op == "forward":
            self.forward()
        assert state.num_used == len(self.resident)
        assert state.num_cpu_slots - state.num_cpu_free - len(state._cpu_released) == len(self.swapped)


@pytest.mark.parametrize("seed", range(40))
def test_deferred_copies_give_what_immediate_copies_give(seed):
    rng = random.Random(seed)
    run = _Run(rng, slots=rng.randint(1, 6), cpu=rng.randint(0, 4), checkpoints=rng.randint(0, 3))
    for _ in range(120):
        run.step()
    run.forward()


def test_chained_forks_and_a_reused_source_slot():
    state = StateSlots(4, num_checkpoints=1)
    gpu: dict = {}
    a = state.allocate("a")
    _apply(state.take_ops(), gpu, {})
    gpu[a] = "A"
    state.fork("a", "b")  # b <- a
    state.fork("b", "c")  # c <- b, whose own copy is pending: c <- a
    state.save_checkpoint("c", "k")  # k <- c <- a
    state.free("a")  # a's slot is free again ...
    d = state.allocate("d")  # ... and taken by a fresh sequence (zeros) in the same window
    assert d == a
    _apply(state.take_ops(), gpu, {})
    assert gpu[state.slot("b")] == gpu[state.slot("c")] == gpu[state._ckpt["k"]] == "A" and gpu[d] == 0


def test_swap_out_of_a_fresh_fork_takes_its_parents_state():
    state = StateSlots(2, num_cpu_slots=1)
    gpu, cpu = {}, {}
    state.allocate("p")
    _apply(state.take_ops(), gpu, cpu)
    gpu[state.slot("p")] = "P"
    state.fork("p", "c")
    state.swap_out(["c"])  # before the fork's copy ran
    state.swap_in(["c"])
    _apply(state.take_ops(), gpu, cpu)
    assert gpu[state.slot("c")] == "P"


def test_pinned_checkpoint_is_not_evicted_and_errors_name_the_argument():
    state = StateSlots(3, num_checkpoints=1)
    state.allocate("a")
    assert state.save_checkpoint("a", "k1")
    state.allocate("b", "k1")  # pins k1 until the ops are taken
    assert not state.save_checkpoint("a", "k2")  # nothing evictable
    state.take_ops()
    assert state.save_checkpoint("a", "k2") and not state.has_checkpoint("k1") and state.checkpoint_evictions == 1
    with pytest.raises(ValueError, match="seq_id 'a' already"):
        state.allocate("a")
    with pytest.raises(ValueError, match="parent_id 'x'"):
        state.fork("x", "y")
    with pytest.raises(ValueError, match="no state checkpoint"):
        state.allocate("c", "k1")
    with pytest.raises(ValueError, match="num_slots"):
        StateSlots(0)
    state.allocate("c")
    with pytest.raises(NoFreeSlotsError):
        state.allocate("d")


def test_block_manager_moves_slots_with_sequences():
    bm = BlockManager(16, 4, num_cpu_blocks=8, state=StateSlots(2, num_cpu_slots=2))
    bm.allocate("a", 5)
    bm.fork("a", "b")
    assert bm.stats().state_slots_used == 2
    with pytest.raises(NoFreeSlotsError):
        bm.fork("a", "c")  # no slot left: nothing changed
    assert not bm.has_seq("c") and bm.stats().used_blocks == 2
    with pytest.raises(NoFreeSlotsError):
        bm.allocate("c", 1)
    assert not bm.has_seq("c")
    bm.swap_out(["a", "b"])
    stats = bm.stats()
    assert stats.state_slots_used == 0 and stats.state_cpu_slots_used == 2
    assert bm.can_swap_in(["a", "b"])
    bm.swap_in(["a", "b"])
    bm.free("a")
    bm.free("b")
    bm.state.take_ops()  # (the CPU slots a swap-in reads are free again once it has run)
    stats = bm.stats()
    assert stats.state_slots_used == stats.state_cpu_slots_used == stats.used_blocks == 0
    with pytest.raises(NoFreeBlocksError):  # too many blocks: no slot is taken either
        bm.allocate("z", 100)
    assert bm.state.num_free == 2 and not bm.has_seq("z")
