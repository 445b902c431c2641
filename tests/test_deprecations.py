"""The warning policy of pyproject.toml's `filterwarnings`: a deprecation of our own calls fails the test run.

transformers announces a renamed or removed argument with `transformers.utils.deprecation.deprecate_kwarg`, which
raises a FutureWarning at the caller's frame. These tests check that such a warning is an error when the call comes
from hf_paged or a test, or when transformers passes on an argument of ours, and that third-party deprecations
inside other packages' own code are not.
"""

from __future__ import annotations

import warnings

import pytest
from transformers.utils.deprecation import deprecate_kwarg


@deprecate_kwarg("old_size", new_name="size", version="99.0")
def _resize(size: int = 0) -> int:
    return size


def _warn_from(module: str, message: str, category: type[Warning]) -> None:
    """Raise `message` as if the code of `module` had made the deprecated call (the filters match that module)."""
    warnings.warn_explicit(message, category, filename=f"{module.replace('.', '/')}.py", lineno=1, module=module)


def test_a_deprecated_argument_in_our_call_fails_the_run():
    assert _resize(size=3) == 3  # the new name: no warning
    with pytest.raises(FutureWarning, match="`old_size` is deprecated and will be removed in version 99.0"):
        _resize(old_size=3)


@pytest.mark.parametrize("module", ["hf_paged.engine.engine", "hf_paged.integrations.generate", "test_cache",
                                    "bench_generate"])
@pytest.mark.parametrize("category", [FutureWarning, DeprecationWarning])
def test_deprecations_raised_at_our_modules_are_errors(module, category):
    with pytest.raises(category):
        _warn_from(module, "`x` is deprecated", category)


def test_transformers_passing_on_a_deprecated_argument_is_an_error():
    message = "`past_key_values` is deprecated and will be removed in version 99.0 for `LlamaForCausalLM.forward`."
    with pytest.raises(FutureWarning):
        _warn_from("transformers.generation.utils", message, FutureWarning)


@pytest.mark.parametrize(("module", "category"), [("lm_eval.models.huggingface", FutureWarning),
                                                  ("trl.trainer.grpo_trainer", DeprecationWarning),
                                                  ("torch.jit._script", DeprecationWarning)])
def test_third_party_deprecations_in_their_own_code_do_not_fail_the_run(module, category):
    with warnings.catch_warnings(record=True) as caught:  # keeps the configured filters (pytest's recwarn would not)
        _warn_from(module, "`y` is deprecated and will be removed in version 99.0", category)
    assert [w.category for w in caught] == [category]
