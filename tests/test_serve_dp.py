"""Data-parallel serving (`hf-paged serve --data-parallel-size N`): two CPU replica processes of a tiny seeded model
behind one HTTP front, spoken to with the `openai` client and raw HTTP. One router for the module (its replicas take
most of the file's time to start); the tests run in order (the replica-death test restarts one)."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import hf_paged  # noqa: E402
from hf_paged.engine import CompletionOutput, RequestOutput  # noqa: E402
from hf_paged.serve import build_app  # noqa: E402
from hf_paged.serve.affinity import AffinityPolicy, prefix_hashes  # noqa: E402
from hf_paged.serve.cli import engine_process, parser, replica_devices, serve_main  # noqa: E402
from hf_paged.serve.replica import ReplicaSpec, bind_device, encode  # noqa: E402
from hf_paged.serve.router import ReplicaRouter, _Pending  # noqa: E402

try:
    from tests.serve_helpers import ThreadedServer, broken_replica, free_port, tiny_replica, wait_until
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from serve_helpers import ThreadedServer, broken_replica, free_port, tiny_replica, wait_until

pytestmark = pytest.mark.xdist_group("serve_dp")

ENGINE = dict(num_blocks=64, block_size=4, max_num_seqs=4)
REPLICA = "x-hf-paged-replica"


@pytest.fixture(scope="module")
def server():
    router = ReplicaRouter(ReplicaSpec(tiny_replica, ENGINE, threads=1), ["cpu", "cpu"], imbalance=2).start()
    app = build_app(router, model_name="tiny", request_timeout=60.0)
    model, tok = tiny_replica("cpu")
    reference = hf_paged.Engine(model, tok, **ENGINE)  # what one engine answers, to compare the replicas with
    with ThreadedServer(app) as base:
        yield {"base": base, "router": router, "reference": reference, "tok": tok, "app": app,
               "client": openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)}
    router.shutdown(1)


def _greedy(server, prompt: str, n: int) -> str:
    ids = server["tok"](prompt)["input_ids"]
    out = server["reference"].generate([ids], max_new_tokens=n, ignore_eos=True)[0]
    return server["tok"].decode(out.outputs[0].token_ids)


def _health(server) -> dict:
    return httpx.get(f"{server['base']}/health", timeout=10).json()


def _idle(server) -> None:
    wait_until(lambda: server["router"].num_pending == 0 and all(
        r["pending"] == 0 for r in _health(server)["replicas"]), what="no request in flight")


def test_completions_and_chat_land_on_both_replicas(server):
    client, seen = server["client"], set()
    for i in range(4):
        prompt = f"request {i} of the test: {'xyz' * i}"
        raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=6,
                                                          temperature=0, extra_body={"ignore_eos": True})
        seen.add(raw.headers[REPLICA])
        assert raw.parse().choices[0].text == _greedy(server, prompt, 6)  # the deltas rebuilt exactly
    raw = client.chat.completions.with_raw_response.create(model="tiny", max_tokens=5, temperature=0,
                                                           messages=[{"role": "user", "content": "hi there"}])
    seen.add(raw.headers[REPLICA])
    assert raw.parse().usage.completion_tokens >= 1
    assert seen == {"0", "1"}


def test_streaming_flows_token_by_token(server):
    prompt = "stream this please"
    stream = server["client"].completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
    texts = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len(texts) > 1 and "".join(texts) == _greedy(server, prompt, 12)
    chat = server["client"].chat.completions.create(model="tiny", max_tokens=6, temperature=0, stream=True,
                                                    messages=[{"role": "user", "content": "stream"}])
    assert sum(1 for chunk in chat if chunk.choices and chunk.choices[0].delta.content) >= 1


def test_prefix_affinity_and_affinity_header(server):
    client = server["client"]
    prefix = "a long shared system prompt that spans many blocks of the cache. " * 2

    def replica(prompt: str, **kwargs) -> str:
        raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=2,
                                                          temperature=0, **kwargs)
        return raw.headers[REPLICA]

    first = replica(prefix + "question one")
    assert all(replica(prefix + f"question {w}") == first for w in ("two", "three", "four"))
    keyed = {replica(f"unrelated {i}", extra_headers={"X-HF-Paged-Affinity": "conversation-7"}) for i in range(4)}
    assert len(keyed) == 1
    router = server["router"].policy
    assert router.prefix_hits >= 3 and router.key_hits >= 3


def test_metrics_aggregate_the_replicas(server):
    text = httpx.get(f"{server['base']}/metrics", timeout=10).text
    assert re.search(r"^hf_paged_kv_blocks_total 128\.0$", text, re.M)  # 64 blocks in each of two replicas
    for i in (0, 1):
        assert f'hf_paged_replica_up{{replica="{i}"}} 1.0' in text
        routed = re.search(rf'^hf_paged_replica_requests_routed_total{{replica="{i}"}} (\S+)$', text, re.M)
        assert float(routed.group(1)) >= 1
    assert re.search(r"^hf_paged_requests_total\{finish_reason=\"length\"\} \d", text, re.M)
    assert re.search(r"^hf_paged_router_prefix_hits_total [1-9]", text, re.M)
    health = _health(server)
    assert health["status"] == "ok" and [r["state"] for r in health["replicas"]] == ["ready", "ready"]


def test_client_disconnect_frees_the_replica(server):
    body = {"model": "tiny", "prompt": "go on and on", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server['base']}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one token seen: hang up
    _idle(server)
    text = httpx.get(f"{server['base']}/metrics", timeout=10).text
    # the replica's engine dropped it (its blocks went back): nothing runs or waits there
    assert re.search(r"^hf_paged_num_requests_running 0\.0$", text, re.M)
    assert re.search(r"^hf_paged_num_requests_waiting 0\.0$", text, re.M)


def test_logprobs_echo_and_samples_cross_the_process_boundary(server):
    reply = server["client"].completions.create(model="tiny", prompt="score me", max_tokens=5, temperature=0,
                                                logprobs=2, echo=True, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.text == "score me" + _greedy(server, "score me", 5)
    generated = choice.logprobs.tokens[-5:]
    assert len(choice.logprobs.token_logprobs) == len("score me") + 5 and len(generated) == 5
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs[-5:])
    samples = server["client"].completions.create(model="tiny", prompt="sample", max_tokens=4, temperature=1.0,
                                                  n=3, seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in samples.choices) == [0, 1, 2] and samples.usage.completion_tokens == 12


def test_request_timeout_and_queue_bound_hold_across_the_front(server):
    limits = server["app"].state.limits
    body = {"model": "tiny", "prompt": "take your time", "max_tokens": 240, "ignore_eos": True}
    limits.request_timeout = 0.05  # the next tickets' deadline: far less than 240 steps take
    try:
        reply = httpx.post(f"{server['base']}/v1/completions", json=body, timeout=60)
    finally:
        limits.request_timeout = 60.0
    assert reply.status_code == 504 and reply.json()["error"]["code"] == "request_timeout"
    _idle(server)  # the abort reached the replica: nothing of it runs there
    text = httpx.get(f"{server['base']}/metrics", timeout=10).text
    assert re.search(r"^hf_paged_num_requests_running 0\.0$", text, re.M)
    limits.max_queue_len, limits.queued = 1, 1  # as if one request waited for its first token somewhere
    try:
        refused = httpx.post(f"{server['base']}/v1/completions", json={**body, "max_tokens": 2}, timeout=30)
    finally:
        limits.max_queue_len, limits.queued = None, 0
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"


def test_structured_outputs_through_the_replicas(server):
    pytest.importorskip("xgrammar")
    for _ in range(2):  # both replicas (in turn when idle) compile and enforce it
        reply = server["client"].completions.create(model="tiny", prompt="answer:", max_tokens=8, temperature=0,
                                                    extra_body={"guided_choice": ["yes", "no"]})
        assert reply.choices[0].text in ("yes", "no")
    bad = httpx.post(f"{server['base']}/v1/completions", timeout=30,
                     json={"model": "tiny", "prompt": "x", "max_tokens": 4, "guided_regex": "(unclosed"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"  # refused in the front


def test_engine_refusal_is_400(server):
    reply = httpx.post(f"{server['base']}/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": "x" * 300, "max_tokens": 4})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"


def test_dead_replica_gives_503_the_other_serves_and_it_restarts(server):
    base = server["base"]
    _idle(server)
    body = {"model": "tiny", "prompt": "a long answer", "max_tokens": 240, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        whole = pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=60)
        replicas = lambda: server["router"].health()[1]["replicas"]  # noqa: E731 - polled without HTTP
        wait_until(lambda: any(r["pending"] for r in replicas()), what="the request routed")
        victim = next(r for r in replicas() if r["pending"])
        os.kill(victim["pid"], signal.SIGKILL)
        reply = whole.result()
    assert reply.status_code == 503, reply.text
    assert reply.json()["error"]["code"] == "replica_unavailable"
    survivor = str(1 - victim["replica"])
    health = _health(server)
    assert health["status"] in ("degraded", "ok")
    served = server["client"].completions.with_raw_response.create(model="tiny", prompt="still there?", max_tokens=3)
    if health["status"] == "degraded":
        assert served.headers[REPLICA] == survivor
    wait_until(lambda: _health(server)["status"] == "ok", timeout=60, what="the replica restarted")
    restarted = _health(server)["replicas"][victim["replica"]]
    assert restarted["restarts"] == 1 and restarted["pid"] != victim["pid"]
    text = httpx.get(f"{base}/metrics", timeout=10).text
    assert f'hf_paged_replica_restarts_total{{replica="{victim["replica"]}"}} 1.0' in text


def test_dead_replica_ends_a_stream_with_503(server):
    base = server["base"]
    _idle(server)
    body = {"model": "tiny", "prompt": "stream a long answer", "max_tokens": 200, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        victim = int(r.headers[REPLICA])
        pid = _health(server)["replicas"][victim]["pid"]
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1:
                    os.kill(pid, signal.SIGKILL)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "replica_unavailable" and "exited" in error["message"]
    wait_until(lambda: _health(server)["status"] == "ok", timeout=60, what="the replica restarted")


def test_outputs_travel_as_deltas_and_are_rebuilt_whole():
    """A replica sends only what is new in each step's cumulative output; the front rebuilds the same outputs."""
    steps = [([5], [(-0.1, [(5, -0.1)])], None, None), ([5, 6], [(-0.1, [(5, -0.1)]), (-0.2, [(6, -0.2)])], None,
                                                         ([(-1.0, True)], [(0, [(9, -1.0)])])),
             ([5, 6, 7], [(-0.1, [(5, -0.1)]), (-0.2, [(6, -0.2)]), (-0.3, [(7, -0.3)])], "length", None)]
    sent, prompt_sent = {}, 0
    pending = _Pending(None, None, 0, [1, 2])
    for i, (tokens, logprobs, reason, prompt) in enumerate(steps):
        out = RequestOutput("r", [1, 2], [CompletionOutput(0, list(tokens), reason, logprobs=list(logprobs))],
                            finished=reason is not None, prompt_logprobs=prompt and prompt[0],
                            prompt_top_logprobs=prompt and prompt[1])
        message = encode(out, sent, prompt_sent)
        assert message[6][0][2] == tokens[-1:]  # one new token, not the whole list
        prompt_sent = len(out.prompt_logprobs or []) or prompt_sent
        rebuilt = pending.assemble(message)
        assert rebuilt.outputs[0].token_ids == tokens and rebuilt.outputs[0].logprobs == logprobs
        assert rebuilt.finished == (i == 2) and (rebuilt.prompt_logprobs or []) == [(-1.0, True)] * (i >= 1)
    failed = pending.assemble(("r", True, ("refused", "ValueError", "too long"), 0, {}, None, []))
    assert type(failed.error).__name__ == "RequestRefused" and str(failed.error) == "too long"


