"""Structured outputs in the engine (`SamplingParams(json_schema=..., regex=..., choice=..., json_object=...)`) on a
tiny random llama with a byte-level tokenizer: whatever the random model prefers, every output obeys its grammar,
greedy, sampled and in parallel samples, next to unconstrained requests; bad constraints are clear errors."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("xgrammar")

import torch  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged import SamplingParams  # noqa: E402
from hf_paged.testing import byte_tokenizer, tiny_model  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "pet"]}


@pytest.fixture(scope="module")
def engine():
    tok = byte_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok) + 20)  # an lm_head wider than the tokenizer: ids never allowed
    eng = hf_paged.Engine(model, tok, num_blocks=64, block_size=4, max_num_seqs=8)
    yield eng
    eng.close()


def _text(engine, completion) -> str:
    return engine.tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def _check_person(text: str) -> None:
    # strict=False: xgrammar's strings with maxLength admit raw control characters (a random model emits them)
    value = json.loads(text, strict=False)
    assert set(value) == {"name", "age", "pet"} and len(value["name"]) <= 6
    assert 0 <= value["age"] <= 120 and value["pet"] in ("cat", "dog")


def test_every_constraint_holds_greedy_sampled_and_in_parallel_samples(engine):
    prompts = ["hello", "x", "person:", "abc", "q", "zz"]
    params = [
        SamplingParams(max_new_tokens=80, json_schema=SCHEMA),
        SamplingParams(max_new_tokens=80, json_schema=json.dumps(SCHEMA), do_sample=True, seed=3),
        SamplingParams(max_new_tokens=12, regex=r"[0-9]{3}-[a-z]{2}"),
        SamplingParams(max_new_tokens=12, choice=["yes", "no", "maybe so"], do_sample=True, seed=5),
        SamplingParams(max_new_tokens=80, json_schema=SCHEMA, do_sample=True, num_return_sequences=3, seed=9),
        SamplingParams(max_new_tokens=10),  # unconstrained, beside them: untouched by the masks
    ]
    before = engine.kv_stats().free_blocks
    outs = engine.generate(prompts, params)
    for out in outs[:2]:
        _check_person(_text(engine, out.outputs[0]))
        assert out.outputs[0].finish_reason in ("grammar", "eos")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", _text(engine, outs[2].outputs[0]))
    assert _text(engine, outs[3].outputs[0]) in ("yes", "no", "maybe so")
    assert len(outs[4].outputs) == 3
    for completion in outs[4].outputs:
        _check_person(_text(engine, completion))
    alone = hf_paged.Engine(engine.model, engine.tokenizer, num_blocks=64, block_size=4).generate(
        [prompts[5]], max_new_tokens=10)[0]
    assert outs[5].outputs[0].token_ids == alone.outputs[0].token_ids
    assert engine.kv_stats().free_blocks == before and not engine.structured.active


def test_grammar_ends_the_request_without_eos_and_json_object(engine):
    out = engine.generate(["a"], SamplingParams(max_new_tokens=40, choice=["first", "second"], ignore_eos=True))[0]
    assert _text(engine, out.outputs[0]) in ("first", "second") and out.outputs[0].finish_reason in ("grammar", "eos")
    obj = engine.generate(["b"], SamplingParams(max_new_tokens=200, json_object=True, do_sample=True, seed=1))[0]
    text = _text(engine, obj.outputs[0])
    if obj.outputs[0].finish_reason != "length":
        assert isinstance(json.loads(text, strict=False), dict)
    else:
        assert text.startswith("{")


def test_pydantic_model_and_compiled_once(engine):
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: int

    cache = engine.structured.cache()
    p = SamplingParams(max_new_tokens=30, json_schema=Point)
    engine.generate(["p"], p)
    compiled = cache.compilations
    outs = engine.generate(["p", "q"], SamplingParams(max_new_tokens=30, json_schema=Point))
    assert cache.compilations == compiled  # served from the LRU
    for out in outs:
        if out.outputs[0].finish_reason != "length":
            Point.model_validate_json(_text(engine, out.outputs[0]))


def test_constrained_requests_are_pipelined_with_the_tokens_of_normal_steps(engine):
    """generate() pipelines the decode steps of constrained requests too (on the static path: CUDA graphs on a GPU,
    its host logic here): while a step's forward runs, the host advances the matchers with the tokens of the step
    before and fills the next masks. The tokens and finish reasons equal those of normal steps (the eager path, never
    pipelined), greedy and seeded, with grammars ending requests while a step is in flight, next to an unconstrained
    request; every block comes back."""
    prompts = ["m", "n", "person:", "q", "zz", "b"]
    params = [SamplingParams(max_new_tokens=12, regex="(ab)+c"),
              SamplingParams(max_new_tokens=12, ignore_eos=True),
              SamplingParams(max_new_tokens=60, json_schema=SCHEMA),
              SamplingParams(max_new_tokens=60, json_schema=SCHEMA, do_sample=True, seed=4),
              SamplingParams(max_new_tokens=20, choice=["yes", "no", "maybe so"], ignore_eos=True),
              SamplingParams(max_new_tokens=30, regex="[a-z]{3,5}", do_sample=True, seed=8)]

    def run(mode):
        eng = hf_paged.Engine(engine.model, engine.tokenizer, num_blocks=64, block_size=4, max_num_seqs=8)
        eng.runner.decode_mode = mode
        outs = eng.generate(prompts, params)
        result = ([o.outputs[0].token_ids for o in outs], [o.outputs[0].finish_reason for o in outs],
                  eng.pipelined_steps, eng.kv_stats().used_blocks, eng.structured.active)
        eng.close()
        return result

    normal, normal_reasons, normal_pipelined, _, _ = run("eager")
    piped, reasons, pipelined, used, active = run("static")
    assert normal_pipelined == 0 and pipelined > 0
    assert piped == normal and reasons == normal_reasons
    assert "grammar" in reasons[2:5]  # ends found while the next step was in flight
    assert used == 0 and not active
    texts = [engine.tokenizer.decode(t, skip_special_tokens=True) for t in piped]
    assert re.fullmatch("(ab)+c", texts[0]) or reasons[0] == "length"
    assert texts[4] in ("yes", "no", "maybe so") and re.fullmatch("[a-z]{3,5}", texts[5])
    for k in (2, 3):
        if reasons[k] != "length":
            _check_person(texts[k])


def test_pipelined_grammar_work_in_worker_chunks_gives_the_tokens_of_normal_steps(engine):
    """A pipelined step's accepts and fills run in several worker chunks (`StructuredOutputs.advance`): 26
    constrained requests, three chunks a step, between unconstrained ones, requests leaving by length, by grammar end
    and by EOS while a step is in flight (so the next step's masks are gathered from the chunks' rows), in the
    scheduler's `DecodeBatch` once the running set settles. Tokens and finish reasons equal those of normal steps;
    every output obeys its grammar; the workers' time is counted."""
    prompts, params = [], []
    for k in range(28):
        prompts.append(f"p{k}:")
        if k % 9 == 4:
            params.append(SamplingParams(max_new_tokens=6 + k, ignore_eos=True))
        elif k % 3 == 0:
            params.append(SamplingParams(max_new_tokens=10 + 2 * k, json_schema=SCHEMA))
        elif k % 3 == 1:
            params.append(SamplingParams(max_new_tokens=8 + k % 7, regex="(ab)+c", ignore_eos=True))
        else:
            params.append(SamplingParams(max_new_tokens=20, choice=["yes", "no", "maybe so"], do_sample=True, seed=k))
    chunks, batched = [], []

    def run(mode):
        eng = hf_paged.Engine(engine.model, engine.tokenizer, num_blocks=512, block_size=4, max_num_seqs=32)
        eng.runner.decode_mode = mode
        eng.structured.threads = 3
        advance = eng.structured.advance

        def counted(sched, *args):
            job = advance(sched, *args)
            chunks.append(len(job.futures) if job is not None else 0)
            batched.append(sched.batch is not None and job is not None)
            return job

        eng.structured.advance = counted
        outs = eng.generate(prompts, params)
        result = ([o.outputs[0].token_ids for o in outs], [o.outputs[0].finish_reason for o in outs],
                  eng.pipelined_steps, dict(eng.structured.host_seconds), eng.kv_stats().used_blocks)
        eng.close()
        return result

    normal, normal_reasons, _, _, _ = run("eager")
    assert not chunks  # normal steps fill in line
    piped, reasons, pipelined, seconds, used = run("static")
    assert pipelined > 0 and max(chunks) == 3 and seconds["workers"] > 0 and used == 0
    assert any(batched)  # constrained rows ride in the scheduler's DecodeBatch too
    assert piped == normal and reasons == normal_reasons
    assert {"length", "grammar"} <= set(reasons)
    for k, (tokens, reason) in enumerate(zip(piped, reasons)):
        text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
        if k % 9 == 4:
            assert len(tokens) == params[k].max_new_tokens
        elif k % 3 == 0 and reason != "length":
            _check_person(text)
        elif k % 3 == 1:
            assert re.fullmatch("(ab)+c", text) or (reason == "length" and re.fullmatch("(ab)*a?", text))
        elif k % 3 == 2:
            assert text in ("yes", "no", "maybe so")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_pipelined_constrained_requests_under_preemption_give_the_tokens_of_normal_steps(engine, mode):
    """A pool too small for 12 constrained requests preempts them (recompute or swap) while their steps are
    pipelined: the batch rows and matchers a pipelined step keeps from the step before (`_StepRows`) are looked up
    again whenever the rows change, so tokens and finish reasons equal those of normal steps."""
    prompts = [f"r{k}: " * (1 + k % 3) for k in range(12)]
    params = [SamplingParams(max_new_tokens=40 + k, json_schema=SCHEMA, ignore_eos=True, do_sample=k % 2 == 1, seed=k)
              for k in range(12)]

    def run(decode_mode):
        eng = hf_paged.Engine(engine.model, engine.tokenizer, num_blocks=40, block_size=4, max_num_seqs=12,
                              preemption_mode=mode, swap_space=0.01 if mode == "swap" else 0)
        eng.runner.decode_mode = decode_mode
        outs = eng.generate(prompts, params)
        result = ([o.outputs[0].token_ids for o in outs], [o.outputs[0].finish_reason for o in outs],
                  sum(o.num_preemptions for o in outs), eng.pipelined_steps, eng.kv_stats().used_blocks)
        eng.close()
        return result

    normal, normal_reasons, _, _, _ = run("eager")
    piped, reasons, preemptions, pipelined, used = run("static")
    assert preemptions > 0 and pipelined > 0 and used == 0
    assert piped == normal and reasons == normal_reasons and "grammar" in reasons


