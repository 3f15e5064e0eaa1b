"""The sampling support of a call — the tokens its top_k / top_p / min_p left the sampler — and the same masks
replayed on a model's logits, so a logprob recomputed outside the engine (the trainer's π_old, a fidelity check)
belongs to the distribution the engine sampled from.

vLLM returns `processed_logprobs` (engine/worker.py): the sampled token's logprob after temperature and these masks,
renormalised over what they kept. `restrict` applies the masks in vLLM's order to the caller's own logits; where
engine and trainer agree on the logits they agree on the support, up to ties at its edge and rounding there (bf16
against fp32). A sampled token is inside the sampler's support by definition, so `restrict_sampled` keeps each
row's sampled token whatever the masks say (its logprob stays finite) and says where the masks alone would have cut
it.
"""

from __future__ import annotations

from typing import Any

import torch


def support(sampling: dict[str, Any]) -> tuple[int, float, float]:
    """The (top_k, top_p, min_p) a call sampled within, from its record (0 or -1 top_k: off)."""
    top_k = int(sampling.get("top_k", -1))
    return (-1 if top_k <= 0 else top_k, float(sampling.get("top_p", 1.0)), float(sampling.get("min_p", 0.0)))


def restrict(logits: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """(N, V) tempered logits → the same with every token outside its row's sampling support at -inf, in vLLM's
    order (v1/sample/sampler.py: min_p among the argmax-invariant processors, then apply_top_k_top_p):
    min_p keeps p ≥ min_p·p_max; top_k the k largest logits (ties kept); top_p, over what top_k left, the smallest
    set of largest tokens whose probability reaches top_p (at least one). `support` (N, 3): top_k (≤ 0 off), top_p
    (1 off), min_p (0 off). The masks choose tokens; the kept logits keep their gradient."""
    top_k, top_p, min_p = support.unbind(-1)
    if (min_p > 0).any():
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p[:, None], float("-inf"))
    if not ((top_k > 0).any() or (top_p < 1).any()):
        return logits
    width = logits.shape[-1]
    ascending, order = logits.sort(-1)
    k = torch.where(top_k > 0, top_k, width).long().clamp(max=width)
    ascending = ascending.masked_fill(ascending < ascending.gather(-1, (width - k)[:, None]), float("-inf"))
    cut = ascending.softmax(-1).cumsum(-1) <= (1 - top_p)[:, None]
    cut[:, -1] = False  # at least one
    return logits.scatter(-1, order, ascending.masked_fill(cut, float("-inf")))


def restrict_sampled(logits: torch.Tensor, support: torch.Tensor, sampled: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`restrict`, keeping each row's `sampled` token (N,) in its support whatever the masks say; and (N,) bool, the
    rows where the masks alone would have cut it (a tie or a rounding at the support's edge)."""
    masked = restrict(logits, support)
    cut = masked.gather(-1, sampled[:, None]) == float("-inf")
    return masked.scatter(-1, sampled[:, None], logits.gather(-1, sampled[:, None])), cut.squeeze(-1)
