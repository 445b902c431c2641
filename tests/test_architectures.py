"""The architecture sweep: every causal LM of transformers through hf-paged (issue 15).

For each `model_type` of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, `hf_paged.model_zoo.check_architecture` builds a tiny
seeded model (float32), runs transformers' own greedy `generate()` on a left-padded batch of 2, and then either
- the gate accepts it and the greedy tokens of `generate(cache_implementation="paged")` and of the drop-in
  `PagedCache` equal transformers' (`pass`), or
- `hf_paged.enable` refuses it with a ValueError naming every feature outside `HANDLED_FEATURES` (`refused`), or
- transformers itself cannot run the tiny model (`not_runnable`, listed with the reason in docs/architectures.json).
Anything else (a crash, different tokens, an unhandled feature seen at run time that the gate let through, a refusal
that does not name the feature) fails. The gate reads `HANDLED_FEATURES`, so adding a kernel feature there is all the
sweep needs; then `python benchmarks/probe_architectures.py` regenerates the JSON and the docs that the last tests
compare with.

One process, all architectures once (about a minute on 2 CPU cores), each under a 60 s guard against hangs.
"""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers

from hf_paged.attention.support import FEATURES, HANDLED_FEATURES
from hf_paged.model_zoo import ARCHITECTURES, check_architecture

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
architecture_report = pytest.importorskip("architecture_report")

# the sweep runs once per process (`_records`), for every test of the file: the file runs on one worker
pytestmark = pytest.mark.xdist_group("architectures")

# plain except for MoE MLPs / norms / biases / positions: accepted with today's kernels
MUST_PASS = ("llama", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "olmo2", "cohere", "gpt_neox",
             "phi", "smollm3", "starcoder2", "qwen2", "qwen3", "phi3", "gemma", "opt", "gpt2", "granite")
# families that compute attention themselves, routed by a per-family adapter (issue 54: hf_paged.attention.adapters),
# and ModernBERT-decoder (interface-routed; its LM head is called `decoder`, which the gate once took for the stack)
ADAPTED = ("falcon", "gptj", "gpt_neo", "codegen", "jetmoe", "bloom", "mpt", "xglm", "gpt_neox_japanese", "moshi",
           "modernbert-decoder")
# multi-head latent attention (issue 54): the latent in the pool, attention absorbed (hf_paged.attention.adapters.mla)
MLA = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3", "youtu", "longcat_flash", "axk1")
# learned sparse attention: the indexer's keys in the pool, each query's selection attended (DeepSeek Sparse
# Attention over the latent: hf_paged.attention.adapters.dsa)
SPARSE = ("deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2",
          "qwen4_exp", "qwen4_exp_text")  # (Qwen4-Exp's block-pooled selection: hf_paged.attention.adapters.qsa)
# latent-attention families no adapter takes: Kimi-Linear's recurrent layers
MLA_REFUSED = {"kimi_linear": "latent_kv"}
# hybrid models (recurrent layers beside attention, issue 53): their states in slots, every one of these passes
HYBRID = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "granitemoehybrid", "falcon_h1",
          "lfm2", "lfm2_moe", "jamba", "bamba", "olmo_hybrid", "mamba", "falcon_mamba", "zaya", "zamba", "minimax",
          "recurrent_gemma")
# attention modules that write cache layers other than their own layer_idx (Zamba's shared block, HRM's cycles)
CACHE_LAYER_INDEX = ("zamba", "hrm_text")
# image cross-attention layers a text-only run skips (Mllama's text model): no K/V for them, images refused
TEXT_ONLY_CROSS_ATTENTION = ("mllama",)
# Gemma 4's unified models: bidirectional over image tokens only (`use_bidirectional_attention="vision"`), causal text
VISION_ONLY_BIDIRECTIONAL = ("gemma4_unified", "gemma4_unified_text")
# recurrent models that stay refused, each naming what blocks it (docs/models.md says why)
RECURRENT_REFUSED = {"rwkv": "unslotted_state", "kimi_linear": "latent_kv", "inkling_text": "unknown_attention_kwargs"}


@functools.cache
def _records() -> dict[str, dict]:
    warnings.filterwarnings("ignore")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with torch.random.fork_rng():
            return {arch: check_architecture(arch, timeout_s=60) for arch in ARCHITECTURES}
    finally:
        transformers.logging.set_verbosity(verbosity)


@functools.cache
def _recorded() -> dict:
    return architecture_report.load()


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.slow
def test_architecture(arch):
    record = _records()[arch]
    verdict = record["verdict"]
    assert verdict in ("pass", "refused", "not_runnable"), f"{arch}: {verdict}: {record['reason']}"
    if verdict == "refused":
        assert record["unhandled"] and set(record["unhandled"]) <= set(FEATURES)
        assert not set(record["unhandled"]) & HANDLED_FEATURES
        for feature in record["features"]:
            if feature not in HANDLED_FEATURES:
                assert feature in record["reason"], (arch, feature, record["reason"])
    if verdict == "pass":
        assert record["runs_under_transformers"] and record["interface_routed"], arch
        assert not record["unhandled"], arch
    if verdict == "not_runnable":
        assert record["reason"], f"{arch} is not runnable without a reason"


