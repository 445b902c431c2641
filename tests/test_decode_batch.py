"""`DecodeBatch`: the pipelined decode steps of the same sequences advance their rows in arrays. Every step must
reserve what the per-sequence path would (the same positions, slots, new blocks and prefix-cache commits), and every
request must get the same tokens, under stops, aborts, prefix caching, sampling and pool pressure."""

from __future__ import annotations

import random

import pytest

import hf_paged
from hf_paged.core import decode_batch
from hf_paged.engine import _IN_FLIGHT
from hf_paged.model_zoo import tiny_model as zoo_model
from hf_paged.testing import tiny_model

try:
    from tests.helpers import random_prompts
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import random_prompts


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=4)


def _run(model, requests, *, batched: bool, monkeypatch, **engine_kwargs):
    """Generate `requests` with the batch fast path on or off; return the outputs, every pipelined step's rows
    (sequence id, position, slot, committed blocks) and table changes, the number of batch steps, the final pool
    statistics and the number of steps applied on the batch's arrays."""
    with monkeypatch.context() as patch:
        if not batched:
            patch.setattr(decode_batch.DecodeBatch, "records", staticmethod(lambda *args: None))
        engine = hf_paged.Engine(model, **engine_kwargs)
        engine.runner.decode_mode = "static"
        steps, batch_steps = [], [0]
        schedule = engine.scheduler.schedule_decode_step

        def recorded(*args, **kwargs):
            out = schedule(*args, **kwargs)
            if out is not None:  # with each row the block manager's count of keyed (prefix-cache committed) blocks
                records = engine.block_manager._seqs
                steps.append(([(i.seq.seq_id, i.start, list(i.slots), records[i.seq.seq_id].committed)
                               for i in out.scheduled], out.table_changes))
                batch_steps[0] += out.batch is not None
            return out

        engine.scheduler.schedule_decode_step = recorded
        on_arrays = [0]  # steps applied on the batch's arrays (`_apply_rows`)
        apply_rows = type(engine)._apply_rows

        def counted(self, *args):
            on_arrays[0] += 1
            return apply_rows(self, *args)

        patch.setattr(type(engine), "_apply_rows", counted)
        outs = engine.generate([p for p, _ in requests], [hf_paged.SamplingParams(**kw) for _, kw in requests])
        stats = engine.kv_stats()
        prefix = engine.prefix_cache_stats()
        engine.close()
    base = min(row[0] for rows, _ in steps for row in rows)  # sequence ids count on across engines
    steps = [([(row[0] - base, *row[1:]) for row in rows], changes) for rows, changes in steps]
    results = [[o.token_ids for o in r.outputs] for r in outs]
    assert all(_IN_FLIGHT not in t for r in results for t in r)
    assert stats.used_blocks == 0
    return results, steps, batch_steps[0], (prefix.hit_tokens, prefix.cached_blocks), on_arrays[0]


def _requests(seed: int, count: int, *, sampled: bool = False, eos: bool = False, shared: int = 0):
    rng = random.Random(seed)
    prompts = random_prompts(tuple(rng.randint(1, 40) for _ in range(count)), seed=seed)
    base = prompts[0][:shared] if shared else []
    requests = []
    for k, prompt in enumerate(prompts):
        kw = dict(max_new_tokens=rng.randint(1, 45), ignore_eos=not eos)
        if eos:
            kw["eos_token_id"] = rng.sample(range(3, 384), 25)  # a stop every ~15 tokens (384-token vocabulary)
        if sampled and k % 3:
            kw.update(do_sample=True, temperature=rng.choice([0.7, 1.0, 1.3]), top_p=rng.choice([1.0, 0.9]),
                      top_k=rng.choice([0, 20]), min_p=rng.choice([0.0, 0.05]), seed=k if k % 2 else None)
        requests.append((base + prompt, kw))
    return requests


@pytest.mark.parametrize(("case", "engine_kwargs"), [
    ("greedy", dict(block_size=4, num_blocks=400, max_num_seqs=24)),
    ("sampled", dict(block_size=8, num_blocks=300, max_num_seqs=24, seed=7)),
    ("eos", dict(block_size=4, num_blocks=400, max_num_seqs=24)),
    ("prefix", dict(block_size=4, num_blocks=400, max_num_seqs=24)),
    ("pressure", dict(block_size=4, num_blocks=60, max_num_seqs=16)),
    ("no_caching", dict(block_size=4, num_blocks=400, max_num_seqs=24, enable_prefix_caching=False)),
])
def test_batch_steps_reserve_what_the_per_sequence_path_does(model, monkeypatch, case, engine_kwargs):
    requests = _requests(11 + len(case), 30, sampled=case == "sampled", eos=case == "eos",
                         shared=12 if case in ("prefix", "pressure") else 0)
    fast = _run(model, requests, batched=True, monkeypatch=monkeypatch, **engine_kwargs)
    slow = _run(model, requests, batched=False, monkeypatch=monkeypatch, **engine_kwargs)
    assert fast[2] > 0 and slow[2] == 0  # the fast path ran (and only there)
    assert fast[4] > 0 and slow[4] == 0  # and its steps' tokens went in on the arrays
    assert fast[0] == slow[0]  # every request's tokens
    assert len(fast[1]) == len(slow[1])
    for k, (a, b) in enumerate(zip(fast[1], slow[1])):
        assert a == b, f"pipelined step {k} differs"
    assert fast[3] == slow[3]  # prefix-cache hits and cached blocks: the same commits


