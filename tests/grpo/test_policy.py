"""Policy.update: a second pass clips and a reference model adds KL (real rollouts); a NaN step is skipped; dropout
off; the optimiser's groups and schedule; training samples the distribution the loss assumes."""

import dataclasses
import math

import pytest

from polar_lab.grpo import GRPOConfig, build_batch
from polar_lab.grpo.policy import Policy

from .conftest import rollout


def test_a_second_pass_over_the_batch_clips_and_the_reference_model_adds_kl(lab, model_path, train_tasks):
    config = GRPOConfig(num_iterations=2, learning_rate=1e-2, beta=0.1, epsilon=0.05, epsilon_high=0.05)
    batch = build_batch(rollout(lab, train_tasks[:4]), config, lab.policy_version)
    assert batch.samples, batch.stats
    policy = Policy(model_path, config)
    assert policy.scorers.ref is not None
    first = policy.update(batch.samples)
    assert first.iterations == 2 and first.kl_sum == 0.0  # pass 1 starts at the reference: k3 is exactly 0
    assert first.metrics()["clip_frac"] > 0  # pass 2 runs after a step: ratios leave [1-ε, 1+ε]
    second = policy.update(batch.samples)
    assert second.kl_sum > 0 and second.metrics()["kl"] > 0  # the policy has moved away from the reference
    assert second.loss != second.pg_loss  # the KL term is in the loss (β > 0)


def _hand_batch(n_runs=2, sampled=4):
    """A batch of hand-made trajectories (prompt 3 tokens, `sampled` generated) with rewards 1, 0, ..."""
    from polar_lab.types import Group, Session, Trajectory

    sessions = [Session(id=f"r{i}", key="", reward=float(i % 2 == 0)) for i in range(n_runs)]
    trajs = [Trajectory(session_id=s.id, chain_index=0, token_ids=[5 + i for i in range(3 + sampled)],
                        loss_mask=[0] * 3 + [1] * sampled, behavior_logprobs=[0.0] * 3 + [-2.0] * sampled,
                        policy_versions=[-1] * 3 + [0] * sampled) for s in sessions]
    return build_batch([Group(task={}, sessions=sessions, trajectories=trajs)], GRPOConfig(), trainer_version=0)


def test_a_non_finite_gradient_skips_the_step_and_leaves_the_weights_as_they_were(model_path):
    import torch

    policy = Policy(model_path, GRPOConfig(learning_rate=1e-2))
    samples = _hand_batch().samples
    samples[0].behavior_logprobs[-1] = float("nan")  # past the batch's own guard: the policy must hold too
    before = policy.state_dict()
    stats = policy.update(samples)
    assert (stats.skipped, stats.stepped) == (1, False) and stats.metrics()["skipped_steps"] == 1
    after = policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(v).all() for v in after.values())
    samples[0].behavior_logprobs[-1] = -2.0  # the same batch, finite: the step is taken
    stats = policy.update(samples)
    assert stats.stepped and not torch.equal(before["lm_head.weight"], policy.state_dict()["lm_head.weight"])


def test_dropout_is_off_in_every_logprob_pass(model_path, tmp_path):
    import json
    import shutil

    import torch

    folder = tmp_path / "with-dropout"
    shutil.copytree(model_path, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    policy = Policy(str(folder), GRPOConfig())
    assert policy.model.training  # train mode stays (gradient checkpointing needs it)
    samples = _hand_batch().samples
    first, second = policy.logprobs(samples), policy.logprobs(samples)
    policy.model.eval()
    reference = policy.logprobs(samples)
    assert all(torch.equal(a, b) and torch.allclose(a, r, atol=1e-6) for a, b, r in zip(first, second, reference))


async def _truncating_agent(session, task):
    """A harness with its own sampling habits: nucleus and top-k truncation, penalties, a logit bias."""
    import openai

    client = openai.AsyncOpenAI(base_url=session.openai_base_url, api_key=session.api_key)
    reply = await client.chat.completions.create(
        model="tiny-calc", messages=[{"role": "user", "content": task["question"]}], max_tokens=48, top_p=0.8,
        presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"11": 3}, extra_body={"top_k": 20})
    return {"text": reply.choices[0].message.content}


