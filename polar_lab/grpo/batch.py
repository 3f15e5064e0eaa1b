"""From Groups to a training batch: staleness filter → group-relative advantages → per-token weights.

Pure functions over `Group`/`Trajectory`; no model, no engine. The unit of GRPO here is a *run* (one
harness session), not a trajectory: a run's reward and advantage are shared by all the chains it yielded
(sub-agents, compaction), and loss normalisation counts runs, so a run that broke into three chains
weighs as much as one that did not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from polar_lab.grpo.config import GRPOConfig
from polar_lab.types import FAILURE_CAUSES, NO_SUPPORT, Group, Trajectory


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
    chain_index: int = 0  # which chain of its session (with session_id: the sample's name in a step's X-ray)
    support: torch.Tensor | None = None  # (L-1, 3) each target's (top_k, top_p, min_p); None = whole vocabulary
    teacher_logprobs: torch.Tensor | None = None  # (L-1,) a teacher engine's log p of each target (grpo/teacher.py)

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


def run_advantages(groups: list[Group], scale_rewards: str, eps: float = 1e-4,
                   masked: frozenset[str] | set[str] = frozenset(),
                   shaping: dict[str, float] | None = None) -> dict[str, float]:
    """session id → advantage (reward minus its group's mean, optionally over a std).

    Runs with reward None (crashed, timed out) and the `masked` ones are left out; `shaping` adds to a run's reward
    (DAPO's overlong punishment, `overlong_penalties`). Groups with fewer than two
    scored runs or with all rewards equal carry no signal and are skipped (absent from the result). The "batch"
    std is TRL's: over every scored reward of the groups, those without spread too.

    >>> from polar_lab.types import Session
    >>> g = Group(task={}, sessions=[Session(id=i, key="", reward=r) for i, r in (("a", 1.0), ("b", 0.0))])
    >>> run_advantages([g], "none")
    {'a': 0.5, 'b': -0.5}
    """
    shaping = shaping or {}
    scored = [[(s.id, s.reward + shaping.get(s.id, 0.0)) for s in g.sessions
               if s.reward is not None and s.id not in masked] for g in groups]
    batch_std = _std([r for runs in scored for _, r in runs])
    scored = [runs for runs in scored if _spread([r for _, r in runs])]
    out = {}
    for runs in scored:
        rewards = [r for _, r in runs]
        mean = sum(rewards) / len(rewards)
        scale = 1.0 if scale_rewards == "none" else {"group": _std(rewards), "batch": batch_std}[scale_rewards] + eps
        out.update({sid: (r - mean) / scale for sid, r in runs})
    return out


def build_batch(groups: list[Group], config: GRPOConfig, trainer_version: int) -> Batch:
    """Stale groups out, advantages in, one Sample per trajectory of an informative run.

    The loss normaliser is TRL's: it counts every scored run of the step's fresh groups (and its tokens),
    the runs of groups without reward spread included, though only informative runs get samples. A run
    masked for truncation counts as a run with no tokens, as a fully masked completion does in TRL."""
    fresh, stale = split_stale(groups, trainer_version, config.max_staleness)
    nonfinite = {t.session_id for g in fresh for t in g.trajectories if not _finite_behaviour(t)}
    penalties = overlong_penalties(fresh, config)
    advantages = run_advantages(fresh, config.scale_rewards, masked=nonfinite, shaping=penalties)
    scored = {s.id for g in fresh for s in g.sessions if s.reward is not None and s.id not in nonfinite}
    population = [t for g in fresh for t in g.trajectories if t.session_id in scored]
    truncated = {t.session_id for t in population if t.truncated} if config.mask_truncated_completions else set()
    if config.teacher_model:  # distilling: a run without advantage still learns the teacher's tokens (A = 0)
        advantages = {sid: advantages.get(sid, 0.0) for sid in scored}
    weight = _normaliser(scored, [t for t in population if t.session_id not in truncated], config)
    trajs = [t for t in population
             if t.session_id in advantages and t.session_id not in truncated and any(t.loss_mask)]
    samples = [_sample(t, advantages[t.session_id], weight(t.session_id)) for t in trajs]
    staleness = [trainer_version - v for t in trajs for v, m in zip(t.policy_versions, t.loss_mask) if m]
    rewards = [s.reward for g in groups for s in g.sessions if s.reward is not None]
    stats = {
        "groups": len(groups), "groups_stale": len(stale),
        "groups_zero_advantage": sum(not any(s.id in advantages for s in g.sessions) for g in fresh),
        "runs_nonfinite": len(nonfinite), "runs_scored": len(scored),
        "runs": len({t.session_id for t in trajs}), "trajectories": len(trajs),
        "retry_orphans": sum(len(t.info.get("retry_orphans", ())) for g in fresh for t in g.trajectories),
        "tokens": sum(s.num_tokens for s in samples),
        "reward_mean": _mean(rewards), "reward_std": _std(rewards),
        **({"overlong_penalty_mean": _mean(list(penalties.values())),  # with the punishment on only
            "overlong_frac": sum(p < 0 for p in penalties.values()) / len(penalties)} if penalties else {}),
        "staleness_mean": _mean(staleness), "staleness_max": max(staleness, default=0),
        # sampled tokens per run of the fresh groups, every run counted (as rollouts.dropped_stats counts them)
        "run_tokens_mean": _mean([sum(sum(t.loss_mask) for t in g.trajectories if t.session_id == s.id)
                                  for g in fresh for s in g.sessions]),
        **failure_stats(groups),
    }
    return Batch(samples=samples, stats=stats)


def informative(group: Group) -> bool:
    """Whether a group can give a gradient: two runs or more with a reward, not all the same (dynamic sampling keeps
    only these)."""
    return _spread([s.reward for s in group.sessions if s.reward is not None])


def _spread(rewards: list[float]) -> bool:
    """Two rewards or more, not all equal: a group advantage exists (run_advantages, dynamic sampling)."""
    return len(rewards) >= 2 and _std(rewards) > 0


def overlong_penalties(groups: list[Group], config: GRPOConfig) -> dict[str, float]:
    """session id → DAPO's soft overlong punishment of each scored run, added to its reward: 0 up to
    L − B sampled tokens (L = `overlong_limit`, B = `overlong_buffer_len`), then falling linearly to
    −`overlong_penalty_factor` at L and staying there. A run's length is what the policy sampled over all its calls.
    {} when the buffer is 0 (off).

    >>> c = GRPOConfig(max_completion_length=100, overlong_buffer_len=20)
    >>> [round(_overlong(n, c), 2) for n in (80, 90, 100, 130)]
    [0.0, -0.5, -1.0, -1.0]
    """
    if not config.overlong_buffer_len:
        return {}
    tokens: dict[str, int] = {}
    for g in groups:
        for t in g.trajectories:
            tokens[t.session_id] = tokens.get(t.session_id, 0) + sum(t.loss_mask)
    return {s.id: _overlong(tokens.get(s.id, 0), config) for g in groups for s in g.sessions if s.reward is not None}


def _overlong(length: int, config: GRPOConfig) -> float:
    start = config.overlong_limit - config.overlong_buffer_len
    return config.overlong_penalty_factor * max(-1.0, min(0.0, (start - length) / config.overlong_buffer_len))


def failure_stats(groups: list[Group]) -> dict[str, float]:
    """Failed runs by cause (rollout.failure_cause) as fractions of the step's runs, and the largest fraction of
    failed runs in one group (a task every run of which hangs or overflows shows up here)."""
    runs = [s for g in groups for s in g.sessions]
    causes = [s.info.get("failure") for s in runs]
    stats = {f"fail_{cause}_frac": causes.count(cause) / max(len(runs), 1) for cause in FAILURE_CAUSES}
    failed = [sum(s.status != "closed" for s in g.sessions) / len(g.sessions) for g in groups if g.sessions]
    return {**stats, "group_fail_frac_max": max(failed, default=0.0)}


def _finite_behaviour(t: Trajectory) -> bool:
    """Every trained token has a finite sampler logprob. A NaN or inf one would make its TIS weight, the loss
    and every gradient non-finite: such a run is masked (like a crashed one) and counted."""
    return all(math.isfinite(lp) for lp, m in zip(t.behavior_logprobs, t.loss_mask) if m)


def _normaliser(scored: set[str], counted: list[Trajectory], config: GRPOConfig) -> Callable[[str], float]:
    """session id → the per-token coefficient of its trained tokens, by loss_type (TRL's definitions):
        dapo      1 / (sampled tokens of every scored run)           (cispo too)
        dr_grpo   1 / (scored runs × max_completion_length)
        grpo      1 / (scored runs × sampled tokens of this run)
    `counted` are the trajectories whose tokens count. Only runs with a trained token ask, so no count is 0."""
    run_tokens = dict.fromkeys(scored, 0)
    for t in counted:
        run_tokens[t.session_id] += sum(t.loss_mask)
    runs, total = len(scored), sum(run_tokens.values())
    if config.loss_type in ("dapo", "cispo"):
        return lambda sid: 1.0 / total
    if config.loss_type == "dr_grpo":
        return lambda sid: 1.0 / (runs * config.max_completion_length)
    return lambda sid: 1.0 / (runs * run_tokens[sid])  # grpo


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
        chain_index=t.chain_index,
        support=torch.tensor(t.sampling_support[1:], dtype=torch.float32)
        if any(s != NO_SUPPORT for s in t.sampling_support) else None,
    )


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _std(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


# ---- micro-batches: what one forward/backward pass of the trainer takes ---------------------------------------
def micro_batches(samples: list[Sample], config: GRPOConfig, pad_id: int,
                  device: torch.device | str) -> list[dict[str, torch.Tensor]]:
    """Sorted by length so padding stays small; `micro_batch_size` sequences each, or, with
    `micro_batch_tokens`, as many as fit that many padded tokens (a longer sample goes alone)."""
    return [collate(group, pad_id, device) for group in micro_batch_groups(samples, config)]


def micro_batch_groups(samples: list[Sample], config: GRPOConfig) -> list[list[Sample]]:
    """The samples of each micro-batch, in `micro_batches`' order (the X-ray maps each row back to its sample)."""
    order = sorted(samples, key=lambda s: len(s.input_ids))
    return token_budget_groups([len(s.input_ids) for s in order], config.micro_batch_size,
                               config.micro_batch_tokens, order)


def same_count_on_every_rank(micro: list[dict[str, torch.Tensor]],
                             device: torch.device | str) -> list[dict[str, torch.Tensor]]:
    """Ranks must run the same number of forward/backward passes: each FSDP layer's gather and gradient
    reduce-scatter, and DDP's buffer broadcast, are collectives. A rank with fewer micro-batches (its shard
    is shorter, or splits differently under `micro_batch_tokens`) adds copies of its last one with every
    weight zero, which change nothing in the loss. Outside a process group: `micro` as it is."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return micro
    count = torch.tensor([len(micro)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    blank = {**micro[-1], "weights": torch.zeros_like(micro[-1]["weights"]),
             "advantage": torch.zeros_like(micro[-1]["advantage"])}
    return micro + [blank] * (int(count) - len(micro))


def collate(samples: list[Sample], pad_id: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Samples padded to the longest, as the tensors the loss reads: input_ids and attention_mask (B, T); the
    per-token loss weights and behaviour logprobs (B, T-1); each sample's advantage and temperature (B,)."""
    width = max(len(s.input_ids) for s in samples)

    def pad(t: torch.Tensor, n: int, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, n - len(t)), value=value)

    batch = {
        "input_ids": torch.stack([pad(s.input_ids, width, pad_id) for s in samples]),  # (B, T)
        "attention_mask": torch.stack([pad(torch.ones(len(s.input_ids), dtype=torch.long), width, 0)
                                       for s in samples]),
        "weights": torch.stack([pad(s.weights, width - 1, 0.0) for s in samples]),  # (B, T-1)
        "behavior": torch.stack([pad(s.behavior_logprobs, width - 1, 0.0) for s in samples]),
        "advantage": torch.tensor([s.advantage for s in samples], dtype=torch.float32),  # (B,)
        "temperature": torch.tensor([s.temperature for s in samples], dtype=torch.float32),
    }
    if any(s.support is not None for s in samples):  # the supports the engine sampled within (loss.py replays them)
        neutral = torch.tensor(NO_SUPPORT, dtype=torch.float32)
        batch["support"] = torch.stack([
            torch.cat([s.support if s.support is not None else neutral.expand(len(s.input_ids) - 1, 3),
                       neutral.expand(width - len(s.input_ids), 3)]) for s in samples])  # (B, T-1, 3)
    if any(s.teacher_logprobs is not None for s in samples):  # scored by a teacher engine before the update
        batch["teacher"] = torch.stack([pad(s.teacher_logprobs, width - 1, 0.0) for s in samples])  # (B, T-1)
    return {k: v.to(device) for k, v in batch.items()}


def token_budget_groups(lengths: list[int], size: int, budget: int | None, items: list) -> list[list]:
    """`items` (sorted by their `lengths`, ascending) in consecutive groups: `size` each, or, with a token
    `budget`, as many as keep (count × the longest) within it; an item over the budget alone.

    >>> token_budget_groups([2, 3, 5, 9], 32, 10, "abcd")  # 2 × 3 fits 10; 2 × 5 does not; 9 alone
    [['a', 'b'], ['c'], ['d']]
    >>> token_budget_groups([2, 3, 5, 9], 2, None, "abcd")
    [['a', 'b'], ['c', 'd']]
    """
    if any(a > b for a, b in zip(lengths, lengths[1:])):
        raise ValueError("token_budget_groups needs items sorted by length (the last of a group is its longest)")
    if budget is None:
        return [list(items[i:i + size]) for i in range(0, len(items), size)]
    groups, current = [], []
    for length, item in zip(lengths, items):
        if current and (len(current) + 1) * length > budget:
            groups.append(current)
            current = []
        current.append(item)
    return groups + ([current] if current else [])
