"""From Groups to a training batch: staleness filter → group-relative advantages → per-token weights.

Pure functions over `Group`/`Trajectory`; no model, no engine. The unit of GRPO here is a *run* (one
harness session), not a trajectory: a run's reward and advantage are shared by all the chains it yielded
(sub-agents, compaction), and loss normalisation counts runs, so a run that broke into three chains
weighs as much as one that did not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from polar_lab.grpo.config import GRPOConfig
from polar_lab.types import Group, Trajectory


@dataclass
class Sample:
    """One trajectory ready for the loss. Per-target tensors have length L-1: target t is input_ids[t+1]."""

    input_ids: torch.Tensor  # (L,) long
    weights: torch.Tensor  # (L-1,) normalisation coefficient of each target's loss; 0 = not trained
    advantage: float  # the run's group-relative advantage
    behavior_logprobs: torch.Tensor  # (L-1,) the engine's sampler logprobs (0 where not trained)
    versions: torch.Tensor  # (L-1,) long, policy version that sampled each target (-1 where not trained)
    temperature: float  # the trainer recomputes logprobs at the temperature the engine sampled with
    session_id: str = ""

    @property
    def num_tokens(self) -> int:
        return int((self.weights > 0).sum())


@dataclass
class Batch:
    samples: list[Sample]
    stats: dict[str, float] = field(default_factory=dict)  # group/run/token counts, rewards, staleness


def group_staleness(group: Group, trainer_version: int) -> int:
    """Policy versions between the trainer and the oldest sampled token of the group (0 = on-policy)."""
    versions = [v for t in group.trajectories for v, m in zip(t.policy_versions, t.loss_mask) if m]
    return trainer_version - min(versions) if versions else 0


def split_stale(groups: list[Group], trainer_version: int, max_staleness: int) -> tuple[list[Group], list[Group]]:
    """(fresh, stale): a group with any trained token more than `max_staleness` versions old is stale."""
    fresh: list[Group] = []
    stale: list[Group] = []
    for g in groups:
        (fresh if group_staleness(g, trainer_version) <= max_staleness else stale).append(g)
    return fresh, stale


def run_advantages(groups: list[Group], scale_rewards: str, eps: float = 1e-4) -> dict[str, float]:
    """session id → advantage (reward minus its group's mean, optionally over a std).

    Runs with reward None (crashed, timed out) are left out. Groups with fewer than two scored runs or
    with all rewards equal carry no signal and are skipped (absent from the result).

    >>> from polar_lab.types import Session
    >>> g = Group(task={}, sessions=[Session(id=i, key="", reward=r) for i, r in (("a", 1.0), ("b", 0.0))])
    >>> run_advantages([g], "none")
    {'a': 0.5, 'b': -0.5}
    """
    scored = [[(s.id, s.reward) for s in g.sessions if s.reward is not None] for g in groups]
    scored = [runs for runs in scored if len(runs) >= 2 and _std([r for _, r in runs]) > 0]
    batch_std = _std([r for runs in scored for _, r in runs])
    out = {}
    for runs in scored:
        rewards = [r for _, r in runs]
        mean = sum(rewards) / len(rewards)
        scale = 1.0 if scale_rewards == "none" else {"group": _std(rewards), "batch": batch_std}[scale_rewards] + eps
        out.update({sid: (r - mean) / scale for sid, r in runs})
    return out


def build_batch(groups: list[Group], config: GRPOConfig, trainer_version: int) -> Batch:
    """Stale groups out, advantages in, one Sample per trajectory of an informative run."""
    fresh, stale = split_stale(groups, trainer_version, config.max_staleness)
    advantages = run_advantages(fresh, config.scale_rewards)
    trajs = [t for g in fresh for t in g.trajectories if t.session_id in advantages and any(t.loss_mask)]
    if config.mask_truncated_completions:
        truncated = {t.session_id for t in trajs if t.truncated}
        trajs = [t for t in trajs if t.session_id not in truncated]
    weights = _token_weights(trajs, config)
    samples = [_sample(t, advantages[t.session_id], w) for t, w in zip(trajs, weights)]
    staleness = [trainer_version - v for t in trajs for v, m in zip(t.policy_versions, t.loss_mask) if m]
    rewards = [s.reward for g in groups for s in g.sessions if s.reward is not None]
    stats = {
        "groups": len(groups), "groups_stale": len(stale),
        "groups_zero_advantage": sum(not any(s.id in advantages for s in g.sessions) for g in fresh),
        "runs": len({t.session_id for t in trajs}), "trajectories": len(trajs),
        "tokens": sum(s.num_tokens for s in samples),
        "reward_mean": _mean(rewards), "reward_std": _std(rewards),
        "staleness_mean": _mean(staleness), "staleness_max": max(staleness, default=0),
    }
    return Batch(samples=samples, stats=stats)


def _token_weights(trajs: list[Trajectory], config: GRPOConfig) -> list[float]:
    """The per-token normalisation coefficient of each trajectory, by loss_type (see config help)."""
    run_tokens: dict[str, int] = {}
    for t in trajs:
        run_tokens[t.session_id] = run_tokens.get(t.session_id, 0) + sum(t.loss_mask)
    runs = len(run_tokens)  # every trajectory here trains at least one token, so no count below is 0
    if config.loss_type == "dapo":
        total = sum(run_tokens.values())
        return [1.0 / total for _ in trajs]
    if config.loss_type == "dr_grpo":
        return [1.0 / (runs * config.max_completion_length) for _ in trajs]
    return [1.0 / (runs * run_tokens[t.session_id]) for t in trajs]  # grpo


def _sample(t: Trajectory, advantage: float, weight: float) -> Sample:
    mask = torch.tensor(t.loss_mask[1:], dtype=torch.float32)
    return Sample(
        input_ids=torch.tensor(t.token_ids, dtype=torch.long),
        weights=mask * weight,
        advantage=advantage,
        behavior_logprobs=torch.tensor(t.behavior_logprobs[1:], dtype=torch.float32),
        versions=torch.tensor(t.policy_versions[1:], dtype=torch.long),
        temperature=float(t.temperature),
        session_id=t.session_id,
    )


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _std(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