def test_forced_training_sessions_sample_the_full_distribution_whatever_the_harness_asks(
        lab, model_path, shipped_weights, restore_weights, train_tasks):
    import torch
    from transformers import AutoModelForCausalLM

    from polar_lab.grpo.rollouts import rollout_sampling
    from polar_lab.trajectory import fidelity

    lab.sync_weights(shipped_weights)  # the engine samples with the weights the trainer model holds
    groups = lab.rollout(train_tasks[:2], _truncating_agent, num_generations=4, evaluator="final_answer",
                         sampling=rollout_sampling(GRPOConfig(sampling_support="force")), progress=False)
    calls = lab.call_records(session_ids=[s.id for g in groups for s in g.sessions])
    assert len(calls) == 8
    for call in calls:  # applied: the full distribution; recorded: what the harness asked for
        assert (call.sampling["top_p"], call.sampling["top_k"]) == (1.0, -1)
        assert (call.sampling["presence_penalty"], call.sampling["frequency_penalty"]) == (0.0, 0.0)
        assert call.sampling["logit_bias"] == {}
        assert call.sampling["overridden"] == {"top_p": 0.8, "top_k": 20, "presence_penalty": 0.5,
                                               "frequency_penalty": 0.3, "logit_bias": {"11": 3.0}}
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    check = fidelity([t for g in groups for t in g.trajectories], model)
    # on-policy, num_iterations=1: the TIS weight exp(log π_old − log μ) is 1 for every token
    assert (check.trained_tokens > 0).all() and check.max_abs_diff.max() < 1e-4, check


def test_weight_decay_spares_biases_norms_and_embeddings_and_the_kernels_rng_is_left_alone(model_path):
    import torch

    state = torch.get_rng_state()
    policy = Policy(model_path, GRPOConfig(weight_decay=0.1))
    assert torch.equal(torch.get_rng_state(), state)
    decay, keep = policy.optimizer.param_groups
    assert (decay["weight_decay"], keep["weight_decay"]) == (0.1, 0.0)
    names = {id(p): n for n, p in policy.model.named_parameters()}
    assert decay["params"] and all(p.ndim == 2 and "embed" not in names[id(p)] for p in decay["params"])
    kept = {names[id(p)] for p in keep["params"]}
    assert any("norm" in n for n in kept) and any("embed" in n for n in kept)
    assert len(decay["params"]) + len(keep["params"]) == len(names)


def test_the_learning_rate_warms_up_then_follows_its_schedule(model_path):
    policy = Policy(model_path, GRPOConfig(learning_rate=1e-3, lr_scheduler_type="linear", warmup_ratio=0.25,
                                           max_steps=8))
    samples = _hand_batch().samples
    lrs = []
    for _ in range(8):
        lrs.append(policy.optimizer.param_groups[0]["lr"])
        policy.update(samples)
    # 2 warm-up steps from 0, then linear decay to 0 over the remaining 6
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 1e-3 * 5 / 6, 1e-3 * 4 / 6, 1e-3 * 3 / 6, 1e-3 * 2 / 6, 1e-3 / 6])
    constant = Policy(model_path, GRPOConfig(learning_rate=1e-3))
    constant.update(samples)
    assert constant.optimizer.param_groups[0]["lr"] == 1e-3


def _varied_batch():
    """Samples of different lengths and temperatures, so micro-batching and chunking have something to split."""
    batch = _hand_batch(n_runs=4, sampled=9)
    for i, s in enumerate(batch.samples):
        s.temperature = 1.0 if i % 2 else 0.7
    batch.samples[0].input_ids = batch.samples[0].input_ids[:8]  # one shorter chain
    batch.samples[0].weights = batch.samples[0].weights[:7]
    batch.samples[0].behavior_logprobs = batch.samples[0].behavior_logprobs[:7]
    return batch.samples


