"""The GRPO objective per token: a policy-gradient term × the engine-vs-trainer correction (+ β·KL).

For target token t of a sample (one chain of a run) with advantage A, over its trained tokens T:

    r_t   = π_θ(t) / π_old(t)                       (π_old = the trainer's weights before this batch)
            importance_sampling_level="sequence" (GSPO): r_t = exp(mean_{s∈T} log r_s), one ratio per sample
    pg_t  = -min(r_t·A, clip(r_t, 1-ε, 1+ε_high)·A)          loss_type grpo / dr_grpo / dapo
            -sg(min(r_t, ε_high))·A·log π_θ(t)              loss_type cispo (MiniMax-M1; ε_high the cap)
    ρ_t   = π_old(t) / μ(t)                         (μ = the engine's sampler logprob of *this* token, whatever
                                                      policy version produced it; no gradient)
    w_t   = vllm_importance_sampling_mode, with bounds [lo, hi] (clip_min, clip_max; TRL's names):
            token_truncate     clamp(ρ_t, lo, hi)                             (TIS)
            token_mask         ρ_t inside [lo, hi], else 0                    (IcePop with both bounds)
            sequence_truncate  clamp(Π_{s∈T} ρ_s, lo, hi), on every token of the sample
            sequence_mask      Π_{s∈T} ρ_s inside [lo, hi], else 0            (MIS)
            geometric_mask     exp(mean_{s∈T} log ρ_s) inside [lo, hi], else 0 (a long sample is not masked
                                                                              for its length alone)
    A_t   = A − λ·(log π_old(t) − log π_teacher(t))   with a teacher (on-policy distillation, λ = distill_coef):
                                                      the teacher's per-token reverse KL, on the recorded tokens
    ℓ_t   = w_t·pg_t + β·k3(π_θ, π_ref)
    loss  = Σ_t c_t·ℓ_t                              (c_t from batch.py: the loss_type normalisation)

All logprobs are of the distribution the engine sampled from: the logits at temperature T, renormalised over the
call's sampling support where it had one (top_k / top_p / min_p: `restrict` replays vLLM's masks on the trainer's
own logits), so a harness's own top_p needs no forcing for π_old/μ to stay 1 on-policy.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from polar_lab.grpo.config import GRPOConfig
from polar_lab.trajectory.support import restrict_sampled


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperatures: torch.Tensor, support: torch.Tensor | None = None) -> torch.Tensor:
    """log π(input_ids[:, 1:]) under a causal LM at each row's temperature, within each target's sampling `support`
    ((B, T-1, 3) top_k, top_p, min_p; None: the whole vocabulary; the target itself always inside it, see
    trajectory/support.py). (B, T) → (B, T-1). The reference form: it materialises the whole (B, T-1, V) logits (the
    trainer uses `TokenLogprobs`)."""
    return _reference_logprobs(model, input_ids, attention_mask, temperatures, support)[0]


def _reference_logprobs(model, input_ids, attention_mask, temperatures, support=None):
    """`token_logprobs` and the number of targets the support's masks alone would have cut."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()  # (B, T-1, V)
    logits = logits / temperatures[:, None, None]
    targets = input_ids[:, 1:]
    cut = torch.zeros((), dtype=torch.long)
    if support is not None:
        flat, outside = restrict_sampled(logits.flatten(0, 1), support.flatten(0, 1), targets.flatten())
        logits, cut = flat.view_as(logits), outside.sum()
    return logits.gather(-1, targets[..., None]).squeeze(-1) - logits.logsumexp(-1), cut  # (B, T-1)


