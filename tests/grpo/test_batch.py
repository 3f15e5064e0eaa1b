"""From groups to a batch: advantages per run, zero-signal groups skipped, per-token weights by loss_type,
the staleness bound. Hand-made trajectories: this layer is pure data (real ones are in the integration tests)."""

import itertools

import pytest
import torch

from polar_lab.grpo import GRPOConfig, build_batch, run_advantages, split_stale
from polar_lab.grpo.batch import failure_stats
from polar_lab.types import Group, Session, Trajectory


def _traj(session_id, sampled, version=0, chain=0, truncated=False):
    """A prompt of 3 tokens then `sampled` generated tokens at `version`."""
    return Trajectory(session_id=session_id, chain_index=chain, token_ids=list(range(3 + sampled)),
                      loss_mask=[0] * 3 + [1] * sampled, behavior_logprobs=[0.0] * 3 + [-0.5] * sampled,
                      policy_versions=[-1] * 3 + [version] * sampled,
                      info={"temperature": 1.0, **({"truncated": True} if truncated else {})})


_ids = itertools.count()


def _group(rewards, sampled=4, version=0):
    """Closed runs with these rewards; a None reward is a run that crashed (masked)."""
    sessions = [Session(id=f"s{next(_ids)}", key="", reward=r, status="closed" if r is not None else "error",
                        info={} if r is not None else {"failure": "crash"}) for r in rewards]
    return Group(task={}, sessions=sessions, trajectories=[_traj(s.id, sampled, version) for s in sessions])


ADVANTAGES = [  # (rewards, scale, expected advantages)
    ([1.0, 0.0], "none", [0.5, -0.5]),
    ([1.0, 1.0, 0.0, 0.0], "group", [0.866, 0.866, -0.866, -0.866]),  # (r - mean) / (sample std 0.577 + eps)
    ([1.0, None, 0.0], "none", [0.5, None, -0.5]),  # a crashed run (None) is out, not scored 0
]


@pytest.mark.parametrize("rewards,scale,expected", ADVANTAGES)
def test_group_relative_advantages(rewards, scale, expected):
    g = _group(rewards)
    adv = run_advantages([g], scale)
    got = [adv.get(s.id) for s in g.sessions]
    assert got == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize("rewards", [[1.0, 1.0, 1.0], [0.0, 0.0], [1.0, None]])
def test_groups_without_signal_are_skipped(rewards):
    assert run_advantages([_group(rewards)], "group") == {}


def test_batch_scaling_uses_one_std_for_all_groups():
    a, b = _group([1.0, 0.0]), _group([4.0, 0.0])
    adv = run_advantages([a, b], "batch")
    # both groups share one divisor: the advantages keep the 1:4 proportion of the raw gaps
    assert adv[b.sessions[0].id] / adv[a.sessions[0].id] == pytest.approx(4.0, rel=1e-3)


def _two_chain_batch(loss_type):
    """Run x: 2 chains of 4 and 2 tokens; run y: 1 chain of 4 tokens. Rewards differ (one informative group)."""
    x, y = Session(id="x", key="", reward=1.0), Session(id="y", key="", reward=0.0)
    group = Group(task={}, sessions=[x, y],
                  trajectories=[_traj("x", 4), _traj("x", 2, chain=1), _traj("y", 4)])
    config = GRPOConfig(loss_type=loss_type, max_completion_length=10, scale_rewards="none")
    return build_batch([group], config, trainer_version=0)


@pytest.mark.parametrize("loss_type,per_token", [
    ("dapo", [1 / 10, 1 / 10, 1 / 10]),  # every trained token of the batch weighs the same
    ("grpo", [1 / (2 * 6), 1 / (2 * 6), 1 / (2 * 4)]),  # mean over the run's tokens (both chains), then runs
    ("dr_grpo", [1 / (2 * 10)] * 3),  # constant: runs x max_completion_length
])
def test_loss_normalisation_counts_runs_not_chains(loss_type, per_token):
    batch = _two_chain_batch(loss_type)
    weights = [float(s.weights[s.weights > 0][0]) for s in batch.samples]
    assert weights == pytest.approx(per_token)
    assert batch.stats["runs"] == 2 and batch.stats["trajectories"] == 3
    assert [s.advantage for s in batch.samples] == [0.5, 0.5, -0.5]  # both chains of x share its advantage


def test_weights_sit_exactly_on_sampled_tokens():
    batch = _two_chain_batch("dapo")
    for sample in batch.samples:
        n = len(sample.input_ids)
        assert len(sample.weights) == len(sample.behavior_logprobs) == len(sample.versions) == n - 1
        assert (sample.weights[:2] == 0).all() and (sample.weights[2:] > 0).all()  # targets 3.. were sampled


def test_staleness_beyond_the_bound_never_reaches_the_batch():
    fresh, old = _group([1.0, 0.0], version=5), _group([1.0, 0.0], version=3)
    kept, stale = split_stale([fresh, old], trainer_version=5, max_staleness=1)
    assert kept == [fresh] and stale == [old]
    batch = build_batch([fresh, old], GRPOConfig(max_staleness=1), trainer_version=5)
    assert {s.session_id for s in batch.samples} == {s.id for s in fresh.sessions}
    assert batch.stats["groups_stale"] == 1 and batch.stats["staleness_max"] == 0


