"""Per-family attention adapters: models whose attention does not go through transformers' `AttentionInterface`.

Most of transformers' families compute attention through `AttentionInterface`, and hf-paged reaches them by registering
its attention function there. A few older or unusual ones (Falcon, GPT-J, GPT-Neo, CodeGen, JetMoE, BLOOM, MPT, XGLM,
GPT-NeoX-Japanese) compute it in their own attention module, the multi-head latent attention families expand K/V from a
cached latent after the cache, and DiffLlama re-pairs its values after it. For those, `prepare_model` installs an
adapter on each attention module *instance* (`registry.install`; `hf_paged.disable` uninstalls it): the module's own
projections, norms, rotary code and cache calls run as written, and only where the module computes attention from the
K/V that `Cache.update()` returned does the adapter call the registered attention function instead, as an
interface-routed module does. Nothing of a modeling file is copied; each adapter names what its family does differently
and why the replacement computes the same thing (one module per family or shared pattern):

* `inner`: GPT-J, CodeGen, GPT-Neo, GPT-NeoX-Japanese (their inner `_attn` method replaced);
* `falcon`: Falcon (multi-query, grouped new decoder architecture, rotary or ALiBi);
* `jetmoe`: JetMoE (K/V tiled over the attention experts after the cache);
* `xglm`: XGLM (fairseq-style attention, query pre-scaled);
* `diffllama`: DiffLlama (differential attention: two calls sharing Q/K over the two halves of V, one paged call over
  KV heads paired in the pool);
* `moshi`: Moshi (its window applied by transformers' cache, not passed to the attention function: the adapter
  passes it as `cache_window`);
* `alibi`: BLOOM and MPT, and the slopes the kernels' `alibi_slopes` option takes (Falcon-RW's too);
* `mla`: multi-head latent attention (DeepSeek-V2/V3, GLM-4-MoE-Lite, MiniCPM3, Youtu, LongCat-Flash, A.X K1): the
  compressed latent in the pool (one KV head of `kv_lora_rank + qk_rope_head_dim`), attention with the up-projection
  absorbed into the query (an ordinary multi-query call);
* `dsa`: DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5, HY-V4, A.X K2): MLA's latent pool, plus the indexer's keys
  beside it and each query's top-k selection, computed by the module's own indexer against its own sequence only and
  attended through `kernels.paged_sparse_attention`;
* `qsa`: Qwen4-Exp's sparse attention (pooled token blocks picked per query, plus its unfinished block): the raw index
  keys beside K/V in the pool, the selection per sequence, the same sparse attention.

The static gate (`hf_paged.attention.support`) counts an adapted class as routed, and the run-time probe
(`hf_paged.capabilities`) installs the adapters for its forward, so the architecture sweep checks adapted families
exactly as the others: what the probe sees arrive at the attention function, and tokens equal to transformers'.
"""

from . import alibi, diffllama, dsa, falcon, inner, jetmoe, mla, moshi, qsa, xglm  # noqa: F401 - each registers its adapters
from .registry import (
    Adapter,
    adapted_modules,
    adapter_for,
    attend,
    family_module,
    install,
    needs_mask_tensor,
    refusal,
    register,
    route_through,
    switch_implementation,
    uninstall,
)

__all__ = ["Adapter", "adapted_modules", "adapter_for", "attend", "family_module", "install", "needs_mask_tensor",
           "refusal", "register", "route_through", "switch_implementation", "uninstall"]
