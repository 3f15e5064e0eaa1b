"""Reward distributions and training curves (matplotlib). Each function returns its Figure.

Inputs are the library's own tables: `trainer.rewards` (one row per run: step, group, reward),
`trainer.metrics` (one row per step), a list of `Group`s from `lab.rollout`, or a finished `polar_lab.Run`
(its `rewards()` and `metrics()`).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from polar_lab.rewards.table import rewards_frame



def zero_advantage_fraction(rewards: pd.DataFrame) -> pd.Series:
    """Per step: the fraction of groups whose scored runs all got the same reward (no GRPO signal)."""
    scored = rewards.dropna(subset=["reward"])
    spread = scored.groupby(["step", "group"])["reward"].agg(lambda r: r.nunique() <= 1)
    return spread.groupby(level="step").mean()


def plot_rewards(data):
    """Rewards per group (one rollout), or per step (a training run): strip plot of every run's reward, the
    mean ± std, and the fraction of zero-advantage groups. `data`: a rewards table, a list of Groups, or a Run."""
    if isinstance(data, pd.DataFrame):
        rewards = data
    else:
        rewards = rewards_frame(data) if isinstance(data, list) else data.rewards()  # Groups, or a Run
    scored = rewards.dropna(subset=["reward"])
    if scored["step"].nunique() <= 1:
        return _plot_groups(scored)
    return _plot_steps(scored, zero_advantage_fraction(rewards))


def _plot_groups(scored: pd.DataFrame):
    fig, ax = plt.subplots(figsize=(8, 3))
    rng = np.random.default_rng(0)
    x = scored["group"].to_numpy() + rng.uniform(-0.2, 0.2, len(scored))
    ax.scatter(x, scored["reward"] + rng.uniform(-0.03, 0.03, len(scored)), s=12, alpha=0.6)
    means = scored.groupby("group")["reward"].mean()
    ax.scatter(means.index, means.to_numpy(), marker="_", s=300, color="black", label="group mean")
    ax.set(xlabel="group (task)", ylabel="reward", title=f"rewards of {len(scored)} runs in {len(means)} groups")
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def _plot_steps(scored: pd.DataFrame, zero_adv: pd.Series):
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.2), gridspec_kw={"width_ratios": [3, 1]})
    rng = np.random.default_rng(0)
    ax.scatter(scored["step"] + rng.uniform(-0.25, 0.25, len(scored)),
               scored["reward"] + rng.uniform(-0.03, 0.03, len(scored)), s=6, alpha=0.3, label="runs")
    stats = scored.groupby("step")["reward"].agg(["mean", "std"])
    ax.errorbar(stats.index, stats["mean"], yerr=stats["std"], color="black", capsize=3, label="mean ± std")
    ax.set(xlabel="step", ylabel="reward", title="reward distribution per step")
    ax.legend(loc="lower right")
    ax2.bar(zero_adv.index, zero_adv.to_numpy(), color="#adb5bd")
    ax2.set(xlabel="step", ylabel="fraction", ylim=(0, 1), title="zero-advantage groups")
    fig.tight_layout()
    return fig


CURVES = [  # (title, metric columns)
    ("reward", ["reward_mean"]),
    ("loss", ["loss"]),
    ("KL to reference", ["kl"]),
    ("clip fraction", ["clip_frac"]),
    ("importance ratio π_old/μ", ["is_ratio_p05", "is_ratio_p50", "is_ratio_p95"]),
    ("sampled tokens / s", ["sampled_tokens_per_s"]),
    ("staleness (versions)", ["staleness_mean", "staleness_max"]),
    ("seconds", ["rollout_s", "train_s", "sync_s"]),
]


def plot_training(metrics):
    """The training curves of `trainer.metrics` (or of a Run's `metrics()`), one panel per quantity."""
    metrics = metrics if isinstance(metrics, pd.DataFrame) else metrics.metrics()
    fig, axes = plt.subplots(2, 4, figsize=(14, 5.5))
    for ax, (title, columns) in zip(axes.flat, CURVES):
        for column in columns:
            if column in metrics:
                ax.plot(metrics["step"], metrics[column], marker=".", label=column)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        if len(columns) > 1:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