class TokenLogprobs(torch.nn.Module):
    """A causal LM's token logprobs without its full-vocabulary logits: the decoder's hidden states go
    through the lm_head `chunk` positions at a time, in fp32 even under bf16 autocast, and with gradients
    each chunk is recomputed in backward (activation checkpointing), so the fp32 logits of only `chunk`
    positions ever exist at once (with their softmax and gradient in backward, ~3 copies): for a ~150k vocabulary
    and a 32k-token chain, ~20 GB of fp32 logits become ~7 GB at 4096. `outside_support` counts the targets its
    forward passes kept in their support although the masks alone would have cut them (trajectory/support.py).

    Wraps the model (DDP wraps this: its forward is the trainer's whole forward). Models not known to have
    plain logits (`PLAIN_HEAD_TYPES`; others add a softcap, a logit scale...) use the reference path of
    `token_logprobs`. The fp32 head's cost on GPU is not measured yet."""

    def __init__(self, model: torch.nn.Module, chunk: int | None = 4096):
        super().__init__()
        self.model, self.chunk = model, chunk
        self.chunked = chunk is not None and _plain_head(model)  # chunk=None: the reference path, on purpose
        self.head_calls = 0  # positions' chunks through the lm_head, recomputations included (tests count them)
        self.outside_support = 0  # targets outside their sampling support's masks, kept in (forward passes only)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                temperatures: torch.Tensor, support: torch.Tensor | None = None) -> torch.Tensor:
        if not self.chunked:
            logp, cut = _reference_logprobs(self.model, input_ids, attention_mask, temperatures, support)
            self.outside_support += int(cut)
            return logp
        decoder = self.model.get_decoder()
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(hidden[:, :-1], input_ids[:, 1:], temperatures, support)

    def head(self, hidden: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor,
             support: torch.Tensor | None = None) -> torch.Tensor:
        """(B, W, H) hidden states → (B, W) logprobs of `targets` (B, W) at each row's temperature, within `support`
        (B, W, 3), through the lm_head `chunk` positions at a time (recomputed in backward)."""
        batch, width = targets.shape
        hidden = hidden.reshape(batch * width, -1)  # (B·W, H)
        targets = targets.reshape(-1)  # (B·W,)
        temps = temperatures.repeat_interleave(width)  # (B·W,)
        supports = support.reshape(batch * width, 3) if support is not None else None
        parts, cuts = [], []
        for start in range(0, hidden.shape[0], self.chunk):
            end = start + self.chunk
            piece = (hidden[start:end], targets[start:end], temps[start:end],
                     supports[start:end] if supports is not None else None)
            if torch.is_grad_enabled():  # the model draws no random numbers: no RNG state to keep
                logp, cut = checkpoint(self._head_logprobs, *piece, use_reentrant=False, preserve_rng_state=False)
            else:
                logp, cut = self._head_logprobs(*piece)
            parts.append(logp)
            cuts.append(cut)
        self.outside_support += int(sum(cuts))
        return torch.cat(parts).view(batch, width).clone()  # not a view (FSDP2 hooks the output)

    def _head_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor,
                       support: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, H) hidden states → (N,) logprobs of `targets`, through the lm_head in fp32, within `support` (each
        target kept in it), and how many targets its masks alone would have cut."""
        head = self.model.get_output_embeddings()
        self.head_calls += 1
        with torch.autocast(hidden.device.type, enabled=False):
            if head.weight.dtype == torch.float32:  # fp32 masters (also FSDP on CPU)
                logits = head(hidden.float())
            else:  # FSDP's bf16-gathered parameters on GPU: the product still in fp32
                bias = None if head.bias is None else head.bias.float()
                logits = torch.nn.functional.linear(hidden.float(), head.weight.float(), bias)
            logits = logits / temps[:, None]  # (N, V)
            cut = torch.zeros((), dtype=torch.long, device=logits.device)
            if support is not None:
                logits, outside = restrict_sampled(logits, support, targets)
                cut = outside.sum()
        return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1), cut


PLAIN_HEAD_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_text", "smollm3",
                    "olmo2", "phi3")  # model types whose logits are lm_head(the decoder's last hidden state)


def _plain_head(model: torch.nn.Module) -> bool:
    """Whether the model's logits are exactly lm_head(decoder hidden states): an allow-list of model types
    (others add a softcap, a logit scale or a multiplier, some in a nested text config), checked on the
    text config too."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = {getattr(config, "model_type", None), getattr(text, "model_type", None)}
    try:
        return bool(kinds & set(PLAIN_HEAD_TYPES)) and model.get_decoder() is not None \
            and model.get_output_embeddings() is not None
    except (AttributeError, NotImplementedError):
        return False


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, behavior_logp: torch.Tensor,
                ref_logp: torch.Tensor | None, advantages: torch.Tensor, weights: torch.Tensor,
                config: GRPOConfig, teacher_logp: torch.Tensor | None = None, *, xray: bool = False
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss (a scalar) and detached per-batch sums for metrics. All tensors (B, T-1) except advantages (B,).
    xray: also the per-token tensors the loss used (stats["xray"]: grpo/xray.py shows them)."""
    trained = weights > 0
    adv = advantages[:, None]
    reverse_kl = torch.zeros_like(logp)
    if teacher_logp is not None:  # the student's estimate is π_old: the advantage carries no gradient
        reverse_kl = torch.where(trained, old_logp - teacher_logp, 0.0).detach()
        adv = adv - config.distill_coef * reverse_kl
    # Log-ratios are zeroed where nothing is trained *before* exp: a padded or prompt position whose log-ratio
    # overflows would otherwise give exp = inf, and inf · weight 0 = NaN in every gradient.
    log_ratio = torch.where(trained, logp - old_logp, 0.0)
    if config.importance_sampling_level == "sequence":
        log_ratio = _per_sequence(log_ratio, trained, mean=True).expand_as(logp)
    ratio = torch.exp(log_ratio)
    if config.loss_type == "cispo":
        pg = -ratio.clamp(max=config.epsilon_high).detach() * adv * torch.where(trained, logp, 0.0)
        was_clipped = (ratio > config.epsilon_high) & (adv > 0)
    else:
        clipped = ratio.clamp(1 - config.epsilon, 1 + config.epsilon_high)
        pg = -torch.minimum(ratio * adv, clipped * adv)
        was_clipped = ((ratio < 1 - config.epsilon) & (adv < 0)) | ((ratio > 1 + config.epsilon_high) & (adv > 0))
    log_is = torch.where(trained, old_logp - behavior_logp, 0.0).detach()
    is_weight, truncated, masked = correction(log_is, trained, config)
    per_token = pg * is_weight
    kl = torch.zeros_like(logp)
    if ref_logp is not None and config.beta > 0:
        delta = torch.where(trained, ref_logp - logp, 0.0)
        kl = delta.exp() - delta - 1  # k3: unbiased, always >= 0
        per_token = per_token + config.beta * kl
    loss = (per_token * weights).sum()
    with torch.no_grad():
        stats = {
            "loss": loss.detach(),
            "pg_loss": (pg * is_weight * weights).sum(),
            "kl_weighted": (kl * weights).sum(),
            "tokens": trained.sum().float(),
            "kl_sum": kl[trained].sum(),
            "clipped": was_clipped[trained].sum().float(),
            "is_capped": truncated[trained].sum().float(),
            "is_masked": masked[trained].sum().float(),
            "mismatch_kl_sum": (log_is.exp() - 1 - log_is)[trained].sum(),  # k3 of KL(μ ‖ π_old), sampled from μ
            "distill_kl_sum": reverse_kl[trained].sum(),  # k1 of KL(π_old ‖ π_teacher) on the sampled tokens
            "log_is": log_is[trained],  # per trained token: log(π_old / μ), for quantiles
        }
        if xray:
            stats["xray"] = {"logp": logp.detach(), "old": old_logp, "behavior": behavior_logp, "weight": weights,
                             "is_weight": is_weight, "is_truncated": truncated, "is_masked": masked,
                             "clipped": was_clipped, "advantage": adv.expand_as(logp)}
    return loss, stats


def correction(log_is: torch.Tensor, trained: torch.Tensor,
               config: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w, truncated, masked), each (B, T-1): the weight of each token's policy-gradient term for the engine's
    mismatch (the module docstring's table), whether truncation changed it, whether a mask zeroed it.
    `log_is` = log(π_old / μ) per token, 0 where nothing is trained."""
    none = torch.zeros_like(trained)
    if not config.vllm_importance_sampling_correction:
        return torch.ones_like(log_is), none, none
    mode, low, high = (config.vllm_importance_sampling_mode, config.vllm_importance_sampling_clip_min,
                       config.vllm_importance_sampling_clip_max)
    if mode.startswith("sequence"):
        log_is = _per_sequence(log_is, trained, mean=False)
    elif mode == "geometric_mask":
        log_is = _per_sequence(log_is, trained, mean=True)
    ratio = log_is.exp().expand_as(trained)
    below = ratio < low if low is not None else none
    above = ratio > high if high is not None else none
    if mode.endswith("truncate"):
        return (ratio if low is None and high is None else ratio.clamp(min=low, max=high)), below | above, none
    out = below | above
    return ratio.masked_fill(out, 0.0), none, out


def _per_sequence(per_token: torch.Tensor, trained: torch.Tensor, *, mean: bool) -> torch.Tensor:
    """(B, T-1) → (B, 1): the sum (or mean) of each sample's values over its trained tokens."""
    total = (per_token * trained).sum(-1, keepdim=True)
    return total / trained.sum(-1, keepdim=True).clamp(min=1) if mean else total
