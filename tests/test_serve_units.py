"""The server in process (httpx ASGITransport) on a tiny random llama with a byte-level tokenizer: request
validation (400 JSON errors), stop-string truncation and hold-back, logprobs, n, streaming, auth, metrics."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged.serve import build_app  # noqa: E402
from hf_paged.serve.stops import TextTracker, fast_decode, find_stop, held_back  # noqa: E402
from hf_paged.testing import byte_tokenizer, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def served():
    tok = byte_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok))
    engine = hf_paged.Engine(model, tok, num_blocks=24, block_size=4, max_num_seqs=8)
    app = build_app(engine, model_name="tiny", api_key="sekret")
    yield app, engine, tok
    app.state.bridge.shutdown(0)


def call(app, method, path, body=None, *, key="sekret", raw=None):
    async def go():
        transport = httpx.ASGITransport(app=app)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            if raw is not None:
                headers["content-type"] = "application/json"
                return await client.request(method, path, content=raw, headers=headers)
            return await client.request(method, path, json=body, headers=headers)

    return asyncio.run(go())


def test_stop_string_helpers():
    assert find_stop("hello world", ["wor", "lo"]) == 3
    assert find_stop("hello", ["x"]) is None
    assert held_back("abc wo", ["world"]) == 2  # "wo" may become "world"
    assert held_back("abc", ["world"]) == 0
    assert held_back("ab\ufffd", []) == 1


class _CharTok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_text_tracker_holds_back_and_truncates():
    t = TextTracker(_CharTok(), ["END"])
    assert t.update([ord(c) for c in "ab"], False) == "ab"
    assert t.update([ord(c) for c in "abxE"], False) == "x"  # "E" held back
    assert t.update([ord(c) for c in "abxEN"], False) == ""
    assert t.update([ord(c) for c in "abxENDzz"], False) == ""  # the stop string and what follows are dropped
    assert t.stopped and t.sent == "abx"
    t2 = TextTracker(_CharTok(), ["END"])
    assert t2.update([ord(c) for c in "abE"], True) == "abE"  # finished: nothing is held back


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece-style pieces ("\u2581" marks a space; a decode drops the leading one), as Llama / Mistral's."""
    pieces = ["<pad>", "<s>", "</s>"] + [p + c for c in "abcEND\u00e9" for p in ("", "\u2581")]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[]))
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("make", [byte_tokenizer, metaspace_tokenizer])
@pytest.mark.parametrize("stops", [[], ["END"], ["\u00e9a"]])
def test_incremental_text_equals_the_full_decode(make, stops):
    """The deltas, token by token (and in uneven chunks), add up to the full decode cut at the first stop string;
    nothing sent is ever taken back (random bytes: ByteLevel splits multi-byte characters across tokens)."""
    import random

    tok = make()
    rng = random.Random(len(stops))
    for trial in range(30):
        ids = [rng.randrange(3, len(tok)) for _ in range(rng.randrange(1, 40))]
        full = tok.decode(ids, skip_special_tokens=True)
        cut = find_stop(full, stops) if stops else None
        expected = full if cut is None else full[:cut]
        tracker, sent, n = TextTracker(tok, stops), "", 0
        while n < len(ids):
            n = min(len(ids), n + rng.choice((1, 1, 1, 2, 5)))
            delta = tracker.update(ids[:n], n == len(ids))
            sent += delta
            assert expected.startswith(sent), (trial, ids, n)  # nothing sent is ever taken back
        assert sent == expected, (trial, ids)
        assert tracker.stopped == (cut is not None)


def test_fast_decode_equals_transformers_decode_or_stands_aside():
    """The Rust decode the text tracker uses is transformers' `decode(ids, skip_special_tokens=True)`, special ids
    included; a tokenizer whose decode does more (the clean-up of tokenization spaces, an override) keeps its own."""
    import random

    for make in (byte_tokenizer, metaspace_tokenizer):
        tok = make()
        decode = fast_decode(tok)
        rng = random.Random(0)
        for _ in range(20):
            ids = [rng.randrange(0, len(tok)) for _ in range(rng.randrange(0, 12))]
            assert decode(ids) == tok.decode(ids, skip_special_tokens=True), ids
    tok = metaspace_tokenizer()
    tok.clean_up_tokenization_spaces = True
    assert fast_decode(tok) is None

    class Custom(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs):
            return "x"

    custom = Custom(tokenizer_object=metaspace_tokenizer()._tokenizer, pad_token="<pad>")
    assert fast_decode(custom) is None
    assert fast_decode(_CharTok()) is None


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "n": 99}, "n"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "hi", "frequency_penalty": 1.0}, "frequency_penalty"),
    ({"prompt": "hi", "logprobs": 9}, "logprobs"),
    ({"prompt": "hi", "bogus": 1}, "bogus"),
    ({"prompt": []}, "prompt"),
    ({}, "prompt"),
])
def test_bad_completion_requests(served, body, param):
    app, _, _ = served
    r = call(app, "POST", "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"].startswith(param) and err["message"]


