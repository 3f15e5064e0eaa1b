"""Async GRPO: tokens of different policy versions in one batch, each weighted by its own behaviour logprob;
nothing staler than the bound reaches the loss; the trainer steps while rollouts keep running."""

import os

import pytest
import torch

from polar_lab.grpo import GRPOConfig, GRPOTrainer, build_batch
from polar_lab.grpo.policy import Policy
from polar_lab.grpo.rollouts import AsyncRollouts, TaskStream

from .conftest import BATCHING_NOISE, rollout


def test_mixed_versions_are_each_corrected_with_their_own_behaviour_logprobs(lab, model_path, train_tasks,
                                                                             restore_weights):
    config = GRPOConfig(learning_rate=1e-3, max_staleness=1, micro_batch_size=8)  # larger first Adam steps can collapse the tiny model
    policy = Policy(model_path, config)
    old_groups = rollout(lab, train_tasks[:3])  # sampled by version v
    policy.update(build_batch(old_groups, config, lab.policy_version).samples)
    lab.sync_weights(policy.state_dict())  # trainer and engine now at v+1
    new_groups = rollout(lab, train_tasks[3:11])  # sampled by version v+1

    batch = build_batch(old_groups + new_groups, config, lab.policy_version)
    versions = {int(v) for s in batch.samples for v in s.versions[s.weights > 0]}
    assert versions == {lab.policy_version - 1, lab.policy_version}, versions

    # expected log(π_old/μ) per trained token, from each token's own recorded logprob
    trainer = policy.logprobs(batch.samples)
    expected = {}
    for s, lp in zip(batch.samples, trainer):
        trained = s.weights > 0
        expected.setdefault(int(s.versions[trained][0]), []).append((lp - s.behavior_logprobs)[trained])
    stale = torch.cat(expected[lab.policy_version - 1])
    fresh = torch.cat(expected[lab.policy_version])
    assert fresh.abs().max() < 1e-3  # same weights: ratio 1 up to numerics
    assert stale.abs().max() > 5 * fresh.abs().max() and stale.abs().max() > 5e-3  # the older policy's tokens get a real correction

    stats = policy.update(batch.samples)
    got = torch.sort(stats.log_is).values
    want = torch.sort(torch.cat([stale, fresh])).values
    assert torch.allclose(got, want, atol=BATCHING_NOISE)


def test_groups_staler_than_the_bound_never_reach_the_loss(lab, train_tasks, shipped_weights, restore_weights):
    groups = rollout(lab, train_tasks[:3])
    for _ in range(2):
        lab.sync_weights(shipped_weights)  # two new versions: the groups are now 2 behind
    version = lab.policy_version
    blocked = build_batch(groups, GRPOConfig(max_staleness=1), version)
    allowed = build_batch(groups, GRPOConfig(max_staleness=2), version)
    assert blocked.samples == [] and blocked.stats["groups_stale"] == 3
    assert allowed.samples and allowed.stats["staleness_max"] == 2


def test_async_trainer_overlaps_rollouts_within_the_staleness_bound(lab, restore_weights, tmp_path):
    config = GRPOConfig(async_mode=True, max_staleness=1, tasks_per_step=2, num_generations=4,
                        learning_rate=1e-3, output_dir=str(tmp_path))
    threads = torch.get_num_threads()
    with GRPOTrainer(lab, config) as trainer:
        # the engine process steps beside the trainer: the trainer leaves it half the cores
        assert torch.get_num_threads() == max(1, (os.cpu_count() or 2) // 2)
        start = lab.policy_version
        steps = [trainer.step() for _ in range(3)]
        assert all(m["staleness_max"] <= 1 for m in steps), [m["staleness_max"] for m in steps]
        assert any(m["staleness_max"] == 1 for m in steps)  # later steps train on rollouts made during training
        trained = [m for m in steps if m["tokens"] > 0]
        assert lab.policy_version == start + len(trained)
        last = trainer.last_batch
        assert all(int(v) >= steps[-1]["trained_version"] - 1 for s in last.samples for v in s.versions[s.weights > 0])
    assert trainer.metrics.shape[0] == 3
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3
    assert torch.get_num_threads() == threads  # restored on close


def test_task_stream_cycles_in_a_seeded_order_and_reruns_come_first_up_to_the_cap():
    tasks = [{"q": i} for i in range(5)]
    a, b = TaskStream(tasks, seed=1), TaskStream(tasks, seed=1)
    assert a.take(7) == b.take(7)
    assert sorted(t["q"] for t in TaskStream(tasks, seed=2).take(5)) == [0, 1, 2, 3, 4]  # each once per epoch
    again = {"q": "again"}
    for _ in range(2):
        assert a.requeue(again, max_reruns=2)
        assert a.take(1) == [again]
    assert not a.requeue(again, max_reruns=2)  # a third stale group in a row: given up, not re-queued forever
    assert a.take(1) != [again]
    a.settled(again)  # a group of it reached the loss: the count starts again
    assert a.requeue(again, max_reruns=2) and a.take(1) == [again]


def test_a_second_async_trainer_stops_the_first_producer_and_closing_the_lab_stops_all(lab, restore_weights, tmp_path):
    """Re-running a notebook cell must not leave two producers feeding one engine."""
    config = GRPOConfig(async_mode=True, tasks_per_step=1, num_generations=2, output_dir=str(tmp_path))
    first = GRPOTrainer(lab, config)
    second = None
    try:
        first.step()
        producer = first._rollouts
        second = GRPOTrainer(lab, config)
        with pytest.warns(UserWarning, match="stopping the async rollouts of an earlier trainer"):
            second.step()
        assert producer._stopped and not second._rollouts._stopped
    finally:  # even when an assert fails: no producer may outlive this test on the shared Lab
        if second is not None:
            second.close()
        first.close()
    assert not lab.owned(GRPOTrainer) and not lab.owned(AsyncRollouts)
