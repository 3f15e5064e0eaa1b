"""Seeing what the Lab does: token alignment (HTML), reward distributions and training curves
(matplotlib), and a live ipywidgets dashboard. Imported on use: the Lab itself needs none of it."""

from importlib import import_module
from typing import Any

_HOME = {
    "alignment_html": "polar_lab.viz.alignment", "show_alignment": "polar_lab.viz.alignment",
    "token_roles": "polar_lab.viz.alignment", "Dashboard": "polar_lab.viz.dashboard",
    "plot_rewards": "polar_lab.viz.plots", "plot_training": "polar_lab.viz.plots",
    "rewards_frame": "polar_lab.viz.plots", "zero_advantage_fraction": "polar_lab.viz.plots",
}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(import_module(_HOME[name]), name)
    raise AttributeError(f"module 'polar_lab.viz' has no attribute {name!r}")
