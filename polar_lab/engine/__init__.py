"""Engines behind one protocol: `VLLMEngine` (the real one) and `ScriptedEngine` (unit tests only).

The names are imported on first use: a process that needs only a light submodule (the forkserver's client in a
Jupyter server, polar_lab/jupyter.py) does not import torch with the package."""

from polar_lab._lazy import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {"Engine": "polar_lab.engine.base",
                                               "ScriptedEngine": "polar_lab.engine.fake",
                                               "VLLMEngine": "polar_lab.engine.vllm_engine"})