def test_policy_balances_and_pins():
    policy = AffinityPolicy(2, 4, imbalance=1)
    assert prefix_hashes(list(range(9)), 4, 64) == prefix_hashes(list(range(8)), 4, 64)
    prompt = list(range(16))
    first = policy.choose(prompt, [0, 0])
    assert policy.choose(prompt + [99], [0, 0]) == first  # its whole prefix is known
    assert policy.choose(prompt, [3, 0] if first == 0 else [0, 3]) == 1 - first  # too busy: the least loaded
    assert policy.balanced == 1
    assert policy.choose(prompt, [None, 0]) == 1  # a replica that is down is never chosen
    assert policy.choose([1, 2, 3], [0, 0], key="k") == policy.choose([7], [5, 5], key="k")
    with pytest.raises(LookupError):
        policy.choose(prompt, [None, None])
    with pytest.raises(ValueError, match="min_match"):
        AffinityPolicy(2, 4, min_match=1.0)


def test_data_parallel_argument_errors(capsys):
    def args(*argv):
        return parser().parse_args(["m", *argv])

    assert replica_devices(args("--data-parallel-size", "2", "--device", "cpu")) == ["cpu", "cpu"]
    assert replica_devices(args("--data-parallel-size", "2"), cuda_count=2) == ["cuda:0", "cuda:1"]
    with pytest.raises(ValueError, match="--data-parallel-size 3 needs 3 GPUs.*2 are visible"):
        replica_devices(args("--data-parallel-size", "3"), cuda_count=2)
    with pytest.raises(ValueError, match="--device cuda:1 names one GPU"):
        replica_devices(args("--data-parallel-size", "2", "--device", "cuda:1"), cuda_count=2)
    with pytest.raises(ValueError, match="--data-parallel-size must be a positive integer"):
        replica_devices(argparse.Namespace(data_parallel_size=0, router_imbalance=8, device=None))
    with pytest.raises(SystemExit) as exit_info:
        serve_main(["m", "--data-parallel-size", "0"])
    assert exit_info.value.code == 2 and "--data-parallel-size" in capsys.readouterr().err
    with pytest.raises(ValueError, match="devices"):
        ReplicaRouter(ReplicaSpec(tiny_replica), [])
    with pytest.raises(ValueError, match="started ReplicaRouter"):
        build_app(ReplicaRouter(ReplicaSpec(tiny_replica), ["cpu"]), tokenizer=object())


