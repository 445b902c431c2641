"""The command-line entry points, in this process: `python -m hf_paged.lm_eval` rewrites its arguments into lm-eval's
`run` command with the hf-paged model as the default, and `python -m hf_paged.serve` is `hf-paged serve`.

(tests/test_lm_eval.py and tests/test_serve.py run them for real, in subprocesses.)
"""

from __future__ import annotations

import sys

import pytest


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--tasks", "t"], ["run", "--model", "hf-paged", "--tasks", "t"]),
        (["run", "--tasks", "t"], ["run", "--model", "hf-paged", "--tasks", "t"]),
        (["--model", "hf", "--tasks", "t"], ["run", "--model", "hf", "--tasks", "t"]),
        (["--model=hf", "--tasks", "t"], ["run", "--model=hf", "--tasks", "t"]),
        (["--help"], ["run", "--help"]),
        (["run", "-h"], ["run", "-h"]),
    ],
)
def test_lm_eval_main_defaults_to_the_hf_paged_model(monkeypatch, argv, expected):
    pytest.importorskip("lm_eval")
    import hf_paged.lm_eval as entry

    seen = []
    monkeypatch.setattr(sys, "argv", ["hf_paged.lm_eval", "ignored"])
    monkeypatch.setattr(entry, "cli_evaluate", lambda: seen.append(list(sys.argv)))
    entry.main(argv)
    assert seen == [["hf_paged.lm_eval", *expected]]


def test_lm_eval_main_reads_sys_argv_without_arguments(monkeypatch):
    pytest.importorskip("lm_eval")
    import hf_paged.lm_eval as entry

    seen = []
    monkeypatch.setattr(sys, "argv", ["hf_paged.lm_eval", "--tasks", "t"])
    monkeypatch.setattr(entry, "cli_evaluate", lambda: seen.append(list(sys.argv)))
    entry.main()
    assert seen == [["hf_paged.lm_eval", "run", "--model", "hf-paged", "--tasks", "t"]]


def test_lm_eval_help_is_lm_evals_run_help(monkeypatch, capsys):
    pytest.importorskip("lm_eval")
    import hf_paged.lm_eval as entry

    monkeypatch.setattr(sys, "argv", ["hf_paged.lm_eval"])
    with pytest.raises(SystemExit) as exit_info:
        entry.main(["--help"])
    assert exit_info.value.code == 0
    assert "--model_args" in capsys.readouterr().out


def test_python_dash_m_serve_is_the_serve_command():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import hf_paged.serve.__main__ as entry
    from hf_paged.serve import cli

    assert entry.serve_main is cli.serve_main