@pytest.mark.parametrize("threads", [1, 3])
def test_a_failing_grammar_job_fails_its_requests_and_the_engine_goes_on(engine, monkeypatch, threads):
    """A chunk that raises (in a worker thread, or in the engine thread with one thread) fails the requests of the
    steps in flight, as a failing accept did: no hang, every block back, and the next requests run normally."""
    from hf_paged.engine import grammar

    real, calls = grammar.advance_chunk, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("boom")
        return real(*args)

    monkeypatch.setattr(grammar, "advance_chunk", failing)
    eng = hf_paged.Engine(engine.model, engine.tokenizer, num_blocks=128, block_size=4, max_num_seqs=16)
    eng.runner.decode_mode = "static"
    eng.structured.threads = threads
    params = SamplingParams(max_new_tokens=30, json_schema=SCHEMA, ignore_eos=True)
    outs = eng.generate([f"f{k}" for k in range(16)], params)
    assert len(calls) >= 4 and "error" in {o.outputs[0].finish_reason for o in outs}
    assert eng.kv_stats().used_blocks == 0 and not eng.has_unfinished()
    monkeypatch.setattr(grammar, "advance_chunk", real)
    again = eng.generate(["g1", "g2"], params)
    assert {o.outputs[0].finish_reason for o in again} <= {"grammar", "length"}
    eng.close()