def test_malformed_json_auth_and_model(served):
    app, engine, _ = served
    r = call(app, "POST", "/v1/completions", raw=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert call(app, "GET", "/v1/models", key=None).status_code == 401
    assert call(app, "GET", "/v1/models", key="wrong").status_code == 401
    assert call(app, "GET", "/v1/models").json()["data"][0]["id"] == "tiny"
    assert call(app, "GET", "/health", key=None).json() == {"status": "ok"}
    r = call(app, "POST", "/v1/completions", {"prompt": "hi", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    too_long = "x" * (engine.block_manager.num_blocks * 4 + 1)
    r = call(app, "POST", "/v1/completions", {"prompt": too_long, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = call(app, "POST", "/v1/completions", {"prompt": [10**6], "max_tokens": 2})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    r = call(app, "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")


def test_greedy_completion_matches_engine_and_stop_truncates(served):
    app, engine, tok = served
    r = call(app, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tok("hello")["input_ids"]
    ref = hf_paged.Engine(engine.model, tok, num_blocks=24, block_size=4).generate([ids], max_new_tokens=12)[0]
    ref_text = tok.decode(ref.outputs[0].token_ids, skip_special_tokens=True)
    assert body["choices"][0]["text"] == ref_text
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == len(ref.outputs[0].token_ids)
    # stop on a piece of the greedy text: output truncated right before it, finish_reason "stop"
    stop = ref_text[3:5]
    assert stop and ref_text.find(stop) >= 1
    r = call(app, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 12, "temperature": 0,
                                                  "stop": stop})
    choice = r.json()["choices"][0]
    assert choice["text"] == ref_text[: ref_text.find(stop)] and choice["finish_reason"] == "stop"


def test_stream_n_logprobs_and_metrics(served):
    app, engine, _ = served
    body = {"prompt": "abc", "max_tokens": 5, "temperature": 0.8, "seed": 3, "n": 2, "stream": True, "logprobs": 2,
            "stream_options": {"include_usage": True}}
    r = call(app, "POST", "/v1/completions", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts, finish, lps = {0: "", 1: ""}, {}, {0: [], 1: []}
    for c in chunks[:-1]:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["text"]
            lps[ch["index"]] += ch["logprobs"]["token_logprobs"]
            assert all(len(top) <= 2 for top in ch["logprobs"]["top_logprobs"])
            finish[ch["index"]] = ch["finish_reason"] or finish.get(ch["index"])
    assert chunks[-1]["usage"]["completion_tokens"] == 10 and chunks[-1]["choices"] == []
    assert finish == {0: "length", 1: "length"} and len(lps[0]) == len(lps[1]) == 5
    assert all(lp <= 0 for lp in lps[0] + lps[1])
    whole = call(app, "POST", "/v1/completions", {**body, "stream": False, "stream_options": None}).json()
    assert [c["text"] for c in whole["choices"]] == [texts[0], texts[1]]  # seeded: the same samples
    metrics = call(app, "GET", "/metrics", key=None).text
    assert "hf_paged_time_to_first_token_seconds_count" in metrics
    assert "hf_paged_kv_blocks_used 0.0" in metrics  # everything finished: no block held
    assert "hf_paged_num_requests_queued 0.0" in metrics and "hf_paged_requests_refused_total 0.0" in metrics


def test_chat_logprobs(served):
    app, _, _ = served
    r = call(app, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                   "temperature": 0, "logprobs": True, "top_logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["role"] == "assistant" and len(choice["logprobs"]["content"]) == 3
    assert all(len(e["top_logprobs"]) == 1 for e in choice["logprobs"]["content"])


def test_cli_passes_the_admission_options(monkeypatch):
    from hf_paged.serve import cli

    seen = {}

    class Stop(Exception):
        pass

    def engine(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(cli, "load", lambda args: (tiny_model("llama"), None))
    monkeypatch.setattr(cli, "Engine", engine)
    for argv, expected in ((["m", "--admission-batch", "8", "--admission-max-wait", "4"], (8, 4)),
                           (["m", "--device", "cpu"], (None, 16))):
        with pytest.raises(Stop):
            cli.serve_main(argv)
        assert (seen["admission_batch"], seen["admission_max_wait"]) == expected


def test_cli_records_the_prefill_graphs_at_start_up_unless_told_not_to(monkeypatch):
    """`hf-paged serve` warms its engine up with `prefill_graphs=True` (a fresh server's first prompts then pay no
    recording); `--no-prefill-graphs` leaves them to serving."""
    from hf_paged.serve import cli

    seen = []

    class Stop(Exception):
        pass

    class Warmed:
        device = torch.device("cuda")  # the CLI warms up on CUDA only

        def __init__(self, *args, **kwargs):
            pass

        def warm_up(self, **kwargs):
            seen.append(kwargs)

    def app(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(cli, "load", lambda args: (tiny_model("llama"), None))
    monkeypatch.setattr(cli, "Engine", Warmed)
    monkeypatch.setattr(cli, "build_app", app)
    for argv in (["m"], ["m", "--no-prefill-graphs"]):
        with pytest.raises(Stop):
            cli.serve_main(argv)
    assert seen == [{"prefill_graphs": True}, {"prefill_graphs": False}]


def test_console_script_prints_its_usage_and_refuses_unknown_commands(monkeypatch, capsys):
    """`hf-paged --help` exits 0 with the usage on stdout (the wheel check in CI runs it from an installed wheel);
    no command or an unknown one exits 2 with the usage on stderr; `serve` hands the rest to `serve_main`."""
    from hf_paged.serve import cli

    for flag in ("--help", "-h"):
        assert cli.main([flag]) == 0
        out, err = capsys.readouterr()
        assert out.startswith("usage: hf-paged serve MODEL") and not err
    for argv in ([], ["generate", "m"]):
        assert cli.main(argv) == 2
        out, err = capsys.readouterr()
        assert err.startswith("usage: hf-paged serve MODEL") and not out
    monkeypatch.setattr(cli, "serve_main", lambda argv: ("served", argv))
    assert cli.main(["serve", "m", "--port", "9"]) == ("served", ["m", "--port", "9"])


def test_echo_streamed_and_scoring_only(served):
    """echo in a stream: the first chunk of each choice starts with the prompt (and its logprob entries, the first
    one null); max_tokens=0 only scores; prompt_logprobs without echo; the same scores as the whole response."""
    app, engine, tok = served
    body = {"prompt": "abcd", "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1, "stream": True}
    r = call(app, "POST", "/v1/completions", body)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    entries = [lp for c in chunks for lp in c["choices"][0]["logprobs"]["token_logprobs"]]
    whole = call(app, "POST", "/v1/completions", {**body, "stream": False}).json()["choices"][0]
    assert text == whole["text"] and text.startswith("abcd") and len(text) > 4
    assert entries == whole["logprobs"]["token_logprobs"] and entries[0] is None and len(entries) == 4 + 3
    scored = call(app, "POST", "/v1/completions", {"prompt": "abcd", "max_tokens": 0, "echo": True, "logprobs": 2,
                                                  "prompt_logprobs": 1}).json()["choices"][0]
    assert scored["text"] == "abcd" and scored["finish_reason"] == "length"
    assert scored["logprobs"]["token_logprobs"][0] is None  # (a prefill of 3 tokens, not 4: float noise only)
    assert scored["logprobs"]["token_logprobs"][1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:4], abs=1e-5)
    assert scored["prompt_logprobs"][0] is None and len(scored["prompt_logprobs"]) == 4
    ids = tok("abcd")["input_ids"]
    for entry, token, lp in zip(scored["prompt_logprobs"][1:], ids[1:], scored["logprobs"]["token_logprobs"][1:]):
        assert entry[str(token)]["logprob"] == lp
    r = call(app, "POST", "/v1/completions", {"prompt": "abcd", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert engine.kv_stats().used_blocks == 0
