"""Admission limits over real HTTP (uvicorn in a thread, a tiny random llama): a full queue answers 429 with
Retry-After, a request past its deadline is aborted with 504 (whole or streamed), a client that leaves in the middle
of a stream is aborted; every case gives every KV block back."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import hf_paged  # noqa: E402
from hf_paged.serve import build_app  # noqa: E402
from hf_paged.testing import byte_tokenizer, tiny_model  # noqa: E402

try:
    from tests.serve_helpers import ThreadedServer, wait_until
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from serve_helpers import ThreadedServer, wait_until

QUEUE, TIMEOUT = 2, 60.0


@pytest.fixture(scope="module")
def server():
    tok = byte_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok))
    # one sequence at a time: the others wait in the queue
    engine = hf_paged.Engine(model, tok, num_blocks=64, block_size=4, max_num_seqs=1)
    app = build_app(engine, model_name="tiny", max_queue_len=QUEUE, request_timeout=TIMEOUT)
    free = engine.kv_stats().free_blocks
    with ThreadedServer(app) as base:
        yield {"base": base, "engine": engine, "app": app, "free": free}


def _blocks_back(server) -> None:
    engine, limits = server["engine"], server["app"].state.limits
    wait_until(lambda: engine.kv_stats().free_blocks == server["free"] and not engine.has_unfinished()
               and limits.queued == 0, what="blocks and queue places back")


def test_overload_gets_429_with_retry_after(server):
    body = {"prompt": "hello", "max_tokens": 40, "ignore_eos": True, "temperature": 0}

    def one(_):
        return httpx.post(f"{server['base']}/v1/completions", json=body, timeout=60)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(one, range(8)))
    codes = sorted(r.status_code for r in replies)
    assert set(codes) == {200, 429} and codes.count(200) >= QUEUE, codes
    refused = next(r for r in replies if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "queue_full" and "max-queue-len" in error["message"]
    assert all(len(r.json()["choices"][0]["text"]) > 0 for r in replies if r.status_code == 200)
    _blocks_back(server)
    metrics = httpx.get(f"{server['base']}/metrics", timeout=10).text
    assert f"hf_paged_requests_refused_total {float(codes.count(429))}" in metrics


def test_timeouts_abort_whole_and_streamed_requests(server):
    body = {"prompt": "slow", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    engine = server["engine"]
    slow_step = engine.step  # each step made slow enough that 200 tokens outlive the deadline

    def step(**kwargs):
        import time

        time.sleep(0.05)
        return slow_step(**kwargs)

    engine.step = step
    server["app"].state.limits.request_timeout = 1.0  # for the requests of this test
    try:
        r = httpx.post(f"{server['base']}/v1/completions", json=body, timeout=60)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "request_timeout"
        _blocks_back(server)
        events = []
        with httpx.stream("POST", f"{server['base']}/v1/completions", json={**body, "stream": True},
                          timeout=60) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    finally:
        engine.step = slow_step
        server["app"].state.limits.request_timeout = TIMEOUT
    _blocks_back(server)
    assert server["app"].state.limits.timed_out >= 2


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"prompt": "go on", "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    engine = server["engine"]
    with httpx.stream("POST", f"{server['base']}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        assert engine.kv_stats().free_blocks < server["free"]
    _blocks_back(server)
