"""Trainer ranks as worker processes (DDP over gloo on CPU): 2 ranks make the same update as 1."""

import json
import os
import signal
import time

import pytest
import torch

from polar_lab.grpo import GRPOConfig, build_batch
from polar_lab.grpo.distributed import DistributedPolicy, TrainerError, shard
from polar_lab.grpo.batch import Sample
from polar_lab.grpo.policy import Policy

from .conftest import rollout, same_loss


def test_two_ranks_make_the_same_update_as_one(lab, model_path, train_tasks):
    config = GRPOConfig(learning_rate=1e-3, micro_batch_size=8)  # several micro-batches per rank
    batch = build_batch(rollout(lab, train_tasks[:4]), config, lab.policy_version)
    assert len(batch.samples) >= 8, batch.stats

    single = Policy(model_path, config)
    start = single.state_dict()
    one = single.update(batch.samples)
    after_one = single.state_dict()

    ranks = DistributedPolicy(model_path, GRPOConfig(learning_rate=1e-3, micro_batch_size=8, world_size=2))
    try:
        two = ranks.update(batch.samples)
        after_two = ranks.state_dict()
    finally:
        ranks.close()

    assert two.tokens == one.tokens == batch.stats["tokens"]  # every token trained once, on some rank
    assert same_loss(two.loss, one.loss)
    assert two.grad_norm == pytest.approx(one.grad_norm, rel=1e-4)
    for name in after_one:
        step = (after_one[name] - start[name]).norm()
        gap = (after_one[name] - after_two[name]).norm()
        # Adam's first step moves a weight by lr * g / (|g| + eps): where |g| is near eps, the ranks' float sums,
        # which differ only in rounding, move that one weight by a few % of lr, so the whole tensor's step is compared
        assert gap <= 1e-3 * step + 1e-7, f"{name}: 1 vs 2 ranks differ by {gap:.2e}, the step is {step:.2e}"


def _sample(length: int, name: str) -> Sample:
    return Sample(input_ids=torch.arange(length), weights=torch.ones(length - 1), advantage=1.0,
                  behavior_logprobs=torch.zeros(length - 1), versions=torch.zeros(length - 1, dtype=torch.long),
                  temperature=1.0, session_id=name)


def test_shards_cover_every_sample_once_and_no_rank_is_empty():
    samples = [_sample(n, f"s{n}") for n in (9, 3, 7, 5, 4)]
    parts = shard(samples, 3)
    real = [s for p in parts for s in p if s.session_id != "padding"]
    assert sorted(map(id, real)) == sorted(map(id, samples))
    assert all(parts) and [len(p) for p in parts] == [2, 2, 1]  # dealt round-robin by length
    lonely = shard(samples[:1], 2)
    assert lonely[1][0].session_id == "padding" and float(lonely[1][0].weights.sum()) == 0.0


def test_a_rank_starts_with_what_its_policy_imports_already_imported(tmp_path):
    """Ranks fork from a server that imported what building a Policy needs (RANK_PRELOAD), so each rank does not
    import transformers' model classes and scheduler itself (~2.8 s of CPU per rank here). The server imported them
    with the garbage collector off and froze them (grpo/rank_preload.py): a rank has them frozen and the collector on."""
    from polar_lab.grpo.distributed import rank_context

    check = ("import gc, json, sys; before = set(sys.modules); "
             "from transformers import AutoModelForCausalLM, get_scheduler; "
             "json.dump({'new': sorted(set(sys.modules) - before), 'collector': gc.isenabled(), "
             f"'frozen': gc.get_freeze_count()}}, open({str(tmp_path / 'rank.json')!r}, 'w'))")
    rank = rank_context().Process(target=exec, args=(check,))  # a builtin: the rank imports no test module
    rank.start()
    rank.join(120)
    assert rank.exitcode == 0
    seen = json.loads((tmp_path / "rank.json").read_text())
    assert seen["new"] == [] and seen["collector"] is True
    assert seen["frozen"] > 100_000  # torch's and transformers' objects (~708k here), not a handful


def test_a_rank_that_cannot_start_is_an_error_not_a_hang(tmp_path):
    with pytest.raises(TrainerError, match="trainer rank"):
        DistributedPolicy(str(tmp_path / "no-model"), GRPOConfig(world_size=2), start_timeout=120)


def _update_in_thread(ranks, samples):
    """ranks.update in a thread: (the exception it raised or None, seconds it took), or a hang's timeout."""
    import threading

    outcome = {}

    def run():
        t0 = time.monotonic()
        try:
            ranks.update(samples)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "update() hung: a rank that stops answering must become an error"
    return outcome.get("error"), outcome["seconds"]


@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_a_rank_that_dies_or_hangs_is_an_error_not_a_hang(lab, model_path, train_tasks, fault):
    batch = build_batch(rollout(lab, train_tasks[:2], n=4), GRPOConfig(), lab.policy_version)
    ranks = DistributedPolicy(model_path, GRPOConfig(world_size=2), step_timeout=10)
    procs = list(ranks._procs)
    victim = procs[1].pid
    try:
        os.kill(victim, signal.SIGKILL if fault == "dies" else signal.SIGSTOP)  # SIGSTOP: alive, silent
        error, seconds = _update_in_thread(ranks, batch.samples)
        assert isinstance(error, TrainerError), error
        assert ("died" in str(error)) if fault == "dies" else ("did not answer within 10 s" in str(error))
        assert seconds < 60
        with pytest.raises(TrainerError, match="ranks are stopped"):  # their pipes are out of step: no reuse
            ranks.state_dict()
    finally:
        ranks.close(timeout=2)
    assert not any(p.is_alive() for p in procs)  # close() killed what was left, the stopped rank included


def test_ddp_ranks_save_a_training_state_one_rank_resumes(lab, model_path, train_tasks, tmp_path):
    batch = build_batch(rollout(lab, train_tasks[:2]), GRPOConfig(), lab.policy_version)
    ranks = DistributedPolicy(model_path, GRPOConfig(learning_rate=1e-3, world_size=2))
    try:
        ranks.update(batch.samples)
        ranks.save_training_state(tmp_path / "state")
        saved = ranks.state_dict()
        ranks.update(batch.samples)  # the step a resumed run must repeat: Adam's second, from its moments
        expected = ranks.state_dict()
    finally:
        ranks.close()
    one = Policy(model_path, GRPOConfig(learning_rate=1e-3))
    one.load_training_state(str(tmp_path / "state"))
    assert one.steps == 1 and all(torch.equal(one.state_dict()[k], v) for k, v in saved.items())
    one.update(batch.samples)
    after = one.state_dict()
    for name in saved:
        step = (expected[name] - saved[name]).abs().max()
        gap = (expected[name] - after[name]).abs().max()
        assert gap <= 0.05 * step + 1e-7, f"{name}: resumed step differs by {gap:.2e}, the step is {step:.2e}"
