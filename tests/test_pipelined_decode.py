"""Pipelined decode: the next decode step is launched before the current one's tokens reach the host.

It runs on the static decode path (CUDA graphs on a GPU; `decode_mode = "static"` runs the same host logic on the
CPU) for `step(finished_only=True)`, which `generate()` uses. What must hold, as for every other step: greedy outputs
equal transformers', a fault fails only the requests it hit, an interrupt loses nothing, an abort from another thread
is honoured, no placeholder token ever shows in an output, and every block comes back.
"""

from __future__ import annotations

import threading

import pytest

import hf_paged
from hf_paged.core.seq_blocks import NULL_BLOCK
from hf_paged.engine import _IN_FLIGHT
from hf_paged.testing import tiny_model

try:
    from tests.helpers import greedy_reference, random_prompts
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import greedy_reference, random_prompts

MAX_NEW = 16
LENGTHS = (1, 39, 7, 22, 3, 31, 12, 5, 17, 26, 2, 9, 35, 14, 4, 20, 11)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=1)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS, seed=3)


@pytest.fixture(scope="module")
def references(model, prompts):
    return [greedy_reference(model, p, MAX_NEW) for p in prompts]


def make_engine(model, **kwargs):
    kwargs.setdefault("block_size", 8)
    engine = hf_paged.Engine(model, **kwargs)
    engine.runner.decode_mode = "static"
    return engine


def tokens(results):
    return [r.outputs[0].token_ids for r in results]


def assert_clean(engine, results):
    assert all(_IN_FLIGHT not in o.token_ids for r in results for o in r.outputs), "a placeholder leaked out"
    stats = engine.kv_stats()
    assert stats.used_blocks == 0 and stats.cpu_used_blocks == 0, stats
    assert not engine.has_unfinished() and engine.block_manager.seq_ids() == []


class PrelaunchTrigger:
    """Raise `error` on the `on`-th pipelined launch (a runner.execute call given the previous step's tokens)."""

    def __init__(self, engine, on: int, error: BaseException):
        self.execute, self.on, self.error, self.calls, self.fired = engine.runner.execute, on, error, 0, 0
        engine.runner.execute = self

    def __call__(self, sched, input_tokens=None):
        if input_tokens is not None:
            self.calls += 1
            if self.calls == self.on:
                self.fired += 1
                self.hit = {item.group.request_id for item in sched.scheduled}
                raise self.error
        return self.execute(sched, input_tokens)


def test_streamed_steps_are_pipelined_one_token_at_a_time(model, prompts, references):
    """`stream()` (and a server's `step()` loop) pipelines decode steps too: each step reports the tokens of the step
    before the one it leaves in flight, never its placeholder, one more token per request and report, and the
    streamed requests end with transformers' tokens."""
    engine = make_engine(model, num_blocks=300)
    for prompt in prompts:
        engine.add_request(prompt, max_new_tokens=MAX_NEW)
    seen: dict = {}
    finals = []
    for out in engine.stream():
        ids = out.outputs[0].token_ids
        assert _IN_FLIGHT not in ids, "a placeholder leaked into a streamed output"
        assert len(ids) == len(seen.get(out.request_id, [])) + 1 and ids[:-1] == seen.get(out.request_id, [])
        seen[out.request_id] = ids
        if out.finished:
            finals.append(out)
    assert engine.pipelined_steps > 5
    assert [seen[r.request_id] for r in sorted(finals, key=lambda r: int(r.request_id.split("-")[1]))] == references
    assert_clean(engine, finals)


@pytest.mark.parametrize(
    "engine_kwargs",
    [dict(num_blocks=200), dict(num_blocks=24, max_num_batched_tokens=32),
     dict(num_blocks=24, preemption_mode="swap", swap_space=0.01, max_num_seqs=8)],
    ids=["roomy", "recompute", "swap"],
)
def test_pipelined_decode_equals_transformers(model, prompts, references, engine_kwargs):
    engine = make_engine(model, **engine_kwargs)
    results = engine.generate(prompts, max_new_tokens=MAX_NEW)
    assert tokens(results) == references
    assert engine.pipelined_steps > 5
    assert any(r.outputs[0].finish_reason == "eos" for r in results)  # a request stopped while its next step ran
    assert_clean(engine, results)


