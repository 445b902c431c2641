"""Soak run: hundreds of random requests against a KV pool far too small for them, with faults and aborts.

Requests arrive over time with random prompts (many sharing a "system prompt", for the prefix cache), lengths and
parameters: greedy (with stop strings, custom eos ids, ignore_eos), sampling (temperature, top-k, top-p, min-p,
repetition penalty, n = 1..3, seeded or not) and beam search. Some are aborted at a random later step, some steps get
an exception injected into the model forward (their requests must fail, and only those), some a KeyboardInterrupt
(their requests must be recomputed and finish as if nothing happened). Two phases: preemption by recompute with the
prefix cache on, then by swap with a CPU pool too small for every group (so some swaps fall back to recompute) and
the prefix cache off.

Checked: every greedy request that was neither aborted nor failed is token-identical to transformers' `generate()`
with its `DynamicCache` (one reference stream per distinct prompt, computed once, eos disabled, then cut where the
request must stop), and so is every beam-search request (transformers' beam search, cached per distinct request);
every intermediate output of a greedy request is a prefix of its final one; every request gets
exactly one final output, aborted ones "abort" and failed ones "error" (only requests scheduled in a faulted step);
sampled and beam requests have the asked number of outputs within their lengths; at the end every block of both pools
is free and no request is left anywhere. The numbers are printed (`pytest -s`).

`HF_PAGED_SOAK=long` runs 5x the requests.
"""

from __future__ import annotations

import collections
import os
import random
import time

import pytest
import torch

import hf_paged
from hf_paged.testing import tiny_model

try:
    from tests.helpers import dense_generate, greedy_reference, restore_generation_config, tiny_word_tokenizer
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import dense_generate, greedy_reference, restore_generation_config, tiny_word_tokenizer

LONG = os.environ.get("HF_PAGED_SOAK", "").lower() == "long"
REQUESTS_PER_PHASE = 5000 if LONG else 600
MAX_NEW = 24  # longest greedy request; reference streams have this many tokens
EOS = 2
HAS_BEAMS = "num_beams" in hf_paged.SamplingParams.names()


@pytest.fixture(scope="module")
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
def corpus(model, one_thread):
    """Distinct prompts (half of them behind one of 3 system prompts) and transformers' greedy stream for each."""
    rng = random.Random(2024)
    systems = [[rng.randrange(3, 384) for _ in range(n)] for n in (9, 17, 24)]
    prompts = []
    for i in range(48):
        own = [rng.randrange(3, 384) for _ in range(rng.choice([1, 2, 5, 8, 13, 21, 30]))]
        prompts.append((systems[i % 3] + own) if i % 2 else own)
    with restore_generation_config(model) as config:
        config.eos_token_id = None  # the full stream; each request is cut where it must stop
        streams = [greedy_reference(model, p, MAX_NEW) for p in prompts]
    assert all(len(s) == MAX_NEW for s in streams)
    return prompts, streams


def expected_greedy(stream, p: hf_paged.SamplingParams, tok) -> list[int]:
    """Where the engine must stop a greedy request on this stream: eos, length, then stop strings (its order)."""
    eos = () if p.ignore_eos else p.eos_token_id
    for k in range(1, p.max_new_tokens + 1):
        token = stream[k - 1]
        if token in eos and k >= p.min_new_tokens:
            return stream[:k]
        if k >= p.max_new_tokens:
            return stream[:k]
        if p.stop_strings and any(s in tok.decode(stream[:k], skip_special_tokens=False) for s in p.stop_strings):
            return stream[:k]
    raise AssertionError("unreachable")


class Faults:
    """Wraps the model forward: the driver arms an exception or a KeyboardInterrupt for the next step."""

    def __init__(self, model):
        self.model = model
        self.armed: BaseException | None = None
        self.forward = model.forward
        model.forward = self

    def __call__(self, *args, **kwargs):
        error, self.armed = self.armed, None
        if error is not None:
            raise error
        return self.forward(*args, **kwargs)

    def remove(self):
        del self.model.forward


