"""Reliability of `hf_paged.Engine`: faults in kernels and block operations, KeyboardInterrupt, bad input, threads.

What tests/test_engine.py already covers is not repeated here: a failing model forward (`test_failing_forward_*`), a
failing logits processor, aborts from the stream loop, and most bad requests (`_bad_requests`: empty prompt, ids
outside the vocabulary, max_new_tokens <= 0, temperature <= 0 / top_p outside (0, 1] with sampling, unknown kwargs,
float / 2-D tensors, prompts beyond the context or the pool, ...). tests/test_generate.py covers `generate()`'s bad
arguments and a failing forward there.

The rule everywhere: a fault fails the requests of the step it hit (finish reason "error", the exception attached),
every other request is token-identical to transformers' greedy `generate()`, and every KV block comes back.
"""

from __future__ import annotations

import collections
import math
import random
import threading
import time

import pytest
import torch

import hf_paged
import hf_paged.kernels
from hf_paged.core import SequenceStatus
from hf_paged.testing import tiny_model

try:
    from tests.helpers import dense_generate, greedy_reference, random_prompts
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import dense_generate, greedy_reference, random_prompts

MAX_NEW = 12
LENGTHS = (3, 27, 9, 18, 5, 22, 13, 7, 30, 11, 2, 16)

#: numbers of this module's runs, printed by the last test (quoted in the README's guarantees)
FAULTS: collections.Counter = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model runs fastest (and steadiest on a busy 2-core CI box) on one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=1)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS, seed=41)


@pytest.fixture(scope="module")
def references(model, prompts):
    return [greedy_reference(model, p, MAX_NEW) for p in prompts]


def make_engine(model, **kwargs):
    kwargs.setdefault("block_size", 8)
    return hf_paged.Engine(model, **kwargs)


def assert_no_leaks(engine):
    stats = engine.kv_stats()
    assert stats.used_blocks == 0 and stats.free_blocks == stats.num_blocks, stats
    assert stats.cpu_used_blocks == 0 and stats.cpu_free_blocks == stats.cpu_blocks, stats
    assert not engine.has_unfinished()
    assert engine.block_manager.seq_ids() == []
    assert engine.registry.groups == {}, "requests whose final output was never reported"


def assert_consistent(engine):
    """Between two steps: no half-updated request (the state a KeyboardInterrupt must leave behind).

    Every queued request is live and known to the engine, in exactly one queue, with statuses matching it; a running
    or swapped sequence's table holds exactly its computed tokens (the next token is pending), a waiting one has no
    table; no table belongs to anything else; every block's ref count equals the tables holding it.
    """
    bm, sched = engine.block_manager, engine.scheduler
    seen, live = set(), set()
    holders = {"gpu": collections.Counter(), "cpu": collections.Counter()}
    for queue, status in ((sched.running, SequenceStatus.RUNNING), (sched.swapped, SequenceStatus.SWAPPED),
                          (sched.waiting, SequenceStatus.WAITING)):
        for group in queue:
            assert id(group) not in seen, f"{group.request_id} is in two queues"
            seen.add(id(group))
            assert engine.registry.groups.get(group.request_id) is group and not group.is_finished
            for seq in group.seqs:
                if seq.status.is_finished:
                    assert not bm.has_seq(seq.seq_id)
                    continue
                assert seq.status == status, (group.request_id, seq.status, status)
                if status == SequenceStatus.WAITING:
                    assert not bm.has_seq(seq.seq_id) and seq.num_computed == 0
                    continue
                assert bm.num_tokens(seq.seq_id) == seq.num_computed < seq.num_tokens, "half-updated sequence"
                assert bm.is_swapped(seq.seq_id) == (status == SequenceStatus.SWAPPED)
                live.add(seq.seq_id)
                holders["cpu" if status == SequenceStatus.SWAPPED else "gpu"].update(bm.block_table(seq.seq_id))
    assert set(bm.seq_ids()) == live, "block tables that belong to no live sequence"
    for device, allocator in (("gpu", bm.gpu), ("cpu", bm.cpu)):
        for block in range(allocator.num_blocks):
            assert allocator.ref_count(block) == holders[device][block], f"{device} block {block}"


class StepSpy:
    """Records the scheduler's decision of every step (`last` is the current step's)."""

    def __init__(self, engine):
        self.last = None
        self.steps = 0
        original = engine.scheduler.schedule

        def schedule():
            self.last = original()
            self.steps += 1
            return self.last

        engine.scheduler.schedule = schedule

    def groups(self) -> set:
        return {item.group.request_id for item in self.last.scheduled}


