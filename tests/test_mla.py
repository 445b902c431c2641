"""Multi-head latent attention (`hf_paged.attention.adapters.mla`): the latent in the pool, attention absorbed.

What must hold, on each MLA family's tiny seeded model (float32, CPU):

* the absorbed latent attention of one layer equals the model's own expanded attention (the same module, no cache);
* greedy tokens of the engine (eager and static decode, the compiled step with no graph break, a tiny pool that
  preempts by recompute and by swap, the prefix cache hit on a second run) and of the drop-in `PagedCache` / `generate(cache_implementation="paged")` on a
  left-padded batch equal transformers' `DynamicCache` greedy generate; beam search (3 beams) equals transformers';
* the pool holds one KV head of `kv_lora_rank + qk_rope_head_dim` per layer, and what that costs per token;
* the gate accepts the adapted families and still refuses what the adapter does not handle.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from torch._dynamo.utils import counters
from transformers import DynamicCache, GenerationConfig

import hf_paged
from hf_paged.attention import adapters, support
from hf_paged.attention.adapters import mla
from hf_paged.cache import attention_heads, attention_shape, kv_bytes_per_token, latent_kv_width
from hf_paged.model_zoo import check_architecture, tiny_inputs, tiny_model

try:
    from tests.helpers import dense_generate, greedy_reference, paged, random_prompts
    from tests.test_beam import compare_with_transformers
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from helpers import dense_generate, greedy_reference, paged, random_prompts
    from test_beam import compare_with_transformers

warnings.filterwarnings("ignore", module="transformers")
transformers.logging.set_verbosity_error()

# (family, config overrides): every rotary convention, with and without the query's LoRA
CASES = [
    ("deepseek_v2", {}),  # complex rotary
    ("deepseek_v2", dict(q_lora_rank=None)),  # q_proj
    ("deepseek_v3", {}),  # rope_interleave=True
    ("deepseek_v3", dict(rope_interleave=False, q_lora_rank=None)),
    ("glm4_moe_lite", {}),
    ("minicpm3", {}),  # rotary on halves
    ("youtu", {}),
    ("longcat_flash", {}),  # two attention sublayers per layer, LoRA scales
    ("axk1", {}),
]
IDS = [f"{f}-" + ("-".join(f"{k}={v}" for k, v in o.items()) or "default") for f, o in CASES]
MAX_NEW = 10


def _model(family: str, overrides: dict, seed: int = 0):
    model = tiny_model(family, seed=seed, **overrides)
    model.generation_config = GenerationConfig(pad_token_id=0, bos_token_id=1)  # no eos: every run is MAX_NEW long
    return model


class _LatentCache(DynamicCache):
    holds_latent_kv = True


@pytest.mark.parametrize("family,overrides", CASES, ids=IDS)
def test_absorbed_attention_equals_expanded(family, overrides):
    """One layer: the latent path (absorbed query, MQA over the latent, W_UV after) against the module's own
    expanded attention on the same hidden states and positions, both without the paged kernels' help."""
    model = _model(family, overrides)
    module = next(m for m in model.modules() if adapters.adapter_for(type(m)) is not None)
    hidden = torch.randn(2, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(7)[None].expand(2, -1)
    rotary = model.model.rotary_emb(hidden, positions)
    hf_paged.enable(model)
    try:
        mask = torch.ones(2, 7, dtype=torch.long)
        with torch.no_grad():
            if family == "deepseek_v2":
                got, _ = module(hidden_states=hidden, attention_mask=mask, past_key_values=_LatentCache(),
                                position_embeddings=rotary)
            else:
                got, _ = module(hidden_states=hidden, position_embeddings=rotary, attention_mask=mask,
                                past_key_values=_LatentCache())
    finally:
        hf_paged.disable(model)
    with torch.no_grad():  # transformers' own module (sdpa, causal, no cache)
        want, _ = module(hidden_states=hidden, position_embeddings=rotary, attention_mask=None)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert want.abs().max() > 1e-3  # not vacuous


@pytest.mark.parametrize("family,overrides", CASES, ids=IDS)
def test_drop_in_and_generate_equal_transformers_on_a_left_padded_batch(family, overrides):
    record = check_architecture(family, timeout_s=120, **overrides)  # generate(cache_implementation="paged") too
    assert record["verdict"] == "pass", record["reason"]
    assert record["interface_routed"] and "attention_adapter" in record["features"]
    assert not {"latent_kv", "value_head_dim", "kv_after_update"} & set(record["features"]), record["features"]
    model = _model(family, overrides)
    ids, mask = tiny_inputs((9, 3, 6), seed=2)
    options = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    want = dense_generate(model, **options)
    with paged(model), torch.no_grad():
        cache = hf_paged.PagedCache(config=model.config, num_blocks=32, block_size=4)
        got = model.generate(**options, past_key_values=cache)
        assert cache.head_dim == latent_kv_width(model.config) and cache.num_kv_heads == 1
    assert torch.equal(got, want)


@pytest.mark.parametrize("family,overrides", CASES, ids=IDS)
def test_engine_greedy_equals_transformers(family, overrides):
    model = _model(family, overrides)
    prompts = random_prompts((5, 13, 2, 9, 17), seed=4, vocab=model.config.vocab_size)
    want = [greedy_reference(model, p, MAX_NEW, eos_token_id=None) for p in prompts]
    engine = hf_paged.Engine(model, num_blocks=64, block_size=4)
    results = engine.generate(prompts, max_new_tokens=MAX_NEW)
    assert [r.outputs[0].token_ids for r in results] == want
    again = engine.generate(prompts, max_new_tokens=MAX_NEW)  # prompts' blocks from the cache
    assert [r.outputs[0].token_ids for r in again] == want
    assert engine.prefix_cache_stats().hit_tokens > 0


@pytest.mark.parametrize("options", [dict(decode="static"), dict(num_blocks=14, preemption_mode="recompute"),
                                     dict(num_blocks=14, preemption_mode="swap", swap_space=0.01)],
                         ids=["static_decode", "recompute", "swap"])
def test_engine_paths_stay_exact_on_deepseek_v3(options):
    model = _model("deepseek_v3", {})
    prompts = random_prompts((11, 6, 14, 3, 9, 12), seed=5, vocab=model.config.vocab_size)
    want = [greedy_reference(model, p, MAX_NEW, eos_token_id=None) for p in prompts]
    options = dict(options)
    decode = options.pop("decode", None)
    engine = hf_paged.Engine(model, block_size=4, **{"num_blocks": 64, **options})
    if decode is not None:
        engine.runner.decode_mode = decode  # the CUDA-graph path's host logic
    results = engine.generate(prompts, max_new_tokens=MAX_NEW)
    assert [r.outputs[0].token_ids for r in results] == want
    if "preemption_mode" in options:
        assert engine.scheduler.num_preemptions[options["preemption_mode"]] > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_compiled_decode_step_stays_exact(family):
    """`compile_decode=True` (Dynamo + Inductor, the CPU's static path): the adapted forward traced, the latent
    attention one `hf_paged::write_and_decode` op, no graph break; tokens equal transformers'."""
    model = _model(family, {})
    prompts = random_prompts((7, 12, 3, 9), seed=6, vocab=model.config.vocab_size)
    want = [greedy_reference(model, p, 8) for p in prompts]
    counters.clear()
    engine = hf_paged.Engine(model, block_size=8, max_num_seqs=8, compile_decode=True)
    results = engine.generate(prompts, max_new_tokens=8)
    assert [r.outputs[0].token_ids for r in results] == want
    assert engine.runner.graph_steps > 0
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_beam_search_equals_transformers_on_deepseek_v3():
    model = _model("deepseek_v3", {})
    ids, mask = tiny_inputs((5, 11, 2, 8), seed=3)
    compare_with_transformers(model, dict(input_ids=ids, attention_mask=mask), dict(num_blocks=256, block_size=4),
                              num_beams=3, max_new_tokens=MAX_NEW, eos_token_id=None)


def test_pool_holds_the_latent_once_per_layer_as_one_kv_head():
    """DeepSeek-V2-Lite's shape: 27 layers, 16 heads, kv_lora_rank 512, rope 64 (nope 128, v 128)."""
    config = transformers.DeepseekV2Config(num_hidden_layers=27, num_attention_heads=16, kv_lora_rank=512,
                                           qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                           hidden_size=2048, q_lora_rank=None)
    assert latent_kv_width(config) == 576
    assert attention_shape(config) == (27, 1, 576)
    assert attention_heads(config) == (16, 1)
    # keys and values are the same latent, stored once (a layer whose values are its keys: `cache.KVShape`)
    assert kv_bytes_per_token(config, torch.bfloat16) == 27 * 576 * 2
    expanded = 27 * 16 * (128 + 64 + 128) * 2  # what caching the expanded K (192 a head) and V (128) would take
    assert expanded / kv_bytes_per_token(config, torch.bfloat16) > 8.8
    cache = hf_paged.PagedCache(config=config, num_blocks=4, block_size=16, dtype=torch.bfloat16, device="cpu")
    assert cache.bytes_per_block() == 16 * 27 * 576 * 2
    latent = torch.randn(1, 1, 3, 576, dtype=torch.bfloat16)
    keys, values = cache.update(latent, latent, 0)
    assert keys is values  # one tensor: the values read are the keys written
    assert latent_kv_width(transformers.LlamaConfig()) is None


def test_gate_accepts_adapted_mla_and_refuses_the_rest():
    model = _model("deepseek_v3", {})
    assert support.refusal(model, support.model_features(model)) is None
    assert "latent_kv" in support.model_features(model.config)  # a config alone cannot say it is adapted
    # a kv_b_proj the adapter cannot split per head: refused, naming the latent attention
    for module in model.modules():
        if adapters.adapter_for(type(module)) is not None:
            module.kv_b_proj = torch.nn.Linear(module.kv_b_proj.in_features, module.kv_b_proj.out_features, bias=True)
    assert mla.holds_latent(hf_paged.PagedCache(config=model.config, num_blocks=4, block_size=4))
    with pytest.raises(ValueError, match="latent_kv"):
        hf_paged.enable(model)
    record = check_architecture("kimi_linear", timeout_s=120)  # latent attention beside recurrent layers: refused
    assert record["verdict"] == "refused" and "latent_kv" in record["unhandled"]


def test_a_latent_wider_than_the_triton_kernels_take_is_refused_up_front_on_their_devices():
    """On a device whose kernels are Triton's, DeepSeek's 576-wide latent is taken for any number of query heads and
    dtype (the narrow kernels' small tiles for up to 32 heads in 16-bit types, the wide kernels otherwise); a latent
    wider than the wide kernels take (1,024) is refused by the gate, naming why, rather than by the first kernel call
    of a step. The torch backend (CPU) takes any."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert mla.wide_latent_refusal(2048, 128, torch.float32, cpu) is None
    if not hf_paged.kernels.triton_available():
        return
    for heads, dtype in ((16, torch.bfloat16), (20, torch.float16), (128, torch.bfloat16), (16, torch.float32)):
        assert mla.wide_latent_refusal(576, heads, dtype, cuda) is None
    assert "from 1 to 1024" in mla.wide_latent_refusal(1088, 16, torch.bfloat16, cuda)
