"""GRPO over a live Lab: groups of token-exact trajectories → update → weights back into the engine.

Modules: config (GRPOConfig), batch (staleness, advantages, per-token weights), loss (the objective),
policy (one trainer rank), distributed (ranks as worker processes), rollouts (sync / async sources),
trainer (GRPOTrainer: the loop, metrics, checkpoints, evaluation).
"""

from polar_lab.grpo.batch import Batch, Sample, build_batch, run_advantages, split_stale
from polar_lab.grpo.config import GRPOConfig
from polar_lab.grpo.trainer import GRPOTrainer

__all__ = ["Batch", "GRPOConfig", "GRPOTrainer", "Sample", "build_batch", "run_advantages", "split_stale"]