def test_truncated_runs_are_masked_when_asked():
    g = _group([1.0, 0.0, 1.0])
    g.trajectories[0].truncated = True
    on = build_batch([g], GRPOConfig(mask_truncated_completions=True), 0)
    off = build_batch([g], GRPOConfig(mask_truncated_completions=False), 0)
    assert g.sessions[0].id not in {s.session_id for s in on.samples}
    assert g.sessions[0].id in {s.session_id for s in off.samples}


def test_the_batch_statistics_by_hand():
    import math
    import statistics

    import torch

    informative, alike, crashed = _group([1.0, 0.0]), _group([1.0, 1.0]), _group([1.0, None, 0.0])
    stale = _group([1.0, 0.0], version=-1)
    batch = build_batch([informative, alike, crashed, stale], GRPOConfig(max_staleness=1, scale_rewards="none"),
                        trainer_version=1)
    rewards = [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0]  # every scored run, stale ones included
    assert batch.stats == pytest.approx({
        "groups": 4, "groups_stale": 1, "groups_zero_advantage": 1, "runs_nonfinite": 0, "runs_scored": 6,
        "runs": 4, "trajectories": 4, "retry_orphans": 0, "tokens": 16,
        "reward_mean": statistics.mean(rewards), "reward_std": statistics.stdev(rewards),
        "staleness_mean": 1.0, "staleness_max": 1, "run_tokens_mean": 4.0,  # 7 fresh runs of 4 tokens each
        # 9 runs, one crashed, in a group of 3
        "fail_crash_frac": 1 / 9, "fail_timeout_frac": 0.0, "fail_overflow_frac": 0.0,
        "fail_infrastructure_frac": 0.0, "fail_masked_frac": 0.0, "group_fail_frac_max": 1 / 3})
    sample = batch.samples[0]
    assert (sample.input_ids.dtype, sample.versions.dtype) == (torch.long, torch.long)
    assert (sample.weights.dtype, sample.behavior_logprobs.dtype) == (torch.float32, torch.float32)
    assert sample.temperature == 1.0 and isinstance(sample.temperature, float)

    empty = build_batch([_group([1.0, None])], GRPOConfig(), trainer_version=0)  # nothing to train on
    assert empty.samples == [] and empty.stats["tokens"] == 0 and empty.stats["reward_std"] == 0.0
    assert empty.stats["staleness_max"] == 0 and math.isnan(empty.stats["staleness_mean"])
    assert math.isnan(build_batch([], GRPOConfig(), trainer_version=0).stats["reward_mean"])


def test_a_group_without_sampled_tokens_is_never_stale():
    from polar_lab.grpo.batch import group_staleness

    nothing = Group(task={}, sessions=[Session(id="x", key="", reward=None)], trajectories=[])
    assert group_staleness(nothing, trainer_version=5) == 0
    assert split_stale([nothing], trainer_version=5, max_staleness=0) == ([nothing], [])


def test_group_scaled_advantages_divide_by_the_std_plus_eps_exactly():
    import math

    g = _group([1.0, 0.0])
    adv = run_advantages([g], "group", eps=1e-4)
    assert adv[g.sessions[0].id] == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-4), rel=1e-12)


def test_zero_advantage_groups_are_counted():
    groups = [_group([1.0, 0.0]), _group([1.0, 1.0]), _group([0.0, 0.0])]
    assert build_batch(groups, GRPOConfig(), trainer_version=0).stats["groups_zero_advantage"] == 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_run_with_a_non_finite_behaviour_logprob_is_masked_and_counted(bad):
    g = _group([1.0, 0.0, 0.5])
    g.trajectories[0].behavior_logprobs[-1] = bad  # one trained token of run 0
    batch = build_batch([g], GRPOConfig(scale_rewards="none"), trainer_version=0)
    assert batch.stats["runs_nonfinite"] == 1
    assert [s.session_id for s in batch.samples] == [g.sessions[1].id, g.sessions[2].id]
    assert [s.advantage for s in batch.samples] == pytest.approx([-0.25, 0.25])  # the baseline leaves run 0 out


def test_a_non_finite_logprob_where_nothing_is_trained_is_harmless():
    g = _group([1.0, 0.0])
    g.trajectories[0].behavior_logprobs[0] = float("nan")  # a prompt position (mask 0)
    assert build_batch([g], GRPOConfig(), trainer_version=0).stats["runs_nonfinite"] == 0


