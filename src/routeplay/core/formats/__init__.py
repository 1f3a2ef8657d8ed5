"""Wire formats of every engine: decoders to canonical ``Routes``, encoders for tests and
the reference engine, and readers of whole HTTP response bodies."""

from routeplay.core.formats import lmdeploy, sglang, vllm
from routeplay.core.formats.response import Engine, EngineRouting, read_response

__all__ = ["Engine", "EngineRouting", "lmdeploy", "read_response", "sglang", "vllm"]
