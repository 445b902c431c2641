"""Batched admissions (`Scheduler.admission_due`): beside running requests, waiting ones come in `admission_batch` at a
time, all of them when fewer wait, or after `admission_max_wait` steps withheld room; an idle engine admits at once.
The engine's default batches only with CUDA graphs; on the CPU the tests ask for it and check that greedy tokens do
not depend on when a request was admitted."""

from __future__ import annotations

import pytest

import hf_paged
from hf_paged.core import BlockManager, Scheduler
from hf_paged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from hf_paged.engine.defaults import default_admission_batch
from hf_paged.testing import tiny_model

try:
    from tests.helpers import greedy_reference, random_prompts
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import greedy_reference, random_prompts


def _run_step(sched: Scheduler):
    """One step as the engine takes it: the scheduled tokens are computed, the sampled ones appended."""
    out = sched.schedule()
    for item in out.scheduled:
        item.seq.num_computed += item.num_tokens
        if item.sample:
            item.seq.token_ids.append(7)
    return out


class _Queue:
    """A scheduler over a roomy pool, stepped like the engine: scheduled tokens computed, sampled ones appended."""

    def __init__(self, max_num_seqs: int, admission_batch: int, admission_max_wait: int) -> None:
        self.sched = Scheduler(BlockManager(256, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                               admission_batch=admission_batch, admission_max_wait=admission_max_wait)
        self.arrivals = 0

    def add(self, count: int) -> list[SequenceGroup]:
        groups = []
        for _ in range(count):
            group = SequenceGroup(f"r{self.arrivals}", [Sequence(token_ids=[1, 2, 3], prompt_len=3)], self.arrivals)
            self.arrivals += 1
            self.sched.add(group)
            groups.append(group)
        return groups

    def step(self) -> int:
        """One step; returns how many groups it admitted (scheduled for their prompt)."""
        return sum(item.start == 0 for item in _run_step(self.sched).scheduled)

    def finish(self, count: int) -> None:
        for group in list(self.sched.running)[:count]:
            self.sched.finish_group(group, SequenceStatus.FINISHED_STOPPED)


def test_admissions_wait_for_a_batch_all_waiting_or_the_longest_wait():
    q = _Queue(max_num_seqs=8, admission_batch=4, admission_max_wait=3)
    q.add(8)
    assert q.step() == 8  # an idle engine admits at once
    q.add(6)
    assert not q.sched.admission_due()  # no room
    assert q.step() == 0
    q.finish(1)  # room for 1 of the 4 a batch waits for: withheld for 3 steps, admitted at the 4th
    assert [q.step() for _ in range(4)] == [0, 0, 0, 1]
    q.finish(4)  # room for a batch: at once
    assert q.sched.admission_due() and q.step() == 4
    q.finish(1)  # one waits, one fits: all that wait fit, at once
    assert q.sched.admission_due() and q.step() == 1
    assert not q.sched.waiting


def test_admission_batch_one_admits_as_soon_as_room_frees():
    q = _Queue(max_num_seqs=4, admission_batch=1, admission_max_wait=16)
    q.add(4)
    assert q.step() == 4
    q.add(2)
    q.finish(1)
    assert q.step() == 1


@pytest.mark.parametrize("name, value", [("admission_batch", 0), ("admission_batch", True),
                                         ("admission_max_wait", -1), ("admission_max_wait", 1.5)])
def test_bad_admission_arguments_name_themselves(name, value):
    with pytest.raises(ValueError, match=name):
        Scheduler(BlockManager(8, 4), **{name: value})
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=name):
        hf_paged.Engine(model, num_blocks=8, block_size=4, **{name: value})


def test_default_admission_batch_only_with_graphs():
    assert default_admission_batch(256, graphed=True) == 32
    assert default_admission_batch(4, graphed=True) == 1
    assert default_admission_batch(256, graphed=False) == 1
    engine = hf_paged.Engine(tiny_model("llama"), num_blocks=32, block_size=16)  # CPU: no graphs
    assert engine.scheduler.admission_batch == 1
    engine.close()


