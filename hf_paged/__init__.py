"""hf-paged: vLLM-style PagedAttention and continuous batching for HuggingFace transformers causal LMs."""

from .attention import ATTENTION_NAME, register
from .cache import CacheFullError, PagedCache
from .core import BlockManager, BlockStats
from .engine import CompletionOutput, Engine, EngineClosedError, RequestOutput, SamplingParams, SharingStats
from .integrations.generate import disable, enable
from .integrations.pipeline import pipeline

__version__ = "0.2.0"

__all__ = [
    "ATTENTION_NAME",
    "BlockManager",
    "BlockStats",
    "CacheFullError",
    "CompletionOutput",
    "Engine",
    "EngineClosedError",
    "PagedCache",
    "RequestOutput",
    "SamplingParams",
    "SharingStats",
    "disable",
    "enable",
    "pipeline",
    "register",
]