def test_abort_between_batch_steps_leaves_the_others_whole(model):
    """An abort between pipelined steps (with a step in flight) drops the batch; the other requests go on to the very
    tokens they get without the abort, and every block comes back."""
    prompts = random_prompts((5, 9, 13), seed=2)

    def run(abort_at: int | None):
        engine = hf_paged.Engine(model, block_size=4, num_blocks=300, max_num_seqs=8)
        engine.runner.decode_mode = "static"
        ids = [engine.add_request(p, max_new_tokens=30, ignore_eos=True) for p in prompts]
        outputs, batched = {}, 0
        while engine.has_unfinished():
            for out in engine.step(finished_only=True):
                outputs[out.request_id] = out
            batched += engine.scheduler.decode_batch is not None
            if engine.stats["steps"] == abort_at:
                assert engine.scheduler.decode_batch is not None  # the abort lands in the middle of a batch
                engine.abort(ids[1])
                assert engine.scheduler.decode_batch is None
        assert engine.kv_stats().used_blocks == 0
        engine.close()
        return [outputs[i].outputs[0].token_ids for i in ids], outputs[ids[1]].outputs[0].finish_reason, batched

    full, _, batched = run(None)
    cut, reason, _ = run(12)
    assert batched > 10
    assert cut[0] == full[0] and cut[2] == full[2] and len(full[1]) == 30
    assert reason == "abort" and full[1][:len(cut[1])] == cut[1] and len(cut[1]) < 30



def test_requests_finishing_by_length_leave_the_batch_to_the_others(model, monkeypatch):
    """The step after the one that gives a request its last token leaves its row out (`DecodeBatch.remove`, the step
    in flight keeps it): the one batch goes on for the others through every finish, no step is scheduled the general
    way again, and the steps are still applied on the arrays. Tokens are those of the per-sequence path."""
    prompts = random_prompts((5, 9, 13, 7), seed=6)
    lengths = (4, 30, 11, 30)

    def run(batched: bool):
        with monkeypatch.context() as patch:
            if not batched:
                patch.setattr(decode_batch.DecodeBatch, "records", staticmethod(lambda *args: None))
            engine = hf_paged.Engine(model, block_size=4, num_blocks=300, max_num_seqs=8)
            engine.runner.decode_mode = "static"
            ids = [engine.add_request(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, lengths)]
            applied = {"rows": 0, "batch": 0}
            for name in ("_apply_rows", "_apply_batch"):
                patch.setattr(engine, name, _counting(getattr(engine, name), applied, name[7:]))
            outputs, kept = {}, []
            while engine.has_unfinished():
                finished = engine.step(finished_only=True)
                outputs.update((out.request_id, out.outputs[0].token_ids) for out in finished)
                if finished and engine.has_unfinished():
                    kept.append(engine.scheduler.decode_batch)
            engine.close()
        return [outputs[i] for i in ids], kept, applied

    tokens, kept, applied = run(True)
    assert [len(t) for t in tokens] == list(lengths)
    assert len(kept) == 2 and kept[0] is not None and kept[1] is kept[0], kept  # one batch through both finishes
    # every batch step applied on the arrays but the last: its rows all finish, which leaves no batch to schedule
    assert applied["batch"] <= 1 and applied["rows"] > 20, applied
    assert tokens == run(False)[0]


def _counting(function, counts: dict, key: str):
    def counted(*args, **kwargs):
        counts[key] += 1
        return function(*args, **kwargs)

    return counted


def test_a_request_stopping_on_eos_leaves_its_row_and_the_batch_goes_on(model, monkeypatch):
    """An EOS stop is known only when its step is applied, with the next step in flight: the scheduler removes the
    row from the batch (`DecodeBatch.remove`), the in-flight step is applied row by row, and the next steps advance
    the smaller batch, taking their input ids from the right rows. Tokens are those of the per-sequence path."""
    requests = _requests(21, 12, eos=True)
    shared = requests[0][1]["eos_token_id"]  # one model's EOS ids: the rows are applied on the arrays
    requests = [(prompt, dict(kw, eos_token_id=shared)) for prompt, kw in requests]
    removals = []
    remove = decode_batch.DecodeBatch.remove

    def counted(self, gone, voids_in_flight=True):
        if voids_in_flight:  # (not the rows leaving as they reach their length limits)
            removals.append(len(gone))
        return remove(self, gone, voids_in_flight)

    monkeypatch.setattr(decode_batch.DecodeBatch, "remove", counted)
    fast = _run(model, requests, batched=True, monkeypatch=monkeypatch, block_size=4, num_blocks=400, max_num_seqs=16)
    slow = _run(model, requests, batched=False, monkeypatch=monkeypatch, block_size=4, num_blocks=400,
                max_num_seqs=16)
    assert len(removals) > 2 and fast[4] > 10
    assert fast[0] == slow[0] and fast[1] == slow[1] and fast[3] == slow[3]
    assert fast[2] > len(fast[1]) * 0.7  # most pipelined steps were the batch's