@pytest.mark.parametrize("variant", [
    {"logprob_chunk_tokens": 5},  # the lm_head 5 positions at a time, each chunk recomputed in backward
    {"gradient_checkpointing": True},  # every layer recomputed in backward
    {"micro_batch_tokens": 24},  # micro-batches by padded tokens: the short chain padded beside a long one
    {"micro_batch_size": 1},  # the control for the last: any split of the batch gives the same update
])
def test_memory_savers_give_the_same_loss_and_gradients(model_path, variant):
    """Each way of spending less memory computes the same update as the plain path (≤ 1e-5), which keeps
    the whole (B, T-1, V) fp32 logits and every activation: the loss is a weighted sum over tokens."""

    from polar_lab.grpo.loss import TokenLogprobs

    samples = _varied_batch()
    plain = Policy(model_path, GRPOConfig(learning_rate=1e-9))
    plain.train_model = TokenLogprobs(plain.model, chunk=None)  # the reference path: whole logits, no recompute
    saver = Policy(model_path, GRPOConfig(learning_rate=1e-9, **variant))
    assert saver.model.is_gradient_checkpointing == variant.get("gradient_checkpointing", False)
    layer_calls = []  # a layer runs once per micro-batch, twice when it is recomputed in backward
    layer = saver.model.get_decoder().layers[0]
    forward = layer.forward  # wrapped, not hooked: a recomputation calls forward but runs no module hooks
    layer.forward = lambda *args, **kwargs: layer_calls.append(1) or forward(*args, **kwargs)
    stats_plain = plain.update(samples)
    grads_plain = {n: p.grad.clone() for n, p in plain.model.named_parameters() if p.grad is not None}
    stats_saver = saver.update(samples)
    micro = len(saver._micro_batches(samples))
    assert len(layer_calls) == micro * (2 if variant.get("gradient_checkpointing") else 1)
    grads_saver = {n: p.grad.clone() for n, p in saver.model.named_parameters() if p.grad is not None}
    assert abs(stats_plain.loss - stats_saver.loss) <= 1e-5 * max(1.0, abs(stats_plain.loss))
    assert grads_plain.keys() == grads_saver.keys()
    for name in grads_plain:
        scale = grads_plain[name].abs().max().clamp(min=1e-8)
        assert (grads_plain[name] - grads_saver[name]).abs().max() / scale <= 1e-5, name


def test_the_reference_model_goes_through_the_same_head_so_the_first_kl_is_zero_in_bf16(model_path):
    from polar_lab.grpo.loss import TokenLogprobs

    policy = Policy(model_path, GRPOConfig(beta=0.1, dtype="bfloat16", learning_rate=1e-9))
    assert isinstance(policy.scorers.ref, TokenLogprobs)
    assert policy.update(_varied_batch()).kl_sum == 0.0  # π_θ = π_ref at step 0, the same numbers


def _with_support(samples, top_k=-1.0, top_p=1.0):
    """Each sampled target's support set to (top_k, top_p); prompt targets keep the whole vocabulary."""
    import torch

    for s in samples:
        rows = torch.tensor([[-1.0, 1.0, 0.0]]).repeat(len(s.input_ids) - 1, 1)
        rows[s.weights > 0] = torch.tensor([top_k, top_p, 0.0])
        s.support = rows
    return samples


@pytest.mark.parametrize("loss", [{"loss_type": "dapo"}, {"loss_type": "cispo", "epsilon_high": 5.0}])
def test_a_sampled_token_outside_the_trainers_replayed_support_stays_finite_is_counted_and_the_step_is_taken(
        model_path, loss):
    """top_k=1 replayed on tokens that are not the trainer's argmax (a tie, or bf16 against fp32 at the edge): the
    sampler drew them, so they are in its support; the loss stays finite, each is counted, and the step is taken."""
    import torch

    from polar_lab.grpo.batch import collate

    policy = Policy(model_path, GRPOConfig(**loss, learning_rate=1e-2))
    samples = _with_support(_hand_batch().samples, top_k=1.0)
    mb = collate(samples, pad_id=0, device="cpu")
    with torch.no_grad():
        argmax = policy.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits[:, :-1].argmax(-1)
    trained = mb["weights"] > 0
    outside = int((argmax != mb["input_ids"][:, 1:])[trained].sum())
    assert outside > 0
    before = policy.state_dict()["lm_head.weight"]
    stats = policy.update(samples)
    metrics = stats.metrics()
    assert math.isfinite(stats.loss) and metrics["skipped_steps"] == 0 and stats.stepped
    assert metrics["outside_support_tokens"] == outside
    assert not torch.equal(before, policy.state_dict()["lm_head.weight"])


def test_the_reference_and_the_teacher_score_over_the_policys_replayed_support(model_path):
    """Under a harness's top_p 0.8, π_ref (a copy of the policy) and a teacher that is the policy's own weights give
    the policy's own logprobs at step 0: KL 0 and distillation term 0, not log(support mass)."""
    samples = _with_support(_hand_batch(n_runs=4, sampled=6).samples, top_p=0.8)
    stats = Policy(model_path, GRPOConfig(beta=0.1, teacher_model=model_path, learning_rate=1e-9)).update(samples)
    assert stats.tokens > 0 and stats.kl_sum == 0.0 and stats.distill_kl_sum == 0.0