def tokens(result):
    return result.outputs[0].token_ids


def run_to_end(engine, max_steps=2000):
    """Step until nothing is left; each request's final output, exactly once (aborts after the last step too)."""
    final = {}
    for _ in range(max_steps):
        last = not engine.has_unfinished()
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final, f"{out.request_id} finished twice"
                final[out.request_id] = out
        if last:
            break
    assert not engine.has_unfinished()
    return final


# ----------------------------------------------------------------------------------------------- fault injection


class Trigger:
    """Raise `error` on chosen calls of a wrapped function (1-based call numbers), else call through."""

    def __init__(self, function, on_calls, error, when=lambda *a, **k: True, spy=None):
        self.function, self.on_calls, self.error, self.when, self.spy = function, set(on_calls), error, when, spy
        self.calls = 0
        self.fired = 0
        self.hit: set = set()  # request ids scheduled in the steps it fired in (with a spy)

    def __call__(self, *args, **kwargs):
        if self.when(*args, **kwargs):
            self.calls += 1
            if self.calls in self.on_calls:
                self.fired += 1
                if self.spy is not None:
                    self.hit |= self.spy.groups()
                raise self.error
        return self.function(*args, **kwargs)

    def __getattr__(self, name):  # stands in for an object (the sampler), not only a function
        return getattr(self.function, name)


def _layer(index):
    """`when` for a kernel called once per layer: only calls of this layer count (layer 0 has written by then)."""
    state = {"n": -1}

    def when(*args, **kwargs):
        state["n"] += 1
        return state["n"] % 2 == index  # the tiny models have 2 layers

    return when


KERNEL_FAULTS = {
    # name: (module attribute, calls that raise, which calls count)
    "paged_prefill": ("paged_prefill", (2, 3), _layer(0)),
    "paged_decode_second_layer": ("paged_decode", (3, 11), _layer(1)),  # after layer 0 wrote its K/V
    "write_kv": ("write_kv", (4, 17), _layer(1)),
    "copy_blocks_copy_on_write": ("copy_blocks", (1,), lambda *a, **k: True),
}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("fault", sorted(KERNEL_FAULTS))
def test_kernel_fault_fails_only_its_step(model, prompts, references, monkeypatch, fault, mode):
    name, on_calls, when = KERNEL_FAULTS[fault]
    engine = make_engine(model, num_blocks=14, preemption_mode=mode, swap_space=0.01 if mode == "swap" else 0.0)
    spy = StepSpy(engine)
    trigger = Trigger(getattr(hf_paged.kernels, name), on_calls, RuntimeError(f"injected {fault} failure"), when, spy)
    monkeypatch.setattr(hf_paged.kernels, name, trigger)
    ids = [engine.add_request(p, request_id=f"g{i}", max_new_tokens=MAX_NEW) for i, p in enumerate(prompts)]
    # parallel samples: their first decode step copies the shared partial prompt block (copy-on-write)
    samples = [engine.add_request(prompts[i], request_id=f"s{i}", max_new_tokens=6, do_sample=True,
                                  num_return_sequences=3, seed=i) for i in (0, 2)]
    final = run_to_end(engine)
    assert trigger.fired == len(on_calls), f"{fault} fired {trigger.fired} times (calls seen: {trigger.calls})"
    FAULTS["kernel_faults"] += trigger.fired
    failed = trigger.hit
    assert set(final) == set(ids + samples)
    assert {r for r, o in final.items() if o.error is not None} == failed
    for request_id, out in final.items():
        if request_id in failed:
            assert isinstance(out.error, RuntimeError) and f"injected {fault}" in str(out.error)
            assert {o.finish_reason for o in out.outputs} == {"error"}
            continue
        assert out.error is None, (request_id, out.error)
        if request_id.startswith("g"):
            assert tokens(out) == references[int(request_id[1:])]
        else:
            assert len(out.outputs) == 3 and all(1 <= len(o.token_ids) <= 6 for o in out.outputs)
    assert failed and len(failed) < len(final), "a fault must fail its step's requests and only those"
    FAULTS["requests_failed_by_faults"] += len(failed)
    assert_no_leaks(engine)
    monkeypatch.undo()
    again = engine.generate(prompts[:3], max_new_tokens=MAX_NEW)  # and the engine keeps serving
    assert [tokens(r) for r in again] == references[:3]
    assert_no_leaks(engine)