def test_pipelined_decode_honours_each_requests_length(model, prompts):
    """Requests that end by length are left out of the next launch; the others go on being pipelined."""
    engine = make_engine(model, num_blocks=300)
    lengths = [3 + (7 * i) % 19 for i in range(len(prompts))]
    params = [hf_paged.SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    results = engine.generate(prompts, params)
    assert [len(t) for t in tokens(results)] == lengths
    full = [greedy_reference(model, p, max(lengths), eos_token_id=None) for p in prompts]
    assert [t for t in tokens(results)] == [f[:n] for f, n in zip(full, lengths)]
    assert engine.pipelined_steps > 5
    assert_clean(engine, results)


def test_pipelined_stop_checks_equal_the_unpipelined_ones(model, prompts):
    """The pipelined apply skips the stop checks of a token that cannot stop its request (no EOS of it, under its
    length, no stop criteria); requests with their own EOS ids (met mid-way, one or two of them), `ignore_eos` and
    lengths stop exactly where unpipelined steps stop them."""
    full = [greedy_reference(model, p, MAX_NEW, eos_token_id=None) for p in prompts]
    params = []
    for i, continuation in enumerate(full):
        eos = [continuation[3 + i % 7]] + ([continuation[1]] if i % 4 == 2 else [])
        params.append(hf_paged.SamplingParams(max_new_tokens=MAX_NEW - (i % 5), eos_token_id=eos,
                                              ignore_eos=i % 4 == 1))
    pipelined_engine = make_engine(model, num_blocks=300)
    pipelined = pipelined_engine.generate(prompts, params)
    assert pipelined_engine.pipelined_steps > 5
    plain_engine = hf_paged.Engine(model, block_size=8, num_blocks=300)  # the eager path: never pipelined
    for prompt, p in zip(prompts, params):
        plain_engine.add_request(prompt, params=p)
    unpipelined = {}
    for out in plain_engine.stream():
        unpipelined[out.request_id] = out
    assert plain_engine.pipelined_steps == 0
    assert tokens(pipelined) == [unpipelined[r.request_id].outputs[0].token_ids for r in pipelined]
    assert [r.outputs[0].finish_reason for r in pipelined] == \
        [unpipelined[r.request_id].outputs[0].finish_reason for r in pipelined]
    assert {r.outputs[0].finish_reason for r in pipelined} == {"eos", "length"}
    assert_clean(pipelined_engine, pipelined)


@pytest.mark.parametrize(
    "engine_kwargs",
    [dict(num_blocks=200), dict(num_blocks=24, max_num_batched_tokens=32),
     dict(num_blocks=24, preemption_mode="swap", swap_space=0.01, max_num_seqs=8),
     dict(num_blocks=60, enable_prefix_caching=True), dict(num_blocks=200, eager_every=3),
     dict(num_blocks=200, mixed_lengths=True)],
    ids=["roomy", "recompute", "swap", "prefix-caching", "eager-steps-between", "mixed-lengths"],
)
def test_store_rows_match_the_tables_after_every_static_step(model, prompts, references, engine_kwargs, monkeypatch):
    """A decode step of the sequences of the last static step looks only at the tables its reservation changed
    (`SchedulerOutput.table_changes`). After every static step, fast or not, each row's record must equal its
    table's (length, last block), as a comparison of every table would leave it; and the tokens are transformers'.
    `eager_every`: every so many steps run eagerly (their reservations change tables too). `mixed_lengths`: requests
    finish along the way, their rows leave the batch, and the others keep their store rows (`kept_rows`)."""
    from hf_paged.runner import model_runner
    from hf_paged.runner.model_runner import ModelRunner

    fast_steps = []
    execute_static, changed_rows = ModelRunner._execute_static, ModelRunner._changed_rows
    engine_kwargs = dict(engine_kwargs)
    eager_every = engine_kwargs.pop("eager_every", 0)
    mixed = engine_kwargs.pop("mixed_lengths", False)
    kept, kept_rows = [], model_runner.kept_rows

    def counting_kept(*args):
        rows = kept_rows(*args)
        kept.append(rows is not None)
        return rows

    monkeypatch.setattr(model_runner, "kept_rows", counting_kept)
    if eager_every:
        static_eligible, calls = ModelRunner.static_eligible, [0]

        def sometimes_eager(self, sched):  # never a pipelined launch's step: those must be static
            calls[0] += 1
            return static_eligible(self, sched) and (sched.decode_step or calls[0] % eager_every != 0)

        monkeypatch.setattr(ModelRunner, "static_eligible", sometimes_eager)

    def counting(self, seq_ids, indices):
        fast_steps.append(len(indices))
        return changed_rows(self, seq_ids, indices)

    def checked(self, sched, input_tokens=None):
        result = execute_static(self, sched, input_tokens)
        if self.last_static and self._last_rows is not None:
            bm = self.cache.block_manager
            store = self._buffers["store"]
            for item in sched.scheduled:
                table = bm.table_view(item.seq.seq_id)
                row, length, last = self._row_of[item.seq.seq_id]
                assert [length, last] == [len(table), table[-1]], item.seq.seq_id
                # the store row the kernels read holds the table (entries released out of a window may keep any id)
                live = [k for k, block in enumerate(table) if block != NULL_BLOCK]
                assert store[row, live].tolist() == [table[k] for k in live], item.seq.seq_id
        return result

    monkeypatch.setattr(ModelRunner, "_execute_static", checked)
    monkeypatch.setattr(ModelRunner, "_changed_rows", counting)
    engine = make_engine(model, **engine_kwargs)
    lengths = [4 + (5 * k) % 13 if mixed else MAX_NEW for k in range(len(prompts) + 5)]
    results = engine.generate(prompts + prompts[:5], [hf_paged.SamplingParams(max_new_tokens=n) for n in lengths])
    assert tokens(results) == [r[:n] for r, n in zip(references + references[:5], lengths)]
    assert len(fast_steps) > 5 and any(fast_steps)  # the fast path ran, new blocks included
    if mixed:  # steps after rows left kept the others' store rows
        assert sum(kept) > 3, kept
    assert_clean(engine, results)


def test_tables_outgrowing_the_store_run_eagerly_and_the_others_stay_right(model, prompts, references):
    """A step with a table longer than the store's rows runs eagerly; the other rows' tables that changed in that step
    must still reach the store before the next static step (their records had already been updated)."""
    engine = make_engine(model, num_blocks=200)
    engine.runner.max_blocks_per_seq = 5  # 40 tokens: the longest prompts outgrow it while they decode, then stop
    lengths = [10 if len(p) > 30 else MAX_NEW for p in prompts]
    results = engine.generate(prompts, [hf_paged.SamplingParams(max_new_tokens=n) for n in lengths])
    assert tokens(results) == [reference[:n] for reference, n in zip(references, lengths)]
    assert engine.runner.eager_steps > 1 and engine.runner.graph_steps > 3  # static steps after the eager ones
    assert_clean(engine, results)


def test_failing_pipelined_launch_fails_only_its_requests(model, prompts, references):
    engine = make_engine(model, num_blocks=200, max_num_seqs=6)
    trigger = PrelaunchTrigger(engine, 3, RuntimeError("injected forward failure"))
    results = engine.generate(prompts, max_new_tokens=MAX_NEW)
    assert trigger.fired == 1 and trigger.hit
    for result, reference in zip(results, references):
        if result.request_id in trigger.hit:
            assert result.outputs[0].finish_reason == "error" and "injected" in str(result.error)
            assert result.outputs[0].token_ids == reference[: len(result.outputs[0].token_ids)]
        else:
            assert result.error is None and result.outputs[0].token_ids == reference
    assert_clean(engine, results)


def test_interrupted_pipelined_launch_loses_nothing(model, prompts, references):
    """Ctrl-C while the next step launches: the step before it is applied, the launching one is recomputed."""
    engine = make_engine(model, num_blocks=200, max_num_seqs=6)
    trigger = PrelaunchTrigger(engine, 4, KeyboardInterrupt())
    ids = [engine.add_request(p, max_new_tokens=MAX_NEW) for p in prompts]
    final = {}
    interrupted = 0
    while engine.has_unfinished():
        try:
            outs = engine.step(finished_only=True)
        except KeyboardInterrupt:
            interrupted += 1
            continue
        final.update((o.request_id, o) for o in outs if o.finished)
    final.update((o.request_id, o) for o in engine.step(finished_only=True) if o.finished)
    assert interrupted == 1 and trigger.fired == 1
    assert [final[i].outputs[0].token_ids for i in ids] == references
    assert_clean(engine, list(final.values()))


def test_interrupt_while_waiting_for_tokens_fails_both_steps_requests(model, prompts, references):
    """Ctrl-C inside the wait for a launched step's tokens (half applied): its requests and those of the step
    launched after it fail with the interrupt attached; every other request is exact; nothing leaks."""
    engine = make_engine(model, num_blocks=200, max_num_seqs=6)
    original = engine._apply
    state = {"calls": 0}

    def apply(current):
        state["calls"] += 1
        if state["calls"] == 5:
            state["hit"] = {item.group.request_id for item in current.sched.scheduled}
            raise KeyboardInterrupt
        return original(current)

    engine._apply = apply
    ids = [engine.add_request(p, max_new_tokens=MAX_NEW) for p in prompts]
    final = {}
    while engine.has_unfinished():
        try:
            outs = engine.step(finished_only=True)
        except KeyboardInterrupt:
            continue
        final.update((o.request_id, o) for o in outs if o.finished)
    final.update((o.request_id, o) for o in engine.step(finished_only=True) if o.finished)
    assert set(final) == set(ids) and state["hit"]
    for request_id, reference in zip(ids, references):
        out = final[request_id]
        if out.error is not None:
            assert isinstance(out.error, KeyboardInterrupt) and out.outputs[0].finish_reason == "error"
            assert out.outputs[0].token_ids == reference[: len(out.outputs[0].token_ids)]
        else:
            assert out.outputs[0].token_ids == reference
    assert state["hit"] <= {r for r, o in final.items() if o.error is not None}
    assert_clean(engine, list(final.values()))


def test_abort_from_another_thread_during_pipelined_decode(model, prompts, references):
    engine = make_engine(model, num_blocks=400)
    long_prompt = prompts[1]
    victim = engine.add_request(long_prompt, request_id="victim", max_new_tokens=60, ignore_eos=True)
    started = threading.Event()
    original = engine._launch

    def launch(sched, logits):
        if engine.pipelined_steps >= 3:
            started.set()
        return original(sched, logits)

    engine._launch = launch
    result = {}

    def aborter():
        assert started.wait(60)
        result["aborted"] = engine.abort(victim)

    thread = threading.Thread(target=aborter)
    thread.start()
    ids = [engine.add_request(p, max_new_tokens=MAX_NEW) for p in prompts]
    reported = []
    while engine.has_unfinished():  # a serving loop: every final output, the victim's included
        reported += engine.step(finished_only=True)
    thread.join(60)
    reported += engine.step(finished_only=True)  # the victim's, if it was aborted after the last step
    assert result.get("aborted") is True
    by_id = {o.request_id: o for o in reported}
    assert len(by_id) == len(reported) == len(ids) + 1, "a request reported twice or never"
    results = [by_id[i] for i in ids]
    assert tokens(results) == references
    out = by_id[victim]
    assert out.outputs[0].finish_reason == "abort" and 0 < len(out.outputs[0].token_ids) < 60
    full = greedy_reference(model, long_prompt, 60, eos_token_id=None)
    assert out.outputs[0].token_ids == full[: len(out.outputs[0].token_ids)]
    assert_clean(engine, results + reported)


@pytest.mark.slow
def test_compiled_submodules_give_the_same_tokens(prompts, references):
    """`compile_modules=True` (Inductor on the CPU here) with the static, pipelined decode path: same greedy tokens,
    and `hf_paged.disable` gives the model back uncompiled."""
    model = tiny_model("llama", seed=1)
    engine = make_engine(model, num_blocks=200, compile_modules=True)
    compiled = [m for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert {type(m).__name__ for m in compiled} >= {"LlamaRMSNorm", "LlamaRotaryEmbedding", "LlamaMLP"}
    engine.warm_up()
    results = engine.generate(prompts[:6], max_new_tokens=MAX_NEW)
    assert tokens(results) == references[:6] and engine.pipelined_steps > 0
    assert_clean(engine, results)
    hf_paged.disable(model)
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in model.modules())
