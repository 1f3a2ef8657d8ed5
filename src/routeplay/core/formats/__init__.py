"""Codecs of every engine's routing payload: decoders to canonical ``Routes`` and encoders
for tests and the reference engine. Where a payload sits in a body is the business of
``routeplay.core.wires``."""

from routeplay.core.formats import lmdeploy, sglang, vllm

__all__ = ["lmdeploy", "sglang", "vllm"]