def test_a_worker_chunk_reports_ends_and_fills_the_masks_of_the_matchers_that_go_on(engine):
    """`advance_chunk` (the worker side of a pipelined step): a token accepted goes on and gets its next mask (as
    the matcher's own fill gives it); a stop token that completes the grammar ends it ("grammar"), as does any token
    given to a terminated matcher; a token the grammar refuses is "grammar_rejected"; ended rows' masks are left
    alone. Rows are taken from the step's picks by their row in the step, ends keyed from `first`."""
    import xgrammar as xgr

    from hf_paged.engine.grammar_jobs import advance_chunk

    compiled = engine.structured.cache().get("regex", "ab")
    a, b = (engine.tokenizer.convert_tokens_to_ids(c) for c in "ab")
    stop = engine.tokenizer.eos_token_id
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(4)]
    for m in matchers[1:3]:
        assert m.accept_token(a) and m.accept_token(b)
    assert matchers[2].accept_token(stop) and matchers[2].is_terminated()
    width = (engine.logits_width() + 31) // 32
    host = torch.full((8, width), 7, dtype=torch.int32)
    picks = torch.tensor([a, b, stop, a, b])  # row 1 (a step row that is not in the chunk) is skipped
    stops = [frozenset(m.stop_token_ids) for m in matchers]
    ends, seconds = advance_chunk(None, picks, [0, 2, 3, 4], 3, matchers, stops, host, xgr.BatchGrammarMatcher(1))
    assert ends == {4: "grammar", 5: "grammar", 6: "grammar_rejected"} and seconds >= 0
    expected = torch.empty((1, width), dtype=torch.int32)
    matchers[0].fill_next_token_bitmask(expected, 0)
    assert torch.equal(host[3], expected[0]) and (host[4:] == 7).all() and (host[:3] == 7).all()