def _lane_records(block_manager, seq_id) -> list:
    """The records of a sequence's tables: one per layer group of a grouped manager, else the manager's one."""
    if getattr(block_manager, "grouped", False):
        return [block_manager.inner._seqs[seq_id, g] for g in range(block_manager.num_groups)]
    return [block_manager._seqs[seq_id]]


def _run_windowed(model, requests, *, batched: bool, monkeypatch, **engine_kwargs):
    """`_run` for models whose layers slide: every pipelined step's rows with each of their tables (every layer
    group's, released entries included), the slot of the row's token in each, and each table's released and
    committed blocks; a batch step's own slots of the other groups are checked against the tables on the way."""
    with monkeypatch.context() as patch:
        if not batched:
            patch.setattr(decode_batch.DecodeBatch, "records", staticmethod(lambda *args: None))
        engine = hf_paged.Engine(model, **engine_kwargs)
        engine.runner.decode_mode = "static"
        bm, size = engine.block_manager, engine_kwargs["block_size"]
        shift, mask = size.bit_length() - 1, size - 1
        steps, batch_steps = [], [0]
        schedule = engine.scheduler.schedule_decode_step

        def recorded(*args, **kwargs):
            out = schedule(*args, **kwargs)
            if out is None:
                return out
            rows = []
            for item in out.scheduled:
                records, p = _lane_records(bm, item.seq.seq_id), item.start
                rows.append((item.seq.seq_id, p, [(r.table[p >> shift] << shift) | (p & mask) for r in records],
                             [tuple(r.table) for r in records], [r.released for r in records],
                             [r.committed for r in records]))
            if out.batch is not None and out.batch_step == out.batch.number and out.batch.number > 0:
                batch_steps[0] += 1
                for g, lane in enumerate(out.batch.group_slots(), start=1):
                    assert lane.tolist() == [row[2][g] for row in rows]
                assert out.batch.slots.tolist() == [row[2][0] for row in rows]
            steps.append(rows)
            return out

        engine.scheduler.schedule_decode_step = recorded
        outs = engine.generate([p for p, _ in requests], [hf_paged.SamplingParams(**kw) for _, kw in requests])
        stats = engine.kv_stats()
        engine.close()
    base = min(row[0] for rows in steps for row in rows)
    steps = [[(row[0] - base, *row[1:]) for row in rows] for rows in steps]
    assert stats.used_blocks == 0
    return [[o.token_ids for o in r.outputs] for r in outs], steps, batch_steps[0], stats.window_released


WINDOWED = {  # (tiny model kwargs, whether the engine keeps one table per layer group)
    "gemma3_groups": (dict(model_type="gemma3_text", num_hidden_layers=3, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"]), True),
    "mistral_all_sliding": (dict(model_type="mistral", num_hidden_layers=2, sliding_window=8), False),
}


@pytest.mark.parametrize("case", ["greedy", "prefix", "pressure"])
@pytest.mark.parametrize("name", list(WINDOWED))
def test_batch_steps_of_sliding_layers_release_and_reserve_what_the_general_path_does(monkeypatch, name, case):
    """Models whose layers slide keep the batch: block groups of a mixed stack (a lane per group) and a stack that
    slides everywhere (one table). Each batch step releases what falls out of each window and reserves the slots,
    blocks and prefix-cache commits that the general path does, step for step, with the same tokens."""
    overrides, grouped = WINDOWED[name]
    overrides = dict(overrides)
    model = zoo_model(overrides.pop("model_type"), seed=3, **overrides)
    requests = [([t % 256 for t in prompt], kw)  # (the zoo's vocabulary)
                for prompt, kw in _requests(31 + len(case), 20, shared=12 if case != "greedy" else 0)]
    kwargs = dict(block_size=4, max_num_seqs=16, num_blocks=90 if case == "pressure" else 600)
    fast = _run_windowed(model, requests, batched=True, monkeypatch=monkeypatch, **kwargs)
    slow = _run_windowed(model, requests, batched=False, monkeypatch=monkeypatch, **kwargs)
    assert fast[2] > 10 and slow[2] == 0
    assert fast[3] > 0 and fast[3] == slow[3]  # blocks released out of the windows
    assert fast[0] == slow[0]
    assert len(fast[1]) == len(slow[1])
    for k, (a, b) in enumerate(zip(fast[1], slow[1])):
        assert a == b, f"pipelined step {k} differs"
    assert all((len(row[3]) > 1) == grouped for rows in fast[1] for row in rows)  # lanes: the groups, or one