@pytest.mark.parametrize("error", [RuntimeError("injected swap failure"), KeyboardInterrupt()],
                         ids=["exception", "keyboard_interrupt"])
def test_swap_failure_loses_no_request(model, prompts, references, error):
    """The swap copies fail (say pinned memory ran out) before the forward: the step's requests fail (an exception)
    or are re-queued (KeyboardInterrupt), and the groups whose blocks were being swapped are recomputed later instead
    of resuming from a CPU copy that was never made."""
    engine = make_engine(model, num_blocks=12, preemption_mode="swap", swap_space=0.01)
    spy = StepSpy(engine)
    runner = engine.runner
    trigger = Trigger(runner.apply_block_ops, (1, 3), error, lambda sched: bool(sched.swap_out or sched.swap_in), spy)
    runner.apply_block_ops = trigger
    ids = [engine.add_request(p, request_id=f"g{i}", max_new_tokens=MAX_NEW) for i, p in enumerate(prompts)]
    final, interrupts = {}, 0
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        try:
            outs = engine.step()
        except KeyboardInterrupt:
            interrupts += 1
            assert_consistent(engine)
            continue
        for out in outs:
            if out.finished:
                assert out.request_id not in final
                final[out.request_id] = out
    assert trigger.fired == 2, trigger.calls
    FAULTS["swap_faults"] += trigger.fired
    assert set(final) == set(ids)
    failed = {r for r, o in final.items() if o.error is not None}
    if isinstance(error, KeyboardInterrupt):
        assert interrupts == 2 and not failed
    else:
        assert failed == trigger.hit and all("injected swap failure" in str(final[r].error) for r in failed)
    for i, request_id in enumerate(ids):
        if request_id not in failed:
            assert tokens(final[request_id]) == references[i], request_id
    assert_no_leaks(engine)


def test_swapped_parallel_request_resumes_once_the_pool_is_empty(model):
    engine = make_engine(model, block_size=4, num_blocks=3, preemption_mode="swap", swap_space=0.001)
    first = engine.add_request([5, 6, 7, 8], max_new_tokens=5, ignore_eos=True)
    samples = engine.add_request([9], max_new_tokens=3, do_sample=True, num_return_sequences=3, seed=0,
                                 ignore_eos=True)
    final = run_to_end(engine, max_steps=50)  # raises "the scheduler could not admit any request"
    assert set(final) == {first, samples} and engine.scheduler.num_preemptions["swap"] >= 1
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------------------------- KeyboardInterrupt


def _interrupt_forward(engine, model, on_calls):
    trigger = Trigger(model.forward, on_calls, KeyboardInterrupt())
    model.forward = trigger  # instance attribute: nn.Module.__call__ uses it
    return trigger


def _interrupt_kernel(engine, monkeypatch, on_calls):
    trigger = Trigger(hf_paged.kernels.paged_decode, on_calls, KeyboardInterrupt(), _layer(1))
    monkeypatch.setattr(hf_paged.kernels, "paged_decode", trigger)
    return trigger