def test_a_teacher_engine_refuses_samples_drawn_within_a_harnesss_support(lab, model_path):
    """vLLM scores a prompt over the whole vocabulary: a teacher engine cannot score within top_p, so it says so."""
    from polar_lab.errors import TrainerError
    from polar_lab.grpo.teacher import EngineTeacher

    teacher = EngineTeacher(model_path, model_path, lab.config.engine, engine=lab.engine)
    with pytest.raises(TrainerError, match="teacher_scorer='trainer'"):
        teacher.score(_with_support(_hand_batch().samples, top_p=0.8))
    teacher.score(_hand_batch().samples)  # the whole vocabulary: scored
    teacher.close()


def test_chunked_logprobs_equal_the_full_logits_and_stay_fp32_under_bf16(model_path):
    import torch
    from transformers import AutoModelForCausalLM

    from polar_lab.grpo.loss import TokenLogprobs, token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    one_draw = torch.Generator().manual_seed(0)  # the same ids on every run, whatever ran before in the worker
    ids = torch.randint(0, model.config.vocab_size, (3, 17), generator=one_draw)
    mask, temps = torch.ones_like(ids), torch.tensor([1.0, 0.7, 1.3])
    chunked = TokenLogprobs(model, chunk=7)
    assert chunked.chunked  # tiny-calc's logits are its lm_head's: the chunked path, not the fallback
    seen = []  # (rows, dtype) of every lm_head call
    hook = model.get_output_embeddings().register_forward_hook(
        lambda _m, args, out: seen.append((len(args[0]), out.dtype)))
    with torch.no_grad():
        got = chunked(ids, mask, temps)
    assert [rows for rows, _ in seen] == [7] * 6 + [6]  # 3 × 16 positions, never more than 7 at once
    assert torch.allclose(got, token_logprobs(model, ids, mask, temps).detach(), atol=1e-6)
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked(ids, mask, temps).sum().backward()  # with gradients: each chunk again in backward
    hook.remove()
    assert sorted(rows for rows, _ in seen) == sorted(([7] * 6 + [6]) * 2) and chunked.head_calls == 7 + 14
    assert {dtype for _, dtype in seen} == {torch.float32}  # the head itself in fp32 under bf16 autocast


@pytest.mark.parametrize("budget, sizes", [(24, [2, 2]), (23, [1, 1, 1, 1]), (7, [1, 1, 1, 1]), (10**6, [4])])
def test_micro_batches_by_token_budget(model_path, budget, sizes):
    """Sorted by length, then as many as keep count × the longest within the budget (one over it goes alone)."""
    policy = Policy(model_path, GRPOConfig(micro_batch_tokens=budget))
    micro = policy._micro_batches(_varied_batch())
    assert [len(mb["input_ids"]) for mb in micro] == sizes
    assert all(mb["input_ids"].numel() <= budget or len(mb["input_ids"]) == 1 for mb in micro)


