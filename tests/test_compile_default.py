"""`compile_decode=None` (the default): compiled on CUDA with CUDA graphs, nowhere else; an automatic compilation
that fails falls back to the model's own code with a warning, an explicit one does not."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.engine.engine import default_compile_decode
from hf_paged.testing import tiny_model

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize(("device", "graphs", "modules", "expected"), [
    (CUDA, None, False, True),  # one process or tensor parallel alike
    (CUDA, True, False, True),
    (CUDA, False, False, False),  # no graphs: the debugging setting
    (CUDA, None, True, False),  # compile_modules
    (CPU, None, False, False),
])
def test_default_compile_decode(device, graphs, modules, expected):
    assert default_compile_decode(device, graphs, modules) is expected


def test_cpu_engine_does_not_compile_by_default_and_checks_the_type():
    model = tiny_model("llama")
    engine = hf_paged.Engine(model, num_blocks=32, block_size=16)
    assert engine.runner.compile_decode is False and engine.runner.decode_mode == "eager"
    engine.close()
    with pytest.raises(TypeError, match="compile_decode"):
        hf_paged.Engine(model, num_blocks=32, block_size=16, compile_decode="yes")


def _prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 250, (int(n),), generator=gen).tolist() for n in torch.randint(3, 30, (5,), generator=gen)]


def _failing_compile(*_args, **_kwargs):
    raise RuntimeError("Dynamo cannot trace this module")


def test_failed_automatic_compile_falls_back_to_the_models_code(monkeypatch):
    model = tiny_model("llama", seed=2)
    reference = hf_paged.Engine(model, num_blocks=64, block_size=16, max_num_seqs=8, compile_decode=False)
    expected = [o.outputs[0].token_ids for o in reference.generate(_prompts(), max_new_tokens=8, ignore_eos=True)]
    reference.close()
    # what `compile_decode=None` builds on CUDA, on the CPU's static path: compiled, chosen automatically
    engine = hf_paged.Engine(model, num_blocks=64, block_size=16, max_num_seqs=8, compile_decode=True)
    engine.runner.compile_auto = True
    monkeypatch.setattr(engine.runner, "_call_compiled", _failing_compile)
    with pytest.warns(RuntimeWarning, match="could not be compiled"):
        outs = engine.generate(_prompts(), max_new_tokens=8, ignore_eos=True)
    assert all(o.error is None for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == expected
    runner = engine.runner
    assert not runner.compile_decode and not runner.compile_prefill and not engine.cache._defer_write
    assert "Dynamo cannot trace" in runner.compile_failure and runner.graph_steps > 0
    engine.close()


def test_failed_explicit_compile_is_not_hidden(monkeypatch):
    model = tiny_model("llama", seed=2)
    engine = hf_paged.Engine(model, num_blocks=64, block_size=16, max_num_seqs=8, compile_decode=True)
    monkeypatch.setattr(engine.runner, "_call_compiled", _failing_compile)
    outs = engine.generate(_prompts(), max_new_tokens=8, ignore_eos=True)
    assert all(isinstance(o.error, RuntimeError) for o in outs)  # a failing step fails its requests, as documented
    assert engine.runner.compile_decode and engine.runner.compile_failure is None
    engine.close()