@pytest.mark.parametrize("where", ["forward", "attention_kernel"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_keyboard_interrupt_in_the_forward_leaves_the_engine_reusable(model, prompts, references, monkeypatch,
                                                                     where, mode):
    """Ctrl-C during a step's forward: the step's requests go back to the queue (recomputed later), nothing is lost
    or half-updated, and the run then finishes token-identical to transformers."""
    engine = make_engine(model, num_blocks=14, preemption_mode=mode, swap_space=0.01 if mode == "swap" else 0.0)
    spy = StepSpy(engine)
    ids = [engine.add_request(p, request_id=f"g{i}", max_new_tokens=MAX_NEW) for i, p in enumerate(prompts)]
    if where == "forward":
        trigger = _interrupt_forward(engine, model, (2, 7, 8, 20))
    else:
        trigger = _interrupt_kernel(engine, monkeypatch, (3, 9, 25))
    final, interrupted = {}, []
    try:
        for _ in range(2000):
            if not engine.has_unfinished():
                break
            try:
                outs = engine.step()
            except KeyboardInterrupt:
                interrupted.append(spy.groups())
                assert_consistent(engine)
                continue
            assert_consistent(engine)
            for out in outs:
                if out.finished:
                    assert out.request_id not in final
                    final[out.request_id] = out
    finally:
        if where == "forward":
            del model.forward
    assert len(interrupted) == len(trigger.on_calls)
    FAULTS["keyboard_interrupts"] += len(interrupted)
    assert set(final) == set(ids)
    for i, request_id in enumerate(ids):
        out = final[request_id]
        assert out.error is None and tokens(out) == references[i], request_id
    assert_no_leaks(engine)


@pytest.mark.parametrize("where", ["sampler", "plain_greedy_update"])
def test_keyboard_interrupt_while_sampling_fails_that_steps_requests_only(model, prompts, references, where):
    """Ctrl-C after the forward, while tokens are picked: those requests may be half-updated (forks, tokens), so
    they are failed with the KeyboardInterrupt attached; the others are untouched.

    "sampler": the general path (`output_scores` requests go through the sampler); "plain_greedy_update": the plain
    greedy fast path, interrupted inside its per-sequence loop after some sequences got their token."""
    engine = make_engine(model, num_blocks=14, max_num_seqs=4)
    spy = StepSpy(engine)
    if where == "sampler":
        trigger = engine.sampler = Trigger(engine.sampler, (5,), KeyboardInterrupt())
    else:
        trigger = engine._check_stop = Trigger(engine._check_stop, (10,), KeyboardInterrupt())
    extra = {"output_scores": True} if where == "sampler" else {}
    ids = [engine.add_request(p, request_id=f"g{i}", max_new_tokens=MAX_NEW, **extra) for i, p in enumerate(prompts)]
    final, hit = {}, set()
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        try:
            outs = engine.step()
        except KeyboardInterrupt:
            hit = spy.groups()
            assert_consistent(engine)
            continue
        for out in outs:
            if out.finished:
                final[out.request_id] = out
    assert trigger.fired == 1 and hit
    FAULTS["keyboard_interrupts"] += 1
    assert set(final) == set(ids)
    for i, request_id in enumerate(ids):
        out = final[request_id]
        if request_id in hit:
            assert isinstance(out.error, KeyboardInterrupt) and out.outputs[0].finish_reason == "error"
            assert tokens(out) == references[i][: len(tokens(out))]
        else:
            assert out.error is None and tokens(out) == references[i]
    assert_no_leaks(engine)


def test_keyboard_interrupt_in_generate_and_in_a_stream_consumer(model, prompts, references):
    engine = make_engine(model, num_blocks=14)
    trigger = _interrupt_forward(engine, model, (4,))
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.generate(prompts, max_new_tokens=MAX_NEW)
    finally:
        del model.forward
    assert trigger.fired == 1
    FAULTS["keyboard_interrupts"] += 1
    # generate() aborted its own requests; report them and the engine is idle and whole
    run_to_end(engine)
    assert_no_leaks(engine)
    assert [tokens(r) for r in engine.generate(prompts, max_new_tokens=MAX_NEW)] == references
    # the consumer of stream() is interrupted between two steps: nothing is half-done, the next stream() resumes
    ids = [engine.add_request(p, max_new_tokens=MAX_NEW) for p in prompts]
    final = {}
    with pytest.raises(KeyboardInterrupt):
        for n, out in enumerate(engine.stream()):
            if out.finished:
                final[out.request_id] = out
            if n == 25:
                raise KeyboardInterrupt
    assert_consistent(engine)
    for out in engine.stream():
        if out.finished:
            assert out.request_id not in final
            final[out.request_id] = out
    assert [tokens(final[i]) for i in ids] == references
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------------------------- bad input


def _closed_engine(model):
    engine = make_engine(model, num_blocks=20)
    engine.close()
    return engine


def _bad_requests(engine):
    """Cases not in tests/test_engine.py's `_bad_requests` (see this module's docstring)."""
    cases = {
        "float_token_in_list": (([5, 6.0],), {}, TypeError, "int token ids"),
        "bool_tensor": ((torch.tensor([True, False]),), {}, TypeError, "dtype"),
        "float16_tensor": ((torch.tensor([5, 6], dtype=torch.float16),), {}, TypeError, "dtype"),
        "numpy_like_object": ((range(5, 9),), {}, TypeError, "prompt"),
        "none_prompt": ((None,), {}, TypeError, "prompt"),
        "max_new_tokens_none": (([5, 6],), dict(max_new_tokens=None), TypeError, "max_new_tokens"),
        "temperature_nan_sampling": (([5, 6],), dict(do_sample=True, temperature=math.nan), ValueError, "temperature"),
        "temperature_inf_sampling": (([5, 6],), dict(do_sample=True, temperature=math.inf), ValueError, "temperature"),
        "top_p_nan": (([5, 6],), dict(do_sample=True, top_p=math.nan), ValueError, "top_p"),
        "top_p_negative": (([5, 6],), dict(do_sample=True, top_p=-0.5), ValueError, "top_p"),
        "min_new_tokens_negative": (([5, 6],), dict(min_new_tokens=-1), ValueError, "min_new_tokens"),
        "num_return_sequences_0": (([5, 6],), dict(num_return_sequences=0), ValueError, "num_return_sequences"),
        "num_return_sequences_above_max_num_seqs": (([5, 6],), dict(do_sample=True, num_return_sequences=9),
                                                    ValueError, "num_return_sequences"),
        "repetition_penalty_0": (([5, 6],), dict(repetition_penalty=0.0), ValueError, "repetition_penalty"),
        "seed_string": (([5, 6],), dict(do_sample=True, seed="1"), TypeError, "seed"),
        "eos_token_id_string": (([5, 6],), dict(eos_token_id="2"), TypeError, "eos_token_id"),
        "empty_stop_string": (([5, 6],), dict(stop_strings=[""]), TypeError, "stop_strings"),
        "unhashable_request_id": (([5, 6],), dict(request_id=["a"]), TypeError, "request_id"),
        "params_not_sampling_params": (([5, 6],), dict(params={"max_new_tokens": 3}), TypeError, "params"),
        "prompt_alone_beyond_context": (([5] * 600,), dict(max_new_tokens=1), ValueError, "max_position_embeddings"),
    }
    if "num_beams" in hf_paged.SamplingParams.names():
        cases.update({
            "num_return_sequences_above_num_beams": (([5, 6],), dict(num_beams=2, num_return_sequences=3),
                                                     ValueError, "num_return_sequences"),
            "num_beams_0": (([5, 6],), dict(num_beams=0), ValueError, "num_beams"),
            "num_beams_with_sampling": (([5, 6],), dict(num_beams=2, do_sample=True), ValueError, "num_beams"),
            "num_beams_above_max_num_seqs": (([5, 6],), dict(num_beams=9), ValueError, "num_beams"),
            "num_beams_never_fit_the_pool": (([5] * 60,), dict(num_beams=4, max_new_tokens=20), ValueError,
                                             "num_blocks"),
        })
    return cases


BAD_NAMES = sorted(_bad_requests(None))


@pytest.mark.parametrize("case", BAD_NAMES)
def test_bad_request_names_the_argument_and_leaks_nothing(model, prompts, references, case):
    engine = make_engine(model, num_blocks=20, max_num_seqs=8)
    args, kwargs, error, match = _bad_requests(engine)[case]
    good = engine.add_request(prompts[2], max_new_tokens=MAX_NEW)
    engine.step()
    before = engine.kv_stats()
    with pytest.raises(error, match=match):
        engine.add_request(*args, **kwargs)
    assert engine.kv_stats() == before
    assert [g.request_id for g in engine.scheduler.groups()] == [good] and list(engine.registry.groups) == [good]
    final = run_to_end(engine)
    assert tokens(final[good]) == references[2]
    assert_no_leaks(engine)


def test_closed_engine_refuses_requests_and_reports_the_aborted_ones(model, prompts):
    engine = make_engine(model, num_blocks=20)
    ids = [engine.add_request(p, max_new_tokens=MAX_NEW) for p in prompts[:4]]
    engine.step()
    engine.close()
    assert not engine.has_unfinished() and engine.kv_stats().used_blocks == 0
    outs = {o.request_id: o for o in engine.step()}
    assert set(outs) == set(ids) and all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs.values())
    with pytest.raises(hf_paged.EngineClosedError, match="closed"):
        engine.add_request(prompts[0], max_new_tokens=2)
    with pytest.raises(hf_paged.EngineClosedError, match="closed"):
        engine.generate(prompts[:2], max_new_tokens=2)
    assert engine.step() == [] and list(engine.stream()) == []
    engine.close()  # idempotent
    assert_no_leaks(engine)
    with make_engine(model, num_blocks=20) as scoped:  # a context manager closes it
        scoped.add_request(prompts[0], max_new_tokens=3)
    with pytest.raises(hf_paged.EngineClosedError):
        scoped.add_request(prompts[0], max_new_tokens=3)
    assert [o.outputs[0].finish_reason for o in scoped.step()] == ["abort"]
    assert_no_leaks(scoped)


def test_non_contiguous_and_other_int_tensors_are_read_correctly(model, prompts, references):
    """Not an error: a strided view or an int32 / int16 tensor holds the same ids, and gives the same tokens."""
    engine = make_engine(model, num_blocks=20)
    base = torch.tensor([x for t in prompts[1] for x in (t, 0)])[::2]  # non-contiguous view of prompts[1]
    assert not base.is_contiguous() and base.tolist() == prompts[1]
    inputs = [base, torch.tensor(prompts[1], dtype=torch.int32), torch.tensor(prompts[1], dtype=torch.int16)]
    assert [tokens(r) for r in engine.generate(inputs, max_new_tokens=MAX_NEW)] == [references[1]] * 3
    assert_no_leaks(engine)
    # generate(): a non-contiguous input_ids batch equals the contiguous one and transformers
    wide = torch.tensor([prompts[4] * 2, prompts[7][:5] * 2])  # two rows of length 10
    ids = wide[:, ::2]  # non-contiguous [2, 5]
    assert not ids.is_contiguous()
    ref = dense_generate(model, input_ids=ids.contiguous(), attention_mask=torch.ones_like(ids),
                         max_new_tokens=6, do_sample=False)
    hf_paged.enable(model, num_blocks=32, block_size=8)
    try:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             cache_implementation="paged")
    finally:
        hf_paged.disable(model)
    assert torch.equal(out, ref)


