"""polar_lab: train LLM agents with RL on the harnesses you already have, from a Jupyter kernel.

A harness talks to the Lab's proxy as if it were OpenAI; a vLLM engine in the kernel answers; every
call is recorded at token level (prompt ids, sampled ids, sampler logprobs, policy version).
"""

from polar_lab.config import EngineConfig, LabConfig, ProxyConfig, StoreConfig
from polar_lab.errors import PolarLabError
from polar_lab.grpo import GRPOConfig, GRPOTrainer
from polar_lab.lab import Lab
from polar_lab.types import Generation, Group, ModelCall, SamplingSpec, Session, Trajectory

__all__ = [
    "EngineConfig",
    "GRPOConfig",
    "GRPOTrainer",
    "Generation",
    "Group",
    "Lab",
    "LabConfig",
    "ModelCall",
    "PolarLabError",
    "ProxyConfig",
    "SamplingSpec",
    "Session",
    "StoreConfig",
    "Trajectory",
]
__version__ = "0.1.0"