def test_a_teacher_scores_the_recorded_tokens_and_its_reverse_kl_moves_the_update(model_path, tmp_path):
    """The student as its own teacher adds nothing (KL 0, the same loss); a teacher with other weights gives
    every trained token its reverse KL; a teacher with another vocabulary is refused by name."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from polar_lab.errors import ConfigError

    samples = _hand_batch().samples
    plain = Policy(model_path, GRPOConfig()).update(samples)
    itself = Policy(model_path, GRPOConfig(teacher_model=model_path)).update(samples)
    assert itself.distill_kl_sum == 0.0 and itself.loss == pytest.approx(plain.loss)
    other = tmp_path / "teacher"
    shutil.copytree(model_path, other)
    teacher = AutoModelForCausalLM.from_pretrained(other)
    with torch.no_grad():
        teacher.lm_head.weight.add_(0.5 * torch.randn(teacher.lm_head.weight.shape, generator=torch.Generator()
                                                      .manual_seed(0)))
    teacher.save_pretrained(other)
    distilled = Policy(model_path, GRPOConfig(teacher_model=str(other))).update(samples)
    assert distilled.distill_kl_sum != 0.0 and distilled.loss != pytest.approx(plain.loss)
    assert distilled.metrics()["distill_kl"] == pytest.approx(distilled.distill_kl_sum / distilled.tokens)
    with pytest.raises(ConfigError, match="another vocabulary"):
        Policy(model_path, GRPOConfig(teacher_model="data/models/tiny-calc-qwen35"))


def test_a_teacher_engine_scores_every_recorded_token_as_the_trainer_side_teacher_and_moves_the_update_alike(
        lab, model_path, train_tasks):
    """teacher_scorer="engine": vLLM's prompt logprobs of each recorded chain (the shared engine as the teacher, the
    student's own weights) equal a trainer-side teacher's of the same model within the engine-vs-transformers gap,
    and the update is the same; the policy holds no teacher of its own, and an engine passed in stays its owner's."""
    from polar_lab.grpo.batch import collate
    from polar_lab.grpo.teacher import EngineTeacher

    samples = build_batch(rollout(lab, train_tasks[:2], n=4), GRPOConfig(teacher_model=model_path),
                          lab.policy_version).samples  # distilling: groups without reward spread are kept
    assert samples
    teacher = EngineTeacher(model_path, model_path, lab.config.engine, engine=lab.engine)
    teacher.score(samples)
    teacher.close()
    assert lab.engine.alive
    mb = collate(samples, pad_id=0, device="cpu")
    beside = Policy(model_path, GRPOConfig(teacher_model=model_path))
    expected = beside.scorers.teacher(mb["input_ids"], mb["attention_mask"], mb["temperature"])
    real = mb["attention_mask"][:, 1:].bool()  # every target, trained or not
    assert (mb["teacher"] - expected)[real].abs().max() < 1e-4
    engine_side = Policy(model_path, GRPOConfig(teacher_model=model_path, teacher_scorer="engine"))
    assert engine_side.scorers.teacher is None
    ours, theirs = engine_side.update(samples), beside.update(samples)
    assert ours.distill_kl_sum == pytest.approx(theirs.distill_kl_sum, abs=1e-3)
    assert ours.loss == pytest.approx(theirs.loss, rel=1e-3, abs=1e-5)


def test_a_harnesss_own_top_p_and_top_k_are_applied_and_the_trainer_renormalises_over_the_same_support(
        lab, model_path, shipped_weights, restore_weights, train_tasks):
    """sampling_support="replay" (the default): the engine samples within the harness's top_p 0.8 / top_k 20 and
    reports the renormalised logprob; the trainer replays the same masks on its own logits, so on-policy the TIS
    weight stays 1 — and without the replay it would not."""
    import torch
    from transformers import AutoModelForCausalLM

    from polar_lab.grpo.rollouts import rollout_sampling
    from polar_lab.trajectory import fidelity
    from polar_lab.trajectory.fidelity import recompute_logprobs

    lab.sync_weights(shipped_weights)
    groups = lab.rollout(train_tasks[:2], _truncating_agent, num_generations=4, evaluator="final_answer",
                         sampling=rollout_sampling(GRPOConfig()), progress=False)
    calls = lab.call_records(session_ids=[s.id for g in groups for s in g.sessions])
    for call in calls:  # the support applied; what reshapes the distribution otherwise still overridden
        assert (call.sampling["top_p"], call.sampling["top_k"]) == (0.8, 20)
        assert call.sampling["overridden"] == {"presence_penalty": 0.5, "frequency_penalty": 0.3,
                                               "logit_bias": {"11": 3.0}}
    trajectories = [t for g in groups for t in g.trajectories]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    check = fidelity(trajectories, model)
    assert (check.trained_tokens > 0).all() and check.max_abs_diff.max() < 1e-4, check
    full = [abs(b - r) for t in trajectories  # the control: the whole vocabulary's softmax is another distribution
            for b, r, m in zip(t.behavior_logprobs, recompute_logprobs(model, dataclasses.replace(
                t, sampling_support=[]), t.temperature), t.loss_mask) if m]
    assert max(full) > 1e-2
    from polar_lab.grpo.batch import _sample

    samples = [_sample(t, advantage=0.0, weight=1.0) for t in trajectories]
    assert all(s.support is not None for s in samples)
    policy = Policy(model_path, GRPOConfig())  # the trainer's own chunked path, as a step computes π_old
    weights = torch.cat([(lp - s.behavior_logprobs).exp()[s.weights > 0]
                         for s, lp in zip(samples, policy.logprobs(samples))])
    assert abs(weights.mean().item() - 1) < 1e-4 and (weights - 1).abs().max().item() < 1e-3

