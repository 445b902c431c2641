"""hf-paged: vLLM-style PagedAttention and continuous batching for HuggingFace transformers causal LMs."""

from .beam import SharingStats
from .block_manager import BlockManager, BlockStats
from .cache import CacheFullError, PagedCache
from .engine import CompletionOutput, Engine, EngineClosedError, RequestOutput
from .integrations.attention import ATTENTION_NAME, register
from .integrations.generate import disable, enable
from .integrations.pipeline import pipeline
from .sampling import SamplingParams

__version__ = "0.1.0"

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