def _trl_objective(groups, loss_type, scale_rewards, max_completion_length):
    """TRL's GRPO objective written out from its definition, for per-token losses ℓ_t = A·t (t = 1..n, the
    token's place in its completion; any values that differ along a completion would do): one completion per
    run, A = (r - group mean) / (std + 1e-4) with the std of the group or of the whole batch, then Σ_t ℓ_t
    normalised per sequence and averaged (grpo), over all tokens (dapo), or by sequences × L (dr_grpo)."""
    import torch

    rewards = torch.tensor([[s.reward for s in g.sessions] for g in groups])
    lengths = torch.tensor([[sum(t.loss_mask) for t in g.trajectories] for g in groups], dtype=torch.float32)
    std = rewards.std(1, keepdim=True) if scale_rewards == "group" else rewards.flatten().std()
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (std + 1e-4)).flatten()
    n = lengths.flatten()
    per_sequence = adv * n * (n + 1) / 2  # Σ_{t=1..n} A·t
    if loss_type == "grpo":
        return (per_sequence / n).mean().item()
    if loss_type == "dapo":
        return (per_sequence.sum() / n.sum()).item()
    return (per_sequence.sum() / (len(n) * max_completion_length)).item()


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("scale_rewards", ["group", "batch"])
def test_a_batch_with_saturated_groups_is_normalised_as_trl_does(loss_type, scale_rewards):
    groups = [_group([1.0, 0.0, 0.0, 1.0]), _group([1.0, 1.0, 1.0, 1.0]), _group([0.0, 0.0, 0.0, 0.0]),
              _group([1.0, 0.0, 0.0, 0.5])]
    for i, t in enumerate(t for g in groups for t in g.trajectories):  # completions of 1 to 7 tokens
        n = 1 + (i * 5) % 7
        t.token_ids, t.loss_mask = list(range(3 + n)), [0] * 3 + [1] * n
        t.behavior_logprobs, t.policy_versions = [0.0] * 3 + [-0.5] * n, [-1] * 3 + [0] * n
    config = GRPOConfig(loss_type=loss_type, scale_rewards=scale_rewards, max_completion_length=16)
    batch = build_batch(groups, config, trainer_version=0)
    assert batch.stats["groups_zero_advantage"] == 2 and batch.stats["runs_scored"] == 16
    objective = 0.0
    for s in batch.samples:  # Σ_t c_t · A · t over each sample's trained tokens, c_t = the batch's weights
        trained = s.weights[s.weights > 0]
        objective += float((trained * s.advantage * (1 + torch.arange(len(trained)))).sum())
    assert objective == pytest.approx(_trl_objective(groups, loss_type, scale_rewards, 16), rel=1e-6)


def test_failure_fractions_by_cause_and_the_worst_group():
    alone = Group(task={}, sessions=[Session(id="x", key="", status="timeout", info={"failure": "timeout"})])
    stats = failure_stats([alone, _group([1.0, 0.0, None, None])])  # 5 runs: 1 timeout, 2 crashes
    assert stats == pytest.approx({"fail_timeout_frac": 1 / 5, "fail_crash_frac": 2 / 5, "fail_overflow_frac": 0.0,
                                   "fail_infrastructure_frac": 0.0, "fail_masked_frac": 0.0, "group_fail_frac_max": 1.0})
    assert failure_stats([alone])["fail_timeout_frac"] == 1.0  # one run, and it failed
    assert failure_stats([]) == dict.fromkeys(stats, 0.0)  # a step without runs: no failures, not NaN


def test_the_overlong_punishment_ranks_equal_rewards_by_length():
    """DAPO's soft punishment: L = 10 sampled tokens, buffer 4 → free up to 6, then -1/4 per token to -1 at 10."""
    sessions = [Session(id=f"o{i}", key="", reward=1.0, status="closed") for i in range(3)]
    group = Group(task={}, sessions=sessions, trajectories=[_traj("o0", 5), _traj("o1", 8), _traj("o2", 12)])
    config = GRPOConfig(max_completion_length=10, overlong_buffer_len=4, scale_rewards="none", loss_type="grpo")
    batch = build_batch([group], config, trainer_version=0)
    shaped = [1.0, 1.0 - 0.5, 1.0 - 1.0]  # 5 tokens: 0; 8: (6 - 8) / 4; 12: capped at -1
    mean = sum(shaped) / 3
    by_length = {s.num_tokens: s.advantage for s in batch.samples}
    assert by_length == pytest.approx({5: shaped[0] - mean, 8: shaped[1] - mean, 12: shaped[2] - mean})
    assert batch.stats["overlong_frac"] == pytest.approx(2 / 3)
    assert batch.stats["overlong_penalty_mean"] == pytest.approx((0.0 - 0.5 - 1.0) / 3)
    off = build_batch([group], GRPOConfig(max_completion_length=10), trainer_version=0)
    assert off.samples == [] and off.stats["groups_zero_advantage"] == 1  # the control: equal rewards, no signal


def test_with_a_teacher_a_group_without_spread_still_trains_at_advantage_zero():
    """Distilling, the teacher's per-token term teaches every run: none is skipped for lack of reward spread."""
    group = _group([1.0, 1.0])
    assert build_batch([group], GRPOConfig(), trainer_version=0).samples == []  # the control
    batch = build_batch([group], GRPOConfig(teacher_model="data/models/tiny-calc"), trainer_version=0)
    assert [s.advantage for s in batch.samples] == [0.0, 0.0]