def test_one_engine_runs_in_its_own_process_by_default_on_cuda_only():
    """`--engine-process` is the CUDA default (the front and the engine then hold an interpreter lock each); on the
    CPU the engine stays in a thread; either flag overrides."""
    def args(*argv):
        return parser().parse_args(["m", *argv])

    assert engine_process(args(), "cuda") and engine_process(args(), "cuda:1")
    assert not engine_process(args(), "cpu")
    assert not engine_process(args("--no-engine-process"), "cuda")
    assert engine_process(args("--engine-process"), "cpu")


def test_a_replica_binds_its_device_a_plain_cuda_included(monkeypatch):
    """A replica makes its device the current one; `--engine-process` on one GPU hands it a plain "cuda", which
    `torch.cuda.set_device` refuses without an index (it stopped the server at start on the H200): the process's
    current GPU is meant. On the CPU it sets the intra-op threads."""
    bound, threads = [], []
    monkeypatch.setattr("torch.cuda.set_device", bound.append)
    monkeypatch.setattr("torch.cuda.current_device", lambda: 0)
    monkeypatch.setattr("torch.set_num_threads", threads.append)
    bind_device("cuda", 4)
    bind_device("cuda:1", None)
    bind_device("cpu", 3)
    bind_device("cpu", None)
    assert bound == [0, 1] and threads == [3]