def random_params(rng: random.Random, stream, tok, num_blocks_fit) -> tuple[str, hf_paged.SamplingParams]:
    roll = rng.random()
    if roll < 0.5:
        kwargs = dict(max_new_tokens=rng.randint(1, MAX_NEW))
        extra = rng.random()
        if extra < 0.2:  # stop at a 3-digit token of the stream (its word appears only when it is produced)
            words = [t for t in stream if t >= 100]
            if words:
                kwargs["stop_strings"] = [f"w{rng.choice(words)}"]
        elif extra < 0.35:
            kwargs["ignore_eos"] = True
        elif extra < 0.45:
            kwargs["eos_token_id"] = [rng.choice(stream), EOS]
        return "greedy", hf_paged.SamplingParams(**kwargs)
    if roll < 0.85 or not HAS_BEAMS:
        n = rng.choice([1, 1, 2, 3])
        while n > 1 and not num_blocks_fit(n):
            n -= 1
        kwargs = dict(max_new_tokens=rng.randint(1, 16), do_sample=True, num_return_sequences=n,
                      temperature=rng.choice([0.5, 1.0, 1.5]), top_k=rng.choice([0, 0, 20]),
                      top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]),
                      repetition_penalty=rng.choice([1.0, 1.0, 1.3]), seed=rng.choice([None, rng.randrange(10**6)]))
        if rng.random() < 0.2:
            kwargs["min_new_tokens"] = rng.randint(0, kwargs["max_new_tokens"])
        return "sample", hf_paged.SamplingParams(**kwargs)
    k = rng.choice([2, 3])
    while k > 2 and not num_blocks_fit(k):
        k -= 1
    if not num_blocks_fit(k):
        return "greedy", hf_paged.SamplingParams(max_new_tokens=rng.randint(1, MAX_NEW))
    return "beam", hf_paged.SamplingParams(max_new_tokens=rng.randint(1, 8), num_beams=k,
                                           num_return_sequences=rng.randint(1, k),
                                           length_penalty=rng.choice([1.0, 0.5]),
                                           early_stopping=rng.choice([False, True]))


_beam_refs: dict = {}


def beam_reference(model, prompt: tuple, p: hf_paged.SamplingParams) -> list[list[int]]:
    """transformers' beam search (DynamicCache, plain model), its hypotheses cut after their eos; cached."""
    key = (prompt, p.num_beams, p.num_return_sequences, p.max_new_tokens, p.length_penalty, p.early_stopping)
    if key not in _beam_refs:
        out = dense_generate(model, input_ids=torch.tensor([prompt]), num_beams=p.num_beams,
                             num_return_sequences=p.num_return_sequences, max_new_tokens=p.max_new_tokens,
                             length_penalty=p.length_penalty, early_stopping=p.early_stopping, do_sample=False)
        rows = [row[len(prompt):] for row in out.tolist()]
        _beam_refs[key] = [row[: row.index(EOS) + 1] if EOS in row else row for row in rows]
    return _beam_refs[key]