def test_kernel_rejects_a_cache_not_contiguous_in_head_dim():
    key_cache = torch.zeros(4, 2, 8, 16).transpose(2, 3).contiguous().transpose(2, 3)  # stride(-1) != 1
    value_cache = torch.zeros(4, 2, 8, 16)
    with pytest.raises(ValueError, match="contiguous"):
        hf_paged.kernels.write_kv(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), key_cache, value_cache,
                                  torch.zeros(1, dtype=torch.int32))


# ----------------------------------------------------------------------------------------------- threads


def test_add_and_abort_from_other_threads_while_one_thread_steps(model, prompts, references):
    """The streaming-server pattern: one thread runs the engine loop, producers add and an aborter aborts at any time.
    Nothing is lost (each request gets exactly one final output), nothing finishes twice, no exception anywhere,
    no block leaks, and greedy requests that were not aborted are token-identical to transformers."""
    engine = make_engine(model, num_blocks=16, preemption_mode="swap", swap_space=0.01, max_num_seqs=6)
    errors, final, lock = [], {}, threading.Lock()
    # a long request the aborter aborts once it has produced tokens: an abort of a running request happens whatever
    # the thread timing (the random aborts below may all land on finished or unknown ids)
    engine.add_request(prompts[0], request_id="victim", max_new_tokens=60, ignore_eos=True)
    added: dict[str, int] = {"victim": -2}  # request id -> prompt index (-1: sampled, -2: the victim)
    aborted: set[str] = set()
    producers_done = threading.Event()
    victim_running = threading.Event()

    def guard(function):
        def run(*args):
            try:
                function(*args)
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)
        return run

    @guard
    def loop():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            outs = engine.step()  # also reports requests aborted after the last scheduled step
            for out in outs:
                if out.request_id == "victim" and out.outputs[0].token_ids:
                    victim_running.set()
                if out.finished:
                    with lock:
                        assert out.request_id not in final, f"{out.request_id} finished twice"
                        final[out.request_id] = out
            if producers_done.is_set() and not engine.has_unfinished():
                with lock:
                    if set(final) == set(added):
                        return
            if not outs:
                time.sleep(0.001)
        raise AssertionError("the engine loop did not drain in time")

    @guard
    def producer(worker):
        rng = random.Random(worker)
        for n in range(12):
            index = rng.randrange(len(prompts))
            request_id = f"w{worker}-{n}"
            with lock:
                added[request_id] = index if n % 4 else -1
            if n % 4:
                engine.add_request(prompts[index], request_id=request_id, max_new_tokens=MAX_NEW)
            else:
                engine.add_request(prompts[index], request_id=request_id, max_new_tokens=6, do_sample=True,
                                   num_return_sequences=2, seed=n)
            time.sleep(rng.random() * 0.01)

    @guard
    def aborter():
        rng = random.Random(99)
        assert victim_running.wait(60), "the victim never ran"
        assert engine.abort("victim"), "the victim (60 tokens to go) finished before it could be aborted"
        with lock:
            aborted.add("victim")
        while not producers_done.is_set() or engine.has_unfinished():
            with lock:
                candidates = sorted(added)
            if candidates:
                request_id = rng.choice(candidates + ["no-such-request"])
                if engine.abort(request_id):
                    with lock:
                        aborted.add(request_id)
            time.sleep(rng.random() * 0.02)

    threads = [threading.Thread(target=loop)] + [threading.Thread(target=producer, args=(w,)) for w in range(3)]
    abort_thread = threading.Thread(target=aborter)
    for thread in threads + [abort_thread]:
        thread.start()
    for thread in threads[1:]:
        thread.join(60)
    producers_done.set()
    for thread in [threads[0], abort_thread]:
        thread.join(130)
    assert not any(t.is_alive() for t in threads + [abort_thread]), "a thread hung"
    assert not errors, errors
    assert set(final) == set(added) and len(added) == 37
    assert "victim" in aborted
    for request_id, index in added.items():
        out = final[request_id]
        assert out.error is None
        if request_id in aborted:
            assert {o.finish_reason for o in out.outputs} == {"abort"}
            if index >= 0 or index == -2:
                reference = references[max(index, 0)]  # the victim runs past it: compare what both have
                assert tokens(out)[: len(reference)] == reference[: len(tokens(out))]
        elif index >= 0:
            assert tokens(out) == references[index], request_id
        else:
            assert len(out.outputs) == 2 and all(1 <= len(o.token_ids) <= 6 for o in out.outputs)
    FAULTS["thread_requests"] += len(added)
    FAULTS["thread_aborts"] += len(aborted)
    assert_no_leaks(engine)


