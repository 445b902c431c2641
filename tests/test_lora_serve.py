"""`hf-paged serve --lora NAME=PATH`: a request's `model` picks the adapter, `/v1/models` lists them, an unknown model
is a 404; the `openai` client over real HTTP (uvicorn in a thread), a tiny seeded llama and two random PEFT adapters."""

from __future__ import annotations

import copy

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
peft = pytest.importorskip("peft")

import hf_paged  # noqa: E402
from hf_paged.serve import build_app  # noqa: E402
from hf_paged.serve.cli import parser  # noqa: E402
from hf_paged.testing import byte_tokenizer, tiny_model  # noqa: E402

try:
    from tests.serve_helpers import ThreadedServer
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from serve_helpers import ThreadedServer

pytestmark = pytest.mark.xdist_group("lora_serve")

PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
NEW = 8


def test_cli_lora_flags():
    args = parser().parse_args(["m", "--lora", "a=/x/a", "--lora", "b=/y=z", "--max-loras", "2"])
    assert args.lora == [("a", "/x/a"), ("b", "/y=z")] and args.max_loras == 2 and args.max_lora_rank == 16
    with pytest.raises(SystemExit):
        parser().parse_args(["m", "--lora", "no-path"])


def test_served_adapters_with_the_openai_client(tmp_path):
    tok = byte_tokenizer()
    base = tiny_model("llama", seed=0, vocab_size=len(tok))
    want = {}
    for i, (name, targets) in enumerate((("a", ["q_proj", "v_proj"]), ("b", ["o_proj", "down_proj"]))):
        torch.manual_seed(20 + i)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        adapted = peft.get_peft_model(copy.deepcopy(base), config)
        adapted.save_pretrained(tmp_path / name)
        with hf_paged.Engine(adapted.merge_and_unload(), num_blocks=32, block_size=8) as oracle:
            out = oracle.generate([PROMPT], max_new_tokens=NEW, ignore_eos=True)[0]
        want[name] = tok.decode(out.outputs[0].token_ids)
    engine = hf_paged.Engine(base, tok, num_blocks=64, block_size=8, max_num_seqs=8, max_loras=2)
    for name in want:
        engine.add_lora(name, str(tmp_path / name))
    app = build_app(engine, model_name="tiny")
    with ThreadedServer(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny", "a", "b"]
        texts = {}
        for model in ("tiny", "a", "b"):
            reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                              extra_body={"ignore_eos": True})
            texts[model] = reply.choices[0].text
            assert reply.model == model  # a reply names the adapter that wrote it, as vLLM's do
        assert texts["a"] == want["a"] and texts["b"] == want["b"] and texts["tiny"] not in (want["a"], want["b"])
        chats = {model: client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=NEW, temperature=0).choices[0].message.content
                 for model in ("tiny", "a")}
        assert chats["tiny"] != chats["a"]  # the chat endpoint routes by `model` too
        stream = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=NEW, temperature=0, stream=True)
        assert {chunk.model for chunk in stream} == {"a"}
        with pytest.raises(openai.NotFoundError, match="'c' does not exist"):
            client.completions.create(model="c", prompt=PROMPT, max_tokens=2)


def test_serve_main_loads_the_lora_flags(tmp_path, monkeypatch):
    """`hf-paged serve MODEL --lora a=PATH`: the engine it builds has the adapter (before any warm-up); an adapter
    named like the base model is refused. (The model loader, the app and uvicorn's loop are stubbed.)"""
    import uvicorn

    from hf_paged.serve import cli

    tok = byte_tokenizer()
    base = tiny_model("llama", seed=0, vocab_size=len(tok))
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False)
    peft.get_peft_model(copy.deepcopy(base), config).save_pretrained(tmp_path / "a")
    built = {}
    monkeypatch.setattr(cli, "load", lambda args: (base, tok))
    monkeypatch.setattr(cli, "build_app", lambda engine, tokenizer, **kwargs: built.update(engine=engine, **kwargs))
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)
    argv = ["tiny", "--device", "cpu", "--num-blocks", "16", "--max-loras", "2", "--lora", f"a={tmp_path / 'a'}"]
    assert cli.serve_main(argv) == 1  # (the stubbed server never closed the engine)
    engine = built["engine"]
    try:
        assert engine.lora_names() == ["a"] and engine.lora.max_loras == 2 and built["model_name"] == "tiny"
    finally:
        engine.close()
    with pytest.raises(SystemExit, match="base model's name"):
        cli.serve_main(["tiny", "--device", "cpu", "--num-blocks", "16", "--lora", f"tiny={tmp_path / 'a'}"])
