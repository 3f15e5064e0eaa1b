"""The GRPO objective per token: clipped policy gradient × truncated importance weight (+ β·KL).

For target token t of a sample with advantage A:

    r_t   = π_θ(t) / π_old(t)                       (π_old = the trainer's weights before this batch)
    pg_t  = -min(r_t·A, clip(r_t, 1-ε, 1+ε_high)·A)
    w_t   = min(π_old(t) / μ(t), tis_cap)           (μ = the engine's sampler logprob of *this* token,
                                                      whatever policy version produced it; no gradient)
    ℓ_t   = w_t·pg_t + β·k3(π_θ, π_ref)
    loss  = Σ_t c_t·ℓ_t                              (c_t from batch.py: the loss_type normalisation)

All logprobs are of the tempered distribution the engine sampled from (logits / T).
"""

from __future__ import annotations

import torch

from polar_lab.grpo.config import GRPOConfig


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperatures: torch.Tensor) -> torch.Tensor:
    """log π(input_ids[:, 1:]) under `model` at each row's temperature. (B, T) → (B, T-1)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()  # (B, T-1, V)
    logits = logits / temperatures[:, None, None]
    targets = input_ids[:, 1:, None]
    return (logits.gather(-1, targets).squeeze(-1) - logits.logsumexp(-1))  # (B, T-1)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, behavior_logp: torch.Tensor,
                ref_logp: torch.Tensor | None, advantages: torch.Tensor, weights: torch.Tensor,
                config: GRPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss (a scalar) and detached per-batch sums for metrics. All tensors (B, T-1) except advantages (B,)."""
    trained = weights > 0
    adv = advantages[:, None]
    # Log-ratios are zeroed where nothing is trained *before* exp: a padded or prompt position whose log-ratio
    # overflows would otherwise give exp = inf, and inf · weight 0 = NaN in every gradient.
    ratio = torch.exp(torch.where(trained, logp - old_logp, 0.0))
    clipped = ratio.clamp(1 - config.epsilon, 1 + config.epsilon_high)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    log_is = torch.where(trained, old_logp - behavior_logp, 0.0).detach()
    is_weight = torch.ones_like(log_is) if config.tis_cap is None else log_is.exp().clamp(max=config.tis_cap)
    per_token = pg * is_weight
    kl = torch.zeros_like(logp)
    if ref_logp is not None and config.beta > 0:
        delta = torch.where(trained, ref_logp - logp, 0.0)
        kl = delta.exp() - delta - 1  # k3: unbiased, always >= 0
        per_token = per_token + config.beta * kl
    loss = (per_token * weights).sum()
    with torch.no_grad():
        was_clipped = ((ratio < 1 - config.epsilon) & (adv < 0)) | ((ratio > 1 + config.epsilon_high) & (adv > 0))
        stats = {
            "loss": loss.detach(),
            "pg_loss": (pg * is_weight * weights).sum(),
            "kl_weighted": (kl * weights).sum(),
            "tokens": trained.sum().float(),
            "kl_sum": kl[trained].sum(),
            "clipped": was_clipped[trained].sum().float(),
            "is_capped": (log_is.exp() > (config.tis_cap or float("inf")))[trained].sum().float(),
            "log_is": log_is[trained],  # per trained token: log(π_old / μ), for quantiles
        }
    return loss, stats
