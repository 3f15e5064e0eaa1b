"""Seeing what the Lab does: token alignment (HTML), reward distributions and training curves
(matplotlib), and a live ipywidgets dashboard. Imported on use: the Lab itself needs none of it."""

from polar_lab._lazy import lazy_exports

_HOME = {
    "alignment_html": "polar_lab.viz.alignment", "show_alignment": "polar_lab.viz.alignment",
    "token_roles": "polar_lab.viz.alignment", "Dashboard": "polar_lab.viz.dashboard",
    "plot_rewards": "polar_lab.viz.plots", "plot_training": "polar_lab.viz.plots",
    "rewards_frame": "polar_lab.rewards.table", "zero_advantage_fraction": "polar_lab.viz.plots",
}
__all__, __getattr__ = lazy_exports("polar_lab.viz", _HOME)