@pytest.mark.parametrize("kwargs, error, words", [
    ({"json_schema": {"type": "objectx"}}, ValueError, "json_schema"),
    ({"regex": "([a-"}, ValueError, "regex"),
    ({"grammar": "root ::= ("}, ValueError, "grammar"),
])
def test_invalid_grammars_are_value_errors(engine, kwargs, error, words):
    with pytest.raises(error, match=words):
        engine.add_request("hi", max_new_tokens=4, **kwargs)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("kwargs, error, words", [
    ({"json_schema": "{not json"}, ValueError, "json_schema is not valid JSON"),
    ({"json_schema": 3}, TypeError, "json_schema must be"),
    ({"regex": ""}, TypeError, "regex must be a non-empty string"),
    ({"choice": "yes"}, TypeError, "choice must be a list"),
    ({"choice": []}, ValueError, "choice must be a non-empty list"),
    ({"json_object": "yes"}, TypeError, "json_object must be a bool"),
    ({"regex": "a", "choice": ["b"]}, ValueError, "at most one"),
    ({"regex": "a", "num_beams": 2}, ValueError, "num_beams"),
    ({"regex": "a", "max_new_tokens": 0, "prompt_logprobs_start": 1}, ValueError, "max_new_tokens"),
    ({"regex": "a", "min_new_tokens": 2}, ValueError, "min_new_tokens"),
])
def test_sampling_params_validation(kwargs, error, words):
    with pytest.raises(error, match=words):
        SamplingParams(**kwargs)


def test_missing_xgrammar_says_what_to_install(monkeypatch):
    import builtins

    from hf_paged.engine import grammar

    real = builtins.__import__

    def no_xgrammar(name, *args, **kwargs):
        if name == "xgrammar":
            raise ImportError("No module named 'xgrammar'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    with pytest.raises(ImportError, match=r"pip install \"hf-paged\[structured\]\""):
        grammar.import_xgrammar()