def run_phase(model, corpus, tok, seed: int, engine_kwargs: dict, totals: collections.Counter) -> None:
    prompts, streams = corpus
    rng = random.Random(seed)
    engine = hf_paged.Engine(model, tok, seed=seed, **engine_kwargs)  # seeded: the same run every time
    bm = engine.block_manager
    spy = {"sched": None}
    schedule = engine.scheduler.schedule

    def recording_schedule():
        spy["sched"] = schedule()
        return spy["sched"]

    engine.scheduler.schedule = recording_schedule
    faults = Faults(model)
    kind: dict[str, str] = {}
    wanted: dict[str, list[int]] = {}  # greedy: the stream the request must follow
    params_of: dict[str, hf_paged.SamplingParams] = {}
    abort_at: dict[int, list[str]] = collections.defaultdict(list)
    aborted, failed, requeued, final = set(), set(), collections.Counter(), {}
    last_len: dict[str, int] = {}
    added = 0
    step = 0
    try:
        while added < REQUESTS_PER_PHASE or engine.has_unfinished():
            # arrivals: bursts and lulls, so the running batch grows, preempts and drains again
            if added < REQUESTS_PER_PHASE and rng.random() < 0.6:
                for _ in range(rng.choice([1, 1, 2, 4, 8])):
                    if added == REQUESTS_PER_PHASE:
                        break
                    index = rng.randrange(len(prompts))
                    prompt = prompts[index]

                    def fits(width, prompt=prompt):
                        return bm.blocks_for(len(prompt) + 16) * width <= bm.num_blocks

                    what, params = random_params(rng, streams[index], tok, fits)
                    request_id = engine.add_request(prompt, request_id=f"p{seed}-{added}", params=params)
                    added += 1
                    kind[request_id], params_of[request_id] = what, params
                    if what == "greedy":
                        wanted[request_id] = expected_greedy(streams[index], params, tok)
                    if rng.random() < 0.1:
                        abort_at[step + rng.randint(0, 30)].append(request_id)
            for request_id in abort_at.pop(step, []):
                if engine.abort(request_id):
                    aborted.add(request_id)
            roll = rng.random()
            if roll < 0.006:
                faults.armed = RuntimeError("injected forward failure")
            elif roll < 0.01:
                faults.armed = KeyboardInterrupt()
            armed = faults.armed
            step += 1
            try:
                outs = engine.step()
            except KeyboardInterrupt:
                assert armed is not None and isinstance(armed, KeyboardInterrupt)
                totals["keyboard_interrupts"] += 1
                for item in spy["sched"].scheduled:
                    requeued[item.group.request_id] += 1
                continue
            finally:
                if armed is not None and faults.armed is None and spy["sched"] is not None:
                    hit = {item.group.request_id for item in spy["sched"].scheduled}
                    if isinstance(armed, RuntimeError):
                        totals["forward_faults"] += 1
                        failed |= hit
            faults.armed = None  # a step that ran no forward did not consume it
            for out in outs:
                request_id = out.request_id
                assert request_id not in final, f"{request_id}: output after its final one"
                if kind[request_id] == "greedy":
                    got = out.outputs[0].token_ids
                    assert len(got) >= last_len.get(request_id, 0), f"{request_id} lost tokens"
                    last_len[request_id] = len(got)
                    assert got == wanted[request_id][: len(got)], f"{request_id} diverged from transformers"
                if out.finished:
                    final[request_id] = out
            assert step < 100_000, "the soak run does not drain"
    finally:
        faults.remove()

    # -------------------------------------------------------------- every request: exactly one final output
    assert set(final) == set(kind), set(kind) ^ set(final)
    for request_id, out in final.items():
        reasons = {o.finish_reason for o in out.outputs}
        if out.error is not None:
            # samples that had finished before the fault keep their own reason
            assert request_id in failed and "error" in reasons <= {"error", "eos", "length"}, (request_id, reasons)
            assert "injected forward failure" in str(out.error)
            totals["requests_failed"] += 1
            continue
        if request_id in aborted:
            assert "abort" in reasons <= {"abort", "eos", "length"}, (request_id, reasons)
            if kind[request_id] == "greedy":
                got = out.outputs[0].token_ids
                assert got == wanted[request_id][: len(got)]
            totals["requests_aborted"] += 1
            continue
        p = params_of[request_id]
        totals[f"requests_{kind[request_id]}"] += 1
        if kind[request_id] == "greedy":
            assert out.outputs[0].token_ids == wanted[request_id], request_id
            totals["greedy_tokens_checked"] += len(wanted[request_id])
            if requeued[request_id]:
                totals["greedy_interrupted_then_exact"] += 1
        elif kind[request_id] == "sample":
            assert len(out.outputs) == p.num_return_sequences
            for o in out.outputs:
                assert max(1, p.min_new_tokens) <= len(o.token_ids) <= p.max_new_tokens, (request_id, o)
                assert all(0 <= t < 384 for t in o.token_ids) and o.finish_reason in ("eos", "length")
        else:
            assert len(out.outputs) == p.num_return_sequences
            assert all(1 <= len(o.token_ids) <= p.max_new_tokens for o in out.outputs)
            assert all(o.finish_reason in ("eos", "length") for o in out.outputs)
            assert [o.token_ids for o in out.outputs] == beam_reference(model, tuple(out.prompt_token_ids), p)
            totals["beam_tokens_checked"] += sum(len(o.token_ids) for o in out.outputs)
    assert {r for r, o in final.items() if o.error is not None} == failed, "a fault failed other requests"

    # -------------------------------------------------------------- nothing left behind
    stats = engine.kv_stats()
    leaked = stats.used_blocks + stats.cpu_used_blocks + len(bm.seq_ids())
    assert stats.used_blocks == 0 and stats.free_blocks == stats.num_blocks, stats
    assert stats.cpu_used_blocks == 0 and stats.cpu_free_blocks == stats.cpu_blocks, stats
    assert bm.seq_ids() == [] and not engine.has_unfinished() and engine.registry.groups == {}
    totals["requests"] += len(final)
    totals["steps"] += engine.stats["steps"]
    for mode, count in engine.scheduler.num_preemptions.items():
        totals[f"preemptions_{mode}"] += count
        totals[f"phase{seed}_preemptions_{mode}"] += count
    totals["blocks_leaked"] += leaked
    totals["prefix_hit_tokens"] += getattr(bm, "prefix_hit_tokens", 0)
    totals["max_running"] = max(totals["max_running"], engine.stats["max_running"])


