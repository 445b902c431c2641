"""The continuous-batching engine: the step loop, sampling, beam search, outputs and streaming.

Layer 6 of hf_paged (docs/architecture.md): imports `hf_paged.core`, `hf_paged.cache`, `hf_paged.attention` and
`hf_paged.runner`; imported by the integrations and the server.
"""

from .beam import BeamSearch, SharingStats
from .engine import Engine, default_max_num_batched_tokens
from .outputs import CompletionOutput, RequestOutput
from .params import SamplingParams
from .pipelined import _IN_FLIGHT  # noqa: F401  (the placeholder token id; tests of pipelining read it here)
from .requests import EngineClosedError
from .sampling import Sampler, sample_next_tokens

__all__ = [
    "BeamSearch",
    "CompletionOutput",
    "Engine",
    "EngineClosedError",
    "RequestOutput",
    "Sampler",
    "SamplingParams",
    "SharingStats",
    "default_max_num_batched_tokens",
    "sample_next_tokens",
]
