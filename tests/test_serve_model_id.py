"""`hf-paged serve ORG/NAME` resolves a Hub model id through `from_pretrained` and the local Hugging Face cache,
offline: a fake cache (models--org--name/snapshots/<hash>/ with a tiny seeded model and its tokenizer) in a temp
dir, the Hub cache pointing there. A missing id is a one-line error (SystemExit), not a traceback."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from hf_paged.testing import byte_tokenizer, tiny_model  # noqa: E402

try:
    from tests.serve_helpers import ThreadedServer
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from serve_helpers import ThreadedServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _fake_cache(root) -> None:
    repo = root / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / COMMIT
    tok = byte_tokenizer()
    tiny_model("llama", vocab_size=len(tok)).save_pretrained(snapshot)
    tok.save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """The fake cache as the Hugging Face cache, offline (read at call time by huggingface_hub and transformers, as
    the HF_HUB_CACHE / HF_HUB_OFFLINE environment variables set it in a fresh process)."""
    from huggingface_hub import constants

    _fake_cache(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path


def test_model_id_from_the_local_cache_resolves_and_serves(hub_cache):
    from hf_paged import Engine
    from hf_paged.serve import build_app
    from hf_paged.serve.cli import load, parser

    args = parser().parse_args(["tiny-org/tiny-llama", "--device", "cpu"])
    model, tok = load(args)
    assert model.name_or_path == "tiny-org/tiny-llama" and model.config.num_hidden_layers == 2
    engine = Engine(model, tok, num_blocks=32, block_size=4)
    app = build_app(engine, tok, model_name=args.model)
    with ThreadedServer(app) as base:
        assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == ["tiny-org/tiny-llama"]
        r = httpx.post(f"{base}/v1/completions", json={"model": "tiny-org/tiny-llama", "prompt": "hi",
                                                        "max_tokens": 3, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_missing_model_id_is_a_clear_error(hub_cache, capsys):
    from hf_paged.serve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "tiny-org/absent-model", "--device", "cpu"])
    message = str(exit_info.value.code)
    assert "cannot load 'tiny-org/absent-model'" in message and str(hub_cache) in message and "offline" in message
    assert "\n" not in message  # one line: what was asked, where it was looked for, why it failed