@pytest.mark.parametrize("decode_mode", ["eager", "static"])
def test_batched_admissions_keep_greedy_tokens(decode_mode):
    """More requests than `max_num_seqs`, admitted in batches of 3 (on the static path with the pipelined decode
    steps in between): every request finishes with transformers' greedy tokens, in fewer prefill steps."""
    model = tiny_model("llama", seed=1)
    prompts = random_prompts((5, 9, 3, 12, 7, 4, 10, 6, 8, 11, 2, 13), seed=5)
    lengths = [3, 9, 5, 12, 4, 7, 10, 6, 8, 3, 11, 5]
    refs = [greedy_reference(model, p, n) for p, n in zip(prompts, lengths)]
    prefill_steps = {}
    for batch in (1, 3):
        engine = hf_paged.Engine(model, num_blocks=64, block_size=4, max_num_seqs=4, admission_batch=batch,
                                 admission_max_wait=8)
        engine.runner.decode_mode = decode_mode
        execute, steps = engine.runner.execute, []

        def counting(sched, *args, _execute=execute, _steps=steps, **kwargs):
            _steps.append(any(item.num_tokens > 1 for item in sched.scheduled))
            return _execute(sched, *args, **kwargs)

        engine.runner.execute = counting
        launch, waiting_launches = engine._launch, []

        def recording(*args, _launch=launch, _engine=engine, _seen=waiting_launches, **kwargs):
            _seen.append(bool(_engine.scheduler.waiting))
            return _launch(*args, **kwargs)

        engine._launch = recording
        params = [hf_paged.SamplingParams(max_new_tokens=n) for n in lengths]
        outs = engine.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == refs
        prefill_steps[batch] = sum(steps)
        assert engine.block_manager.gpu.num_free == engine.block_manager.num_blocks
        if decode_mode == "static":  # decode steps stay pipelined while requests wait for their batch, and only then
            assert engine.pipelined_steps > 0
            assert any(waiting_launches) == (batch > 1)
        engine.close()
    assert prefill_steps[3] < prefill_steps[1]


def test_a_decode_step_that_finds_no_room_does_not_count_towards_the_wait():
    """The pipelined engine plans with `schedule_decode_step`; when that finds no room it plans the same step again
    with `schedule()`. Counting both would end an admission wait one step early."""
    sched = Scheduler(BlockManager(2, 4), max_num_seqs=2, max_num_batched_tokens=64, admission_batch=2,
                      admission_max_wait=8)
    running = SequenceGroup("r0", [Sequence(token_ids=[1, 2, 3, 4], prompt_len=4)], 0)
    sched.add(running)
    out = sched.schedule()  # an idle engine admits at once: the prompt fills block 0
    running.seqs[0].num_computed += out.scheduled[0].num_tokens
    running.seqs[0].token_ids.append(7)
    for i in (1, 2):  # two wait; one would fit: withheld
        sched.add(SequenceGroup(f"r{i}", [Sequence(token_ids=[1, 2, 3], prompt_len=3)], i))
    sched.block_manager.allocate("elsewhere", 4)  # the last free block: no room for position 4
    assert sched.admission_due() is False
    before = sched._withheld_steps
    assert sched.schedule_decode_step() is None
    assert sched._withheld_steps == before


@pytest.mark.parametrize("caching", [False, True])
def test_no_admission_is_due_while_the_queue_head_does_not_fit_the_pool(caching):
    """A pool-bound backlog: once the head of the queue was found short of blocks, steps are not admission steps
    (which would admit nobody and keep the engine off its pipelined path) until enough blocks are free again."""
    bm = BlockManager(12, 4)
    bm.set_prefix_caching(caching)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)  # admission_batch 1: room alone never waits
    running = [SequenceGroup(f"r{i}", [Sequence(token_ids=list(range(10 * i, 10 * i + 16)), prompt_len=16)], i)
               for i in range(2)]
    for group in running:
        sched.add(group)

    def step():
        return _run_step(sched)

    step()  # both prompts: 8 of the 12 blocks
    head = SequenceGroup("w", [Sequence(token_ids=list(range(100, 120)), prompt_len=20)], 2)  # 5 blocks
    sched.add(head)
    assert sched.admission_due()  # not tried yet
    out = step()  # the decodes take a block each; the head needs 5 (+ headroom) of the 2 left: it stays
    assert head in sched.waiting and all(item.num_tokens == 1 for item in out.scheduled)
    assert not sched.admission_due()
    assert step().scheduled and not sched.admission_due()  # decode steps go on, nothing is tried
    sched.finish_group(running[0], SequenceStatus.FINISHED_STOPPED)  # 5 blocks back: 7 free
    assert sched.admission_due()
    step()
    assert head in sched.running


