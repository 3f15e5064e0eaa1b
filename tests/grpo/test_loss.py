"""The per-token objective: PG direction, clip-higher, truncated IS per token, k3 KL."""

import math

import pytest
import torch

from polar_lab.grpo import GRPOConfig
from polar_lab.grpo.loss import policy_loss


def _loss(logp, old, behavior, adv, ref=None, **cfg):
    weights = torch.ones_like(logp) / logp.numel()
    return policy_loss(logp, old, behavior, ref, torch.tensor(adv), weights, GRPOConfig(**cfg))


def test_on_policy_gradient_raises_logprob_of_positive_advantage_tokens():
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]], requires_grad=True)
    loss, _ = _loss(logp, logp.detach(), logp.detach(), [1.0, -1.0])
    loss.backward()
    assert (logp.grad[0] < 0).all() and (logp.grad[1] > 0).all()  # descent raises row 0, lowers row 1
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-7)  # ratio 1: -A, averaged over ±A


@pytest.mark.parametrize("log_ratio,adv,clipped", [
    (0.5, 1.0, True),     # ratio 1.65 > 1 + 0.28 with A > 0: clipped, no gradient
    (0.2, 1.0, False),    # ratio 1.22 < 1.28: inside the clip-higher range
    (-0.5, -1.0, True),   # ratio 0.61 < 0.8 with A < 0: clipped
    (-0.5, 1.0, False),   # ratio < 0.8 with A > 0: the min keeps the unclipped term
])
def test_clip_higher(log_ratio, adv, clipped):
    old = torch.tensor([[-1.0]])
    logp = (old + log_ratio).requires_grad_(True)
    loss, stats = _loss(logp, old, old, [adv], epsilon=0.2, epsilon_high=0.28)
    loss.backward()
    assert bool(stats["clipped"]) == clipped
    assert (float(logp.grad.abs()) == 0.0) == clipped


def test_each_token_is_weighted_by_its_own_behaviour_logprob_and_capped():
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    behavior = torch.tensor([[-1.0, -1.5, -5.0]])  # same policy, one version older, far older
    logp = old.clone().requires_grad_(True)
    _, stats = _loss(logp, old, behavior, [1.0], tis_cap=2.0)
    assert stats["log_is"].tolist() == pytest.approx([0.0, 0.5, 4.0])
    assert float(stats["is_capped"]) == 1.0
    loss, _ = _loss(logp, old, behavior, [1.0], tis_cap=2.0)
    loss.backward()
    # d loss / d logp_t = -A * w_t / 3 with w = (1, e^0.5, cap 2)
    assert (-logp.grad[0] * 3).tolist() == pytest.approx([1.0, 1.6487, 2.0], rel=1e-4)


def test_k3_kl_is_zero_at_the_reference_and_positive_away_from_it():
    ref = torch.tensor([[-1.0, -2.0]])
    _, at_ref = _loss(ref.clone(), ref, ref, [0.0], ref=ref, beta=0.1)
    _, away = _loss(ref + 0.3, ref + 0.3, ref + 0.3, [0.0], ref=ref, beta=0.1)
    assert float(at_ref["kl_sum"]) == pytest.approx(0.0, abs=1e-7)
    assert float(away["kl_sum"]) > 0


@pytest.mark.parametrize("delta", [0.3, -0.7, 1.5])
def test_the_kl_term_is_k3_with_its_gradient_scaled_by_beta(delta):
    # k3(x) = e^x - x - 1 with x = log π_ref − log π (Schulman's estimator); k1 would be -x, k2 x²/2
    ref = torch.tensor([[-1.0, -2.0]])
    logp = (ref - delta).requires_grad_(True)  # so x = delta
    loss, stats = _loss(logp, logp.detach(), logp.detach(), [0.0], ref=ref, beta=0.25)  # A = 0: only the KL
    loss.backward()
    k3 = math.exp(delta) - delta - 1
    assert float(stats["kl_sum"]) == pytest.approx(2 * k3, rel=1e-5)
    assert float(loss.detach()) == pytest.approx(0.25 * k3, rel=1e-5)  # weights 1/2 each: the mean
    # d/dlogp of β·k3 = β·(1 − e^x), times the token weight 1/2
    assert logp.grad[0].tolist() == pytest.approx([0.25 * (1 - math.exp(delta)) / 2] * 2, rel=1e-5)
