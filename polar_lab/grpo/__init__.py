"""GRPO over a live Lab: groups of token-exact trajectories → update → weights back into the engine.

Modules: config (GRPOConfig), batch (staleness, advantages, per-token weights), loss (the objective),
policy (one trainer rank), distributed (ranks as worker processes), rollouts (sync / async sources),
trainer (GRPOTrainer: the loop, metrics, checkpoints, evaluation), run (`polar-lab train`).
Names are imported on first use: the trainer-only modules need just torch and transformers.
"""

from polar_lab._lazy import lazy_exports

_HOME = {
    "Batch": "polar_lab.grpo.batch", "Sample": "polar_lab.grpo.batch", "build_batch": "polar_lab.grpo.batch",
    "run_advantages": "polar_lab.grpo.batch", "split_stale": "polar_lab.grpo.batch",
    "GRPOConfig": "polar_lab.grpo.config", "GRPOTrainer": "polar_lab.grpo.trainer",
}
__all__, __getattr__ = lazy_exports("polar_lab.grpo", _HOME)
