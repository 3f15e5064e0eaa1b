"""Fidelity check: recompute with transformers the logprob of every trained token and compare.

A trajectory is only as good as its behaviour logprobs: if the engine's numbers differ from what the
trainer computes for the same tokens, every importance ratio is off. This reports, per chain, the
mean and max |Δ| between the recorded (sampler) logprob and a transformers recomputation at the
call's temperature.
"""

from __future__ import annotations

import pandas as pd
import torch

from polar_lab.trajectory.support import restrict_sampled
from polar_lab.types import NO_SUPPORT, Trajectory


@torch.no_grad()
def recompute_logprobs(model, traj: Trajectory, temperature: float = 1.0) -> list[float]:
    """log p(token_t | tokens_<t) under `model` for every position (0.0 at position 0), within each token's
    sampling support (trajectory/support.py, the token itself kept in it) where its call had one."""
    ids = torch.tensor([traj.token_ids], device=model.device)  # (1, T)
    logits = model(ids).logits[0, :-1].float() / temperature  # (T-1, V)
    if any(s != NO_SUPPORT for s in traj.sampling_support):
        logits = restrict_sampled(logits, torch.tensor(traj.sampling_support[1:], device=logits.device), ids[0, 1:])[0]
    logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]  # (T-1,)
    return [0.0] + logp.tolist()


def fidelity(trajectories: list[Trajectory], model) -> pd.DataFrame:
    """One row per chain: trained tokens, mean and max |engine logprob − transformers logprob|."""
    rows = []
    for traj in trajectories:
        ref = recompute_logprobs(model, traj, traj.temperature)
        diffs = [abs(b - r) for b, r, m in zip(traj.behavior_logprobs, ref, traj.loss_mask) if m]
        rows.append({"session_id": traj.session_id, "chain_index": traj.chain_index,
                     "trained_tokens": len(diffs),
                     "mean_abs_diff": sum(diffs) / len(diffs) if diffs else 0.0,
                     "max_abs_diff": max(diffs, default=0.0)})
    return pd.DataFrame(rows)