@pytest.mark.slow
def test_soak(model, corpus, one_thread):
    tok = tiny_word_tokenizer()
    totals: collections.Counter = collections.Counter()
    start = time.monotonic()
    # phase 1: recompute, prefix cache on, chunked prefill (budget 48 < the longest prompts)
    run_phase(model, corpus, tok, 1, dict(block_size=8, num_blocks=16, max_num_seqs=12, max_num_batched_tokens=48),
              totals)
    # phase 2: swap to a CPU pool of 6 blocks (too small for some groups: those fall back to recompute), no cache
    per_block = hf_paged.PagedCache(config=model.config, num_blocks=1, block_size=8).bytes_per_block(torch.float32)
    swap_kwargs = dict(block_size=8, num_blocks=16, max_num_seqs=12, max_num_batched_tokens=64,
                       preemption_mode="swap", swap_space=6 * per_block / 2**30 + 1e-12)
    if "enable_prefix_caching" in hf_paged.Engine.__init__.__code__.co_varnames:
        swap_kwargs["enable_prefix_caching"] = False
    run_phase(model, corpus, tok, 2, swap_kwargs, totals)
    totals["seconds"] = round(time.monotonic() - start)
    print(f"\nsoak ({'long' if LONG else 'CI'}): {dict(sorted(totals.items()))}")
    assert totals["blocks_leaked"] == 0
    assert totals["requests"] == 2 * REQUESTS_PER_PHASE
    assert totals["preemptions_recompute"] >= 100 and totals["preemptions_swap"] >= 100, totals
    assert totals["phase2_preemptions_recompute"] >= 1, "no swap fell back to recompute"
    assert totals["requests_aborted"] >= 50 and totals["requests_failed"] >= 10, totals
    assert totals["forward_faults"] >= 5 and totals["keyboard_interrupts"] >= 5, totals
    assert totals["greedy_interrupted_then_exact"] >= 5, totals
    assert totals["greedy_tokens_checked"] >= 4000 and totals["prefix_hit_tokens"] >= 1000, totals
    if HAS_BEAMS:
        assert totals["requests_beam"] >= 50 and totals["beam_tokens_checked"] >= 500, totals
