"""polar_lab: train LLM agents with RL on the harnesses you already have, from a Jupyter kernel.

A harness talks to the Lab's proxy as if it were OpenAI; a vLLM engine in the kernel answers; every
call is recorded at token level (prompt ids, sampled ids, sampler logprobs, policy version).

Names are imported on first use, so `import polar_lab.grpo.policy` (the trainer alone, e.g. on a GPU
machine with only torch and transformers) does not pull in the server stack.
"""

from typing import TYPE_CHECKING

from polar_lab._lazy import lazy_exports

_HOME = {
    "EngineConfig": "polar_lab.config", "LabConfig": "polar_lab.config", "ProxyConfig": "polar_lab.config",
    "StoreConfig": "polar_lab.config", "HarnessConfig": "polar_lab.config", "PolarLabError": "polar_lab.errors", "GRPOConfig": "polar_lab.grpo.config",
    "GRPOTrainer": "polar_lab.grpo.trainer", "Lab": "polar_lab.lab", "Run": "polar_lab.run",
    "Generation": "polar_lab.types",
    "Group": "polar_lab.types", "ModelCall": "polar_lab.types", "SamplingSpec": "polar_lab.types",
    "Session": "polar_lab.types", "Trajectory": "polar_lab.types",
}

__all__, __getattr__ = lazy_exports("polar_lab", _HOME)
__version__ = "0.1.0"


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # for type checkers and IDEs
    from polar_lab.config import EngineConfig, HarnessConfig, LabConfig, ProxyConfig, StoreConfig  # noqa: F401
    from polar_lab.errors import PolarLabError  # noqa: F401
    from polar_lab.grpo.config import GRPOConfig  # noqa: F401
    from polar_lab.grpo.trainer import GRPOTrainer  # noqa: F401
    from polar_lab.lab import Lab  # noqa: F401
    from polar_lab.run import Run  # noqa: F401
    from polar_lab.types import Generation, Group, ModelCall, SamplingSpec, Session, Trajectory  # noqa: F401