def test_racing_aborts_of_one_request_succeed_once(model, prompts):
    engine = make_engine(model, num_blocks=32)
    ids = [engine.add_request(p, max_new_tokens=MAX_NEW) for p in prompts[:6]]
    engine.step()
    barrier = threading.Barrier(8)
    results = collections.defaultdict(list)

    def racer(index):
        barrier.wait()
        for request_id in ids:
            results[request_id].append(engine.abort(request_id))

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(sorted(r) == [False] * 7 + [True] for r in results.values()) and len(results) == 6
    final = run_to_end(engine)
    assert set(final) == set(ids) and all(o.outputs[0].finish_reason == "abort" for o in final.values())
    assert_no_leaks(engine)


def test_stream_consumer_gets_the_final_output_of_a_request_aborted_from_another_thread(model, prompts):
    """Aborting the last running request ends `stream()`; its final "abort" output must still come out of it."""
    engine = make_engine(model, num_blocks=64)
    request_id = engine.add_request(prompts[8], max_new_tokens=200, ignore_eos=True)
    seen, errors = [], []
    started = threading.Event()

    def consume():
        try:
            for out in engine.stream():
                seen.append(out)
                started.set()
                time.sleep(0.002)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert started.wait(30)
    assert engine.abort(request_id)
    consumer.join(30)
    assert not consumer.is_alive() and not errors
    assert seen[-1].request_id == request_id and seen[-1].finished
    assert seen[-1].outputs[0].finish_reason == "abort"
    assert_no_leaks(engine)


def test_close_from_another_thread_stops_the_stream(model, prompts):
    engine = make_engine(model, num_blocks=96)
    ids = [engine.add_request(p, max_new_tokens=200, ignore_eos=True) for p in prompts[:3]]
    finals, errors = {}, []
    started = threading.Event()

    def consume():
        try:
            for out in engine.stream():
                started.set()
                if out.finished:
                    finals[out.request_id] = out
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert started.wait(30)
    engine.close()
    consumer.join(30)
    assert not consumer.is_alive() and not errors
    assert set(finals) == set(ids) and all(o.outputs[0].finish_reason == "abort" for o in finals.values())
    with pytest.raises(hf_paged.EngineClosedError):
        engine.add_request(prompts[0])
    assert_no_leaks(engine)


def test_zz_print_fault_totals():
    print(f"\nreliability totals: {dict(sorted(FAULTS.items()))}")
