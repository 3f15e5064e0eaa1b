"""Engines behind one protocol: `VLLMEngine` (the real one) and `ScriptedEngine` (unit tests only)."""

from polar_lab.engine.base import Engine
from polar_lab.engine.fake import ScriptedEngine
from polar_lab.engine.vllm_engine import VLLMEngine

__all__ = ["Engine", "ScriptedEngine", "VLLMEngine"]
