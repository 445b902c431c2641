"""OpenAI-compatible HTTP serving of the engine (`hf-paged serve MODEL`, or `build_app(engine)` to embed).

Layer 8 of hf_paged (docs/architecture.md): the top; imports the engine. Needs the `serve` extra (fastapi, uvicorn,
prometheus-client): `pip install "hf-paged[serve]"`.
"""

from .app import build_app
from .bridge import EngineBridge, RequestFailed
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest
from .replica import ReplicaSpec
from .router import ReplicaRouter

__all__ = ["ApiError", "ChatCompletionRequest", "CompletionRequest", "EngineBridge", "ReplicaRouter", "ReplicaSpec",
           "RequestFailed", "build_app"]
