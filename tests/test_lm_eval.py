"""lm-eval's `hf-paged` backend against the plain `hf` backend, offline: three tiny custom tasks from local JSONL (a
`generate_until` task with stop sequences, a `loglikelihood` multiple-choice task, a `loglikelihood_rolling` task
whose documents span several windows of a small `max_length`) on SmolLM2-135M (CPU, float32): the same generations,
the same log-likelihoods up to float rounding (scored on the engine's paged prefill), the same metrics."""

from __future__ import annotations

import json
import math
import runpy
import sys

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("datasets")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import get_rolling_token_windows  # noqa: E402

from hf_paged.integrations.lm_eval import HFPagedLM, sampling_params  # noqa: E402
from hf_paged.testing import smollm2_checkpoint  # noqa: E402

try:
    from tests.helpers import write_lm_eval_gen_task
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import write_lm_eval_gen_task

# the SmolLM2 evaluators are built once for the file: the file runs on one worker
pytestmark = pytest.mark.xdist_group("lm_eval")

MC = [
    ("The sun rises in the", ["east", "west", "north"], 0),
    ("A cat says", ["woof", "meow", "moo"], 1),
    ("Ice is made of frozen", ["sand", "fire", "water"], 2),
    ("One week has seven", ["days", "apples", "cars"], 0),
]
DOCS = [
    "The river wound through the valley, past old mills and quiet farms, until it reached the sea at last. Along "
    "its banks the villagers kept gardens of beans and onions, and in autumn the orchards smelled of ripe apples.",
    "Paged attention stores the keys and values of every sequence in fixed-size blocks, like the pages of virtual "
    "memory, so that many requests share one pool and a common prefix is computed once.",
    "A short one.",
]
MAX_LENGTH = 24  # small: the documents above span several rolling windows, full windows are max_length + 1 long
ATOL = 1e-4

MC_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


