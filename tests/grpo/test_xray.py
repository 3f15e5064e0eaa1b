"""The loss X-ray (issue 44): its per-token values are the loss's own tensors of the update's first pass, each token's
rule is the one that decided it, and the widget draws every token with its filters."""

import numpy as np
import pytest
import torch

from polar_lab.grpo import GRPOConfig, build_batch
from polar_lab.grpo.policy import Policy
from polar_lab.grpo.xray import XRays

from .conftest import BATCHING_NOISE, rollout

ICEPOP = {"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.5,
          "vllm_importance_sampling_clip_max": 2.0}


@pytest.fixture(scope="module")
def samples(lab, train_tasks):
    batch = build_batch(rollout(lab, train_tasks[:3], n=6), GRPOConfig(), lab.policy_version)
    assert batch.samples, batch.stats
    return batch.samples


def test_the_xray_holds_the_losss_own_per_token_values(model_path, samples):
    """Against an independent computation: the trainer's logprobs of the same weights (`Policy.logprobs`, one sample
    at a time, no padding), the engine's logprobs and the batch's weights and advantages as built, and TIS's weight by
    its formula, min(exp(old − μ), clip_max)."""
    expected = Policy(model_path, GRPOConfig()).logprobs(samples)
    update = Policy(model_path, GRPOConfig()).update(samples)
    captured = {(r["session_id"], r["chain_index"]): r for r in update.xray}
    assert len(captured) == len(samples)
    for sample, old in zip(samples, expected):
        row = captured[(sample.session_id, sample.chain_index)]
        trained = sample.weights.numpy() > 0
        assert np.abs(row["old"] - old.numpy())[trained].max() < BATCHING_NOISE
        assert np.array_equal(row["behavior"], sample.behavior_logprobs.numpy())
        assert np.array_equal(row["weight"], sample.weights.numpy())
        assert np.allclose(row["advantage"][trained], sample.advantage)
        tis = np.minimum(np.exp(old.numpy() - sample.behavior_logprobs.numpy()), 2.0)
        assert np.abs(row["is_weight"] - tis)[trained].max() < 2 * BATCHING_NOISE  # exp's slope ≤ 2 below the clip


def test_each_token_carries_the_rule_that_decided_it(model_path, tokenizer, samples):
    """IcePop masks exactly the tokens whose engine logprob was pushed 1.0 below the trainer's (ratio e > 2); prompt
    tokens are the unsampled ones; the rest trained; the template's markers are scaffold."""
    import copy

    skewed = copy.deepcopy(samples)
    pushed = {}
    for i, s in enumerate(skewed):
        at = int(torch.nonzero(s.weights > 0)[0])  # the first trained token of each sample
        s.behavior_logprobs[at] -= 1.0
        pushed[i] = at
    config = GRPOConfig(**ICEPOP)
    update = Policy(model_path, config).update(skewed)
    frame = XRays(8, tokenizer, config).frame(update.xray, skewed, version=0)
    assert len(frame) == sum(len(s.input_ids) - 1 for s in skewed)
    for i, at in pushed.items():
        rows = frame[frame["sample"] == i].reset_index(drop=True)
        assert rows.loc[at, "rule"] == "IcePop" and rows.loc[at, "is_weight"] == 0.0
        assert set(rows.drop(index=at)["rule"]) <= {"prompt", "trained", "clipped"}
        assert (rows["rule"] == "prompt").equals(~rows["sampled"])
    special = frame["token_id"].isin(tokenizer.all_special_ids)
    assert frame.loc[special, "scaffold"].all() and not frame.loc[frame["trained"], "scaffold"].all()
    assert np.allclose(frame["gap"].dropna(), (frame["trainer_logprob"] - frame["engine_logprob"]).dropna())


def test_the_widget_draws_every_token_and_filters_by_rule(tokenizer, samples, model_path):
    from polar_lab.viz.xray import show_loss

    config = GRPOConfig()
    frame = XRays(8, tokenizer, config).frame(Policy(model_path, config).update(samples[:2]).xray, samples[:2], 0)
    widget = show_loss(frame, step=3)
    (session, chain, rule), colour_by, counts, body = widget.children[0].children, *widget.children[1:]
    assert body.value.count("class='polar-lab-xray-token'") == len(frame) and "step 3" in counts.value
    rule.value = "prompt"
    assert body.value.count("class='polar-lab-xray-token'") == int((frame["rule"] == "prompt").sum())
    assert "data-rule='trained'" not in body.value
    colour_by.value = "advantage"
    assert "advantage (per token" in body.value


def test_a_steps_table_is_built_when_first_read_and_only_the_last_steps_are_kept(model_path, tokenizer, samples):
    """Decoding every token costs seconds on a large batch: a step the notebook never looks at is never decoded."""
    update = Policy(model_path, GRPOConfig()).update(samples[:2])
    xrays = XRays(2, tokenizer, GRPOConfig())
    for step in (1, 2, 3):
        xrays.record(step, update.xray, samples[:2], version=0)
    assert list(xrays.steps) == [2, 3] and 3 in xrays.steps and 1 not in xrays.steps and not xrays.steps.built
    assert len(xrays.steps[3]) == sum(len(s.input_ids) - 1 for s in samples[:2]) and list(xrays.steps.built) == [3]
