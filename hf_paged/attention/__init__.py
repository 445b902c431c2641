"""What transformers' modeling code calls: the `hf_paged` attention, mask and experts functions, the compiled step's
fused op, and the check of which models can run through them.

Layer 4 of hf_paged (docs/architecture.md): imports `hf_paged.cache` and `hf_paged.kernels`; imported by the runner,
the engine and the integrations.
"""

from . import experts
from .compiled_op import active_cache, fused_decode_attention, write_and_decode
from .experts import EXPERTS_NAME, experts_forward, experts_spec
from .functions import ATTENTION_NAME, paged_attention_forward, paged_mask, register
from .recurrent_profile import profile_state_specs
from .setup import on_prepare, prepare_model, release_model
from .support import HANDLED_FEATURES, check_supported, describe_support, model_features, writes_other_cache_layers

__all__ = [
    "ATTENTION_NAME",
    "EXPERTS_NAME",
    "HANDLED_FEATURES",
    "active_cache",
    "check_supported",
    "describe_support",
    "experts",
    "experts_forward",
    "experts_spec",
    "fused_decode_attention",
    "model_features",
    "on_prepare",
    "paged_attention_forward",
    "paged_mask",
    "prepare_model",
    "profile_state_specs",
    "register",
    "release_model",
    "write_and_decode",
    "writes_other_cache_layers",
]