@pytest.mark.slow
def test_plain_attention_families_pass():
    failing = {a: _records()[a]["reason"] for a in MUST_PASS if _records()[a]["verdict"] != "pass"}
    assert not failing


@pytest.mark.slow
def test_adapted_families_pass():
    failing = {a: _records()[a]["reason"] for a in ADAPTED if _records()[a]["verdict"] != "pass"}
    assert not failing
    adapted = [a for a in ADAPTED if "attention_adapter" in _records()[a]["features"]]
    assert adapted == list(ADAPTED[:-1])
    assert all("alibi" in _records()[a]["observed"] for a in ("bloom", "mpt"))  # the slopes reached the kernels


@pytest.mark.slow
def test_latent_attention_families_pass_and_the_others_are_refused():
    failing = {a: _records()[a]["reason"] for a in MLA if _records()[a]["verdict"] != "pass"}
    assert not failing
    for arch in MLA:  # routed by the adapter, K/V as the pool returned them, of one width (the latent)
        record = _records()[arch]
        assert "attention_adapter" in record["features"] and record["interface_routed"], arch
        assert "value_head_dim" not in record["observed"], arch
    for arch, feature in MLA_REFUSED.items():
        record = _records()[arch]
        assert record["verdict"] == "refused" and feature in record["unhandled"], (arch, record)


@pytest.mark.slow
def test_sparse_attention_families_pass():
    failing = {a: _records()[a]["reason"] for a in SPARSE if _records()[a]["verdict"] != "pass"}
    assert not failing
    for arch in SPARSE:  # routed by the adapter, which handles the indexer, the latent and its value width
        record = _records()[arch]
        assert "attention_adapter" in record["features"] and record["interface_routed"], arch
        assert not {"sparse_attention", "latent_kv", "value_head_dim"} & set(record["features"]), arch


@pytest.mark.slow
def test_hybrid_models_pass():
    failing = {a: _records()[a]["reason"] for a in HYBRID if _records()[a]["verdict"] != "pass"}
    assert not failing
    assert all("recurrent_state" in _records()[a]["features"] for a in HYBRID)


@pytest.mark.slow
def test_modules_writing_other_cache_layers_pass():
    failing = {a: _records()[a]["reason"] for a in CACHE_LAYER_INDEX if _records()[a]["verdict"] != "pass"}
    assert not failing
    assert all("cache_layer_index" in _records()[a]["features"] for a in CACHE_LAYER_INDEX)


@pytest.mark.slow
def test_models_bidirectional_over_images_only_pass_as_text_models():
    failing = {a: _records()[a]["reason"] for a in VISION_ONLY_BIDIRECTIONAL if _records()[a]["verdict"] != "pass"}
    assert not failing


@pytest.mark.slow
def test_text_only_cross_attention_models_pass():
    failing = {a: _records()[a]["reason"] for a in TEXT_ONLY_CROSS_ATTENTION if _records()[a]["verdict"] != "pass"}
    assert not failing
    assert all("text_only_cross_attention" in _records()[a]["features"] for a in TEXT_ONLY_CROSS_ATTENTION)


@pytest.mark.slow
def test_other_recurrent_models_are_refused_naming_what_blocks_them():
    for arch, feature in RECURRENT_REFUSED.items():
        record = _records()[arch]
        assert record["verdict"] == "refused" and feature in record["unhandled"], (arch, record)


@pytest.mark.slow
def test_sweep_matches_docs_architectures_json():
    """docs/architectures.json is this sweep's output (regenerate: python benchmarks/probe_architectures.py)."""
    recorded = _recorded()
    assert recorded["handled_features"] == sorted(HANDLED_FEATURES), "HANDLED_FEATURES changed: regenerate the docs"
    assert recorded["transformers_version"] == transformers.__version__
    saved = {r["model_type"]: r for r in recorded["architectures"]}
    assert list(saved) == list(ARCHITECTURES)
    keys = ("verdict", "runs_under_transformers", "interface_routed", "unhandled", "features")
    stale = {a: {k: (saved[a][k], r[k]) for k in keys if saved[a][k] != r[k]} for a, r in _records().items()}
    assert not {a: d for a, d in stale.items() if d}


def test_docs_are_rendered_from_the_json():
    for path, text in architecture_report.rendered_files(_recorded()).items():
        assert path.read_text() == text, f"{path.name} is stale: python benchmarks/architecture_report.py"


def test_report_summary_counts():
    summary = architecture_report.summary(_recorded())
    assert summary["architectures"] == len(ARCHITECTURES)
    assert summary["pass"] + summary["refused"] + summary["not_runnable"] + summary["failures"] == len(ARCHITECTURES)
    assert summary["failures"] == 0
    assert summary["pass"] <= summary["would_pass_with_kernel_features"] <= summary["runs_under_transformers"]