ROLLING_YAML = """task: tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
TASKS = ["tiny_gen", "tiny_mc", "tiny_rolling"]


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    write_lm_eval_gen_task(root)
    mc, rolling = root / "mc.jsonl", root / "rolling.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "label": y}) + "\n" for q, c, y in MC))
    rolling.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    (root / "tiny_mc.yaml").write_text(MC_YAML.format(path=mc))
    (root / "tiny_rolling.yaml").write_text(ROLLING_YAML.format(path=rolling))
    return TaskManager(include_path=str(root))


@pytest.fixture(scope="module")
def lm_args():
    return dict(pretrained=str(smollm2_checkpoint()), dtype="float32", device="cpu", batch_size=2,
                max_length=MAX_LENGTH)


@pytest.fixture(scope="module")
def plain_lm(lm_args):
    return HFLM(**lm_args)


@pytest.fixture(scope="module")
def paged_lm(lm_args):
    return HFPagedLM(**lm_args, num_blocks=64, block_size=4)


def _run(lm, task_manager):
    out = simple_evaluate(model=lm, tasks=TASKS, task_manager=task_manager, log_samples=True, bootstrap_iters=0)
    samples = {task: [(s["doc_id"], s["resps"], s["filtered_resps"]) for s in rows]
               for task, rows in out["samples"].items()}
    metrics = {task: {k: v for k, v in m.items() if not k.endswith("stderr,none")}
               for task, m in out["results"].items()}
    return samples, metrics


def _assert_close(paged, plain, path="") -> None:
    """Equal structures; floats within ATOL (the log-likelihoods), everything else (texts, is_greedy) equal."""
    if isinstance(plain, float):
        assert isinstance(paged, float) and math.isclose(paged, plain, rel_tol=1e-5, abs_tol=ATOL), (path, paged,
                                                                                                    plain)
    elif isinstance(plain, (list, tuple)):
        assert isinstance(paged, (list, tuple)) and len(paged) == len(plain), (path, paged, plain)
        for i, (a, b) in enumerate(zip(paged, plain)):
            _assert_close(a, b, f"{path}[{i}]")
    elif isinstance(plain, dict):
        assert paged.keys() == plain.keys(), path
        for key in plain:
            _assert_close(paged[key], plain[key], f"{path}.{key}")
    else:
        assert paged == plain, (path, paged, plain)


def _num_windows(lm) -> int:
    return sum(len(list(get_rolling_token_windows(lm.tok_encode(doc), lm.prefix_token_id, MAX_LENGTH, 1)))
               for doc in DOCS)


@pytest.mark.slow
def test_hf_paged_matches_hf_backend(task_manager, plain_lm, paged_lm):
    plain = _run(plain_lm, task_manager)
    before = paged_lm.engine_loglikelihood_requests
    paged = _run(paged_lm, task_manager)
    _assert_close(paged, plain)
    assert paged[0]["tiny_gen"] == plain[0]["tiny_gen"]  # generations: identical
    answers = [r[0] for _, r, _ in paged[0]["tiny_gen"]]
    assert any(answers) and not any("\n" in a or "." in a for a in answers)  # generated, cut at the stops
    windows = _num_windows(paged_lm)
    assert windows > len(DOCS)  # some document spans several windows, full ones max_length + 1 tokens long
    # every choice and every window was scored on the engine (none fell back to HFLM's forwards)
    assert paged_lm.engine_loglikelihood_requests - before == sum(len(c) for _, c, _ in MC) + windows
    assert paged_lm.engine.kv_stats().used_blocks == 0


@pytest.mark.slow
def test_shared_context_is_scored_once_from_the_prefix_cache(plain_lm, paged_lm):
    """Continuations of one long context: the same answers as HFLM, the context's whole blocks computed once."""
    context = paged_lm.tok_encode("Question: which of these words names a season of the year? Answer:")
    requests = [(("ctx", cont), context, paged_lm.tok_encode(cont)) for cont in (" winter", " table", " summer")]
    engine = paged_lm.engine
    engine.reset_prefix_cache()
    hits = engine.prefix_cache_stats().hit_tokens
    paged = paged_lm._loglikelihood_tokens(requests)
    _assert_close(paged, plain_lm._loglikelihood_tokens(requests))
    block = engine.block_manager.block_size
    cached = min(len(context), MAX_LENGTH) - 1  # the positions before the first scored one
    assert engine.prefix_cache_stats().hit_tokens - hits >= (len(requests) - 1) * (cached // block * block) > 0


def test_sampling_params_from_gen_kwargs():
    p, until = sampling_params({"until": ["\n\n"], "max_gen_toks": 7, "temperature": 0.0}, 256, "<eos>")
    assert (p.max_new_tokens, p.do_sample, until) == (7, False, ["\n\n", "<eos>"])
    p, _ = sampling_params({"until": [], "do_sample": True, "temperature": 0.7, "top_p": 0.9}, 32, "<eos>")
    assert (p.max_new_tokens, p.do_sample, p.temperature, p.top_p) == (32, True, 0.7, 0.9)
    with pytest.raises(ValueError, match="num_beams"):
        sampling_params({"num_beams": 4}, 32, "<eos>")


def test_command_line_help(monkeypatch, capsys):
    """`python -m hf_paged.lm_eval --help`, run as `__main__` in this process (a new interpreter would spend seconds
    importing torch, transformers and lm-eval again)."""
    monkeypatch.setattr(sys, "argv", ["python -m hf_paged.lm_eval", "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("hf_paged.lm_eval", run_name="__main__", alter_sys=False)
    assert done.value.code in (0, None) and "--model_args" in capsys.readouterr().out


@pytest.mark.slow
def test_requests_the_engine_cannot_hold_fall_back_to_hflm(plain_lm, paged_lm, monkeypatch):
    """Routing: requests failing the engine's capacity check go to HFLM's forwards; answers stay in input order."""
    context = paged_lm.tok_encode("Pick a color:")
    requests = [(("c", cont), context, paged_lm.tok_encode(cont)) for cont in (" red", " a deep blue", " green")]
    too_long = len(context) + len(requests[1][2])
    monkeypatch.setattr(HFPagedLM, "_engine_can_score", staticmethod(lambda engine, n: n != too_long))
    before = paged_lm.engine_loglikelihood_requests
    _assert_close(paged_lm._loglikelihood_tokens(requests), plain_lm._loglikelihood_tokens(requests))
    assert paged_lm.engine_loglikelihood_requests - before == 2


@pytest.mark.slow
def test_engine_capacity_check(paged_lm):
    engine = paged_lm.engine
    capacity = engine.block_manager.num_blocks * engine.block_manager.block_size
    assert HFPagedLM._engine_can_score(engine, capacity + 1)  # scoring-only: the last token is not computed
    assert not HFPagedLM._engine_can_score(engine, capacity + 2)