def test_a_pool_bound_backlog_keeps_decoding_pipelined():
    """More requests than the pool holds, room in `max_num_seqs` to spare: decode steps stay pipelined while the
    queue waits for blocks (before, a due admission that could admit nobody kept them off that path), and every
    request finishes with transformers' greedy tokens."""
    model = tiny_model("llama", seed=2)
    lengths = [10, 14, 9, 12, 11, 13, 8, 12, 10, 14]
    prompts = random_prompts((12, 9, 14, 7, 11, 13, 10, 8, 12, 9), seed=7)
    refs = [greedy_reference(model, p, n) for p, n in zip(prompts, lengths)]
    engine = hf_paged.Engine(model, num_blocks=20, block_size=4, max_num_seqs=8, admission_batch=1)
    engine.runner.decode_mode = "static"
    launch, waiting_launches = engine._launch, []

    def recording(*args, **kwargs):
        waiting_launches.append(bool(engine.scheduler.waiting))
        return launch(*args, **kwargs)

    engine._launch = recording
    outs = engine.generate(prompts, [hf_paged.SamplingParams(max_new_tokens=n) for n in lengths])
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert any(waiting_launches)
    assert engine.block_manager.gpu.num_free == engine.block_manager.num_blocks
    engine.close()


def test_a_batch_waits_for_the_blocks_of_its_prompts():
    """With `admission_batch` = k, places in `max_num_seqs` are not enough: the pool must also have the blocks of the k
    prompts' first chunks, or the wait runs out. Before, a pool-bound backlog admitted a request or two whenever a few
    blocks came free, each time in a step off the fast path."""
    bm = BlockManager(16, 4)  # watermark 1 block
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, admission_batch=2, admission_max_wait=2)

    def step():
        return [item.group.request_id for item in _run_step(sched).scheduled if item.start == 0]

    def group(name, n):
        return SequenceGroup(name, [Sequence(token_ids=list(range(3, 3 + n)), prompt_len=n)], len(name))

    running = [group("r0", 16), group("r1", 16)]
    for g in running:
        sched.add(g)
    assert sorted(step()) == ["r0", "r1"]  # an idle engine admits at once: 8 of 16 blocks
    for name in ("w0", "w1"):
        sched.add(group(name, 16))  # 4 blocks each: the pair needs 9 with the watermark, 8 are free
    assert [step() for _ in range(3)] == [[], [], ["w0"]]  # withheld twice, then what fits comes in
    sched.finish_group(running[0], SequenceStatus.FINISHED_STOPPED)
    sched.add(group("w2", 4))
    assert sched.admission_due() and step() == ["w1", "w2"]  # both fit now: at once


def test_an_aborted_queue_head_is_not_held():
    """The scheduler remembers the queue head that did not fit the pool; aborting that request drops the memory."""
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add(SequenceGroup("r", [Sequence(token_ids=list(range(3, 27)), prompt_len=24)], 0))  # 6 of 8 blocks
    _run_step(sched)
    head = SequenceGroup("w", [Sequence(token_ids=list(range(3, 19)), prompt_len=16)], 1)  # 4 blocks: no room
    sched.add(head)
    sched.schedule()
    assert head in sched.waiting and not sched.admission_due()
    sched.abort("w")
    assert sched._short_of_blocks is None and not sched.waiting