def test_a_replica_that_cannot_load_fails_the_start():
    router = ReplicaRouter(ReplicaSpec(broken_replica), ["cpu"])
    with pytest.raises(RuntimeError, match="replica 0 \\(cpu\\) failed to start:(.|\n)*no model to load on cpu"):
        router.start(timeout=120)


@pytest.mark.slow
def test_cli_serves_two_replicas_and_stops_them_on_sigint(tmp_path):
    """`python -m hf_paged.serve DIR --data-parallel-size 2 --device cpu`: the replicas load the directory in their
    own processes, and SIGINT to the front stops them all and exits 0."""
    model, tok = tiny_replica("cpu")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hf_paged.serve", str(tmp_path), "--device", "cpu", "--data-parallel-size", "2",
         "--num-blocks", "64", "--block-size", "4", "--port", str(port), "--log-level", "warning"],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        pids = [r["pid"] for r in httpx.get(f"{base}/health").json()["replicas"]]
        reply = httpx.post(f"{base}/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=30)
        assert reply.status_code == 200 and reply.headers[REPLICA] in ("0", "1")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("flags", [["--data-parallel-size", "2"], ["--engine-process"]])
def test_cli_reports_a_model_the_replicas_cannot_load(tmp_path, monkeypatch, flags):
    """Also `--engine-process`: one engine in a replica process (the error comes from the replica's load)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as exit_info:
        serve_main([str(tmp_path / "no-such-model"), "--device", "cpu", *flags])
    message = str(exit_info.value.code)
    assert message.startswith("hf-paged serve: replica") and "cannot load" in message and "no-such-model" in message


def test_lora_adapters_reach_every_replica_and_the_front_lists_them():
    """`--lora` with `--data-parallel-size`: the spec carries the adapters to the replicas (whose engines add them
    before their warm-up; not started here), the router answers `lora_names` for /v1/models and the front's model
    check, and the command line parses both flags together."""
    spec = ReplicaSpec(tiny_replica, loras=(("fr", "/adapters/fr"), ("de", "/adapters/de")))
    assert ReplicaRouter(spec, ["cpu", "cpu"]).lora_names() == ["fr", "de"]
    args = parser().parse_args(["m", "--data-parallel-size", "2", "--device", "cpu", "--lora", "fr=/a", "--max-loras",
                                "3"])
    assert args.lora == [("fr", "/a")] and args.max_loras == 3