def test_generate_kwargs_reach_the_engine():
    """`model.generate(..., cache_implementation="paged", json_schema=...)`: the constraint kwargs of the paged path."""
    tok = byte_tokenizer()
    model = hf_paged.enable(tiny_model("llama", vocab_size=len(tok)), num_blocks=32, block_size=4)
    ids = torch.tensor([tok("go")["input_ids"]])
    out = model.generate(ids, cache_implementation="paged", max_new_tokens=12, regex="[a-c]{3}x", tokenizer=tok)
    assert re.fullmatch("[a-c]{3}x", tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    with pytest.raises(ValueError, match="regex"):
        model.generate(ids, cache_implementation="paged", max_new_tokens=4, regex="(", tokenizer=tok)


def test_warm_up_builds_the_cache_and_masks(engine):
    pytest.importorskip("fastapi")
    from hf_paged.serve.structured import warm_up_grammars

    assert warm_up_grammars(engine)
    width = engine.logits_width()
    assert width == len(engine.tokenizer) + 20 and engine.structured.cache().vocab_size == width


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_worker_chunks_on_cuda_wait_for_the_picks_and_give_the_tokens_of_the_engine_thread():
    """On CUDA the worker chunks wait for the launched picks' event themselves (pipelined on CUDA graphs): with three
    workers a step the tokens and finish reasons equal those of one thread (the engine thread does the work), every
    output obeys its schema, and the grammar work was counted on both sides."""
    tok = byte_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok) + 20).to("cuda")
    prompts = [f"c{k}:" for k in range(32)]
    params = [SamplingParams(max_new_tokens=40 + k, json_schema=SCHEMA) for k in range(32)]

    def run(threads):
        eng = hf_paged.Engine(model, tok, num_blocks=1024, block_size=16, max_num_seqs=32)
        eng.structured.threads = threads
        outs = eng.generate(prompts, params)
        result = ([o.outputs[0].token_ids for o in outs], [o.outputs[0].finish_reason for o in outs],
                  eng.pipelined_steps, dict(eng.structured.host_seconds))
        eng.close()
        return result

    tokens, reasons, pipelined, seconds = run(3)
    assert (tokens, reasons) == run(1)[:2]
    assert pipelined > 0 and seconds["workers"] > 0 and seconds["critical"] > 0
    for completion, reason in zip(tokens, reasons):
        if reason != "length":
            _check_person(tok.decode(completion, skip_special_tokens=True))


def test_fill_threads_knob_checks_its_values_and_splits_the_fill(engine, monkeypatch):
    """`StructuredOutputs.fill_threads` (threads sharing the engine thread's batch fill; default 1, or
    HF_PAGED_GRAMMAR_FILL_THREADS): a bad value is a ValueError naming the attribute or the variable; a good one
    gives that many single-threaded xgrammar batches. `fill_rows` of 20 rows over three of them (two slices of at
    least 8 rows: the caller's and a worker's) writes the masks each matcher's own fill gives, at the rows asked (in
    any order), and no other row."""
    import xgrammar as xgr

    from hf_paged.engine.grammar_jobs import FILL_THREADS_ENV, default_fill_threads, fill_rows

    structured = engine.structured
    assert structured.fill_threads == 1 and len(structured._batches()) == 1
    for bad in (0, -2, 1.5, True, "two", None, 1000):
        with pytest.raises(ValueError, match="fill_threads"):
            structured.fill_threads = bad
    assert structured.fill_threads == 1
    structured.fill_threads = 3
    assert len(structured._batches()) == 3
    monkeypatch.setenv(FILL_THREADS_ENV, "3")
    assert default_fill_threads() == 3
    for bad in ("0", "x", "2.5"):
        monkeypatch.setenv(FILL_THREADS_ENV, bad)
        with pytest.raises(ValueError, match=FILL_THREADS_ENV):
            default_fill_threads()
    monkeypatch.delenv(FILL_THREADS_ENV)
    out = engine.generate(["n", "m"], SamplingParams(max_new_tokens=12, regex="[0-9]{3}-[a-z]{2}"))
    assert all(re.fullmatch("[0-9]{3}-[a-z]{2}", _text(engine, o.outputs[0])) for o in out)
    structured.fill_threads = 1
    assert len(structured._batches()) == 1

    compiled = engine.structured.cache().get("regex", "[0-9]{3}-[a-z]{2}")
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(20)]
    for k, m in enumerate(matchers):
        assert m.accept_string(str(k % 10) * (k % 4))
    width = (engine.logits_width() + 31) // 32
    expected = torch.empty((20, width), dtype=torch.int32)
    for k, m in enumerate(matchers):
        m.fill_next_token_bitmask(expected, k)
    batches = [xgr.BatchGrammarMatcher(max_threads=1) for _ in range(3)]
    handles = [m._handle for m in matchers]
    host = torch.full((24, width), 7, dtype=torch.int32)
    fill_rows(batches, handles, host)
    assert torch.equal(host[:20], expected) and (host[20:] == 7).all()
    host.fill_(7)
    rows = [k + 4 for k in range(20)]
    fill_rows(batches, handles[::-1], host, rows[::-1])
    assert torch.equal(host[4:], expected) and (host[:4] == 7).all()
