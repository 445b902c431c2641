"""lm-eval's `hf-paged` backend against the plain `hf` backend, offline: two tiny custom tasks from local JSONL (a
`generate_until` task with stop sequences, a `loglikelihood` multiple-choice task) on SmolLM2-135M (CPU, float32):
the same per-sample outputs and the same metrics."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("datasets")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from hf_paged.integrations.lm_eval import HFPagedLM, sampling_params  # noqa: E402
from hf_paged.testing import smollm2_checkpoint  # noqa: E402

QA = [
    ("The capital of France is", "Paris"),
    ("Two plus two equals", "four"),
    ("The color of the sky on a clear day is", "blue"),
    ("Water freezes at zero degrees", "Celsius"),
    ("The opposite of hot is", "cold"),
]
MC = [
    ("The sun rises in the", ["east", "west", "north"], 0),
    ("A cat says", ["woof", "meow", "moo"], 1),
    ("Ice is made of frozen", ["sand", "fire", "water"], 2),
    ("One week has seven", ["days", "apples", "cars"], 0),
]

GEN_YAML = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""

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


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    gen, mc = root / "gen.jsonl", root / "mc.jsonl"
    gen.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QA))
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "label": y}) + "\n" for q, c, y in MC))
    (root / "tiny_gen.yaml").write_text(GEN_YAML.format(path=gen))
    (root / "tiny_mc.yaml").write_text(MC_YAML.format(path=mc))
    return TaskManager(include_path=str(root))


def _run(lm, task_manager):
    out = simple_evaluate(model=lm, tasks=["tiny_gen", "tiny_mc"], task_manager=task_manager, log_samples=True,
                          bootstrap_iters=0)
    samples = {task: [(s["doc_id"], s["resps"], s["filtered_resps"]) for s in rows]
               for task, rows in out["samples"].items()}
    metrics = {task: {k: v for k, v in m.items() if not k.endswith("stderr,none")}
               for task, m in out["results"].items()}
    return samples, metrics


def test_hf_paged_matches_hf_backend(task_manager):
    args = dict(pretrained=str(smollm2_checkpoint()), dtype="float32", device="cpu", batch_size=2)
    plain = _run(HFLM(**args), task_manager)
    lm = HFPagedLM(**args, num_blocks=64, block_size=16)
    paged = _run(lm, task_manager)
    assert paged == plain
    answers = [r[0] for _, r, _ in paged[0]["tiny_gen"]]
    assert any(answers) and not any("\n" in a or "." in a for a in answers)  # generated, cut at the stops
    assert lm.engine.kv_stats().used_blocks == 0


def test_sampling_params_from_gen_kwargs():
    p, until = sampling_params({"until": ["\n\n"], "max_gen_toks": 7, "temperature": 0.0}, 256, "<eos>")
    assert (p.max_new_tokens, p.do_sample, until) == (7, False, ["\n\n", "<eos>"])
    p, _ = sampling_params({"until": [], "do_sample": True, "temperature": 0.7, "top_p": 0.9}, 32, "<eos>")
    assert (p.max_new_tokens, p.do_sample, p.temperature, p.top_p) == (32, True, 0.7, 0.9)
    with pytest.raises(ValueError, match="num_beams"):
        sampling_params({"num_beams": 4}, 32, "<eos>")


def test_command_line_help():
    run = subprocess.run([sys.executable, "-m", "hf_paged.lm_eval", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "--model_args" in run.stdout
