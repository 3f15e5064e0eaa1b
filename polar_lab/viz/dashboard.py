"""Live dashboard of a Lab (ipywidgets): the counters, and plots of the run as it goes.

A daemon thread ("polar-lab-dashboard") samples the Lab (`lab.stats()`, `lab.training()`) every `interval` seconds,
keeps a time series of the samples, and redraws a table (sessions, calls, tokens/s, policy version, proxy and
engine state) every time and, at most every `plot_interval` seconds and only when the Lab moved, one image of six
plots — the reward distribution per training step, sampled tokens/s
and engine busy over time, sessions running / finished / failed over time, the policy version and the rollouts'
staleness over time, and, once a trainer is attached to the Lab, its loss curves. It keeps updating while a
rollout or a training run holds the notebook's cell, never blocks the kernel (drawing is matplotlib's Agg canvas
in that thread, not pyplot; 0.5 s of one core per redraw of a 200-step run here, so at most 10% of a core),
and stops when the Lab closes. Re-running
`lab.dashboard()` stops the previous one. An error in a refresh is logged and the next one tried. Reading the
counters takes no locks on the hot path.
"""

from __future__ import annotations

import html
import io
import logging
import threading
import time
from collections import deque
from typing import Any, Protocol

HISTORY = 600  # samples kept for the time plots (10 minutes at the default interval)
STEPS = 30  # training steps the per-step plots show (the latest)
log = logging.getLogger(__name__)


class Watched(Protocol):
    """What the dashboard reads of a Lab (so viz sits below the Lab, which offers `lab.dashboard()`)."""

    closed: bool

    def stats(self) -> dict[str, Any]:
        ...

    def training(self) -> dict[str, Any]:
        ...

    def release(self, owned: Any) -> None:
        ...

    def show_loss(self, step: int | None = None) -> Any:
        ...


class Dashboard:
    def __init__(self, lab: Watched, *, interval: float = 1.0, plot_interval: float = 5.0, plots: bool = True):
        import ipywidgets as widgets

        self.lab = lab
        self.interval = interval
        self.table = widgets.HTML()
        self.image = widgets.Image(format="png", layout=widgets.Layout(max_width="980px"))
        self.caption = widgets.HTML()
        # the samples behind the reward plot: a step's loss X-ray (viz/xray.py), opened below the plots
        self.step = widgets.Dropdown(description="X-ray of step", options=[], value=None)
        self.xray = widgets.VBox([])
        self.step.observe(self._open_xray, names="value")
        self.widget = widgets.VBox([self.table, self.image, self.caption, self.step, self.xray] if plots
                                   else [self.table])
        self.plots, self.plot_interval = plots, plot_interval
        self._drawn: tuple[float, Any] = (-1e9, None)  # (when, what it showed) of the last redraw
        self.series: deque[dict[str, Any]] = deque(maxlen=HISTORY)  # one snapshot per refresh
        self.plotted: dict[str, int] = {}  # points drawn in each plot by the last refresh
        self._last: tuple[float, int, int, float] | None = None  # (time, calls, output tokens, busy s) last sample
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._draw = threading.Lock()
        self.refresh()

    def snapshot(self, *, advance: bool = False) -> dict[str, Any]:
        """The numbers the dashboard shows, as a dict (rates are since the previous refresh; `advance`: this is
        the new reference, as a refresh makes it)."""
        stats = self.lab.stats()
        now, calls, tokens, busy = (time.perf_counter(), stats["calls"], stats["output_tokens"],
                                    stats.get("engine_busy_s", 0.0))
        calls_s = tokens_s = busy_frac = 0.0
        if self._last is not None and now > self._last[0]:
            dt = now - self._last[0]
            calls_s, tokens_s = (calls - self._last[1]) / dt, (tokens - self._last[2]) / dt
            busy_frac = min(1.0, max(0.0, (busy - self._last[3]) / dt))
        if advance or self._last is None:
            self._last = (now, calls, tokens, busy)
        proxy, last = stats["proxy"], stats["last_restart"]
        return {"t": now - self._t0, "sessions_running": stats["sessions_running"],
                "sessions_finished": stats["sessions_finished"], "sessions_failed": stats["sessions_failed"],
                "calls": calls, "calls_per_s": calls_s, "tokens_per_s": tokens_s, "engine_busy": busy_frac,
                "policy_version": stats["policy_version"], "proxy_state": proxy["state"],
                "calls_in_flight": proxy["in_flight"], "pauses": proxy["pauses"], "engine_state": stats["engine"],
                "engine_restarts": stats["engine_restarts"], "last_restart_reason": last["reason"] if last else None}

    def refresh(self, *, plots: bool = False) -> dict[str, Any]:
        """Sample the Lab and redraw the table, and the plots when due (`plots`: now, whatever is due)."""
        with self._draw:  # the thread and a notebook cell may both refresh
            snap = self.snapshot(advance=True)
            self.series.append(snap)
            self.table.value = render(snap)
            if self.plots:
                self._plot(snap, force=plots)
            return snap

    def _plot(self, snap: dict[str, Any], *, force: bool = False) -> None:
        """Redraw the plots when `plot_interval` has passed and the Lab moved (a redraw costs up to ~0.5 s of a core;
        between them not even the trainer's tables are read)."""
        when, shown = self._drawn
        if not force and time.perf_counter() - when < self.plot_interval:
            return
        training = self.lab.training()
        state = (snap["calls"], snap["sessions_running"], snap["sessions_finished"], snap["sessions_failed"],
                 snap["policy_version"], len(training.get("history") or []), len(training.get("rewards") or []))
        if not force and state == shown:
            return
        self.image.value, self.plotted = draw(list(self.series), training)
        self.caption.value = caption(self.plotted)
        steps = list(training.get("xray_steps") or [])
        if list(self.step.options) != steps:  # the steps whose X-ray the trainer keeps
            self.step.options = steps
        self._drawn = (time.perf_counter(), state)

    def _open_xray(self, change: dict[str, Any]) -> None:
        self.xray.children = () if change["new"] is None else (self.lab.show_loss(change["new"]),)

    def redraw(self) -> dict[str, int]:
        """Refresh now, the plots too; what each plot holds."""
        self.refresh(plots=True)
        return self.plotted

    def start(self) -> Dashboard:
        """Keep refreshing in the background until `stop()` (or the Lab closes)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="polar-lab-dashboard", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def close(self) -> None:
        self.stop()
        self.lab.release(self)

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval * (1 + min(failures, 10))) and not self.lab.closed:
            try:
                self.refresh()
                failures = 0
            except Exception:  # noqa: BLE001 - an engine restarting under it, a closing Lab: the next one may work
                if not self.lab.closed:
                    log.warning("the dashboard's refresh failed; trying again", exc_info=failures == 0)
                failures += 1

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def render(snap: dict[str, Any]) -> str:
    colour = {"serving": "#2b8a3e", "draining": "#e67700", "paused": "#c92a2a"}.get(snap["proxy_state"], "#555")
    cells = [
        ("sessions", f"{snap['sessions_running']} running · {snap['sessions_finished']} finished · "
                     f"{snap['sessions_failed']} failed"),
        ("calls", f"{snap['calls']} recorded · {snap['calls_per_s']:.1f}/s · {snap['calls_in_flight']} in flight"),
        ("sampled tokens", f"{snap['tokens_per_s']:.0f}/s · engine busy {snap['engine_busy']:.0%}"),
        ("policy version", f"{snap['policy_version']} ({snap['pauses']} proxy pauses: syncs, restarts)"),
        ("proxy", f'<span style="color:{colour};font-weight:bold">{html.escape(snap["proxy_state"])}</span>'),
        ("engine", html.escape(f"{snap['engine_state']} · restarts: {snap['engine_restarts']}"
                               + (f" (last: {snap['last_restart_reason']})" if snap["last_restart_reason"] else ""))),
    ]
    rows = "".join(f'<tr><th style="text-align:left;padding-right:12px">{k}</th><td>{v}</td></tr>' for k, v in cells)
    return f'<table style="font-family:ui-monospace,monospace;font-size:13px">{rows}</table>'


def caption(plotted: dict[str, int]) -> str:
    """What the plots hold, in words (a screen reader's view of the image, and what a browser test reads)."""
    text = " · ".join(f"{name}: {n}" for name, n in plotted.items())
    return f'<div class="polar-lab-plotted" style="font-size:11px;color:#666">points plotted — {html.escape(text)}</div>'


def draw(series: list[dict[str, Any]], training: dict[str, Any]) -> tuple[bytes, dict[str, int]]:
    """The six plots as one PNG, and how many points each holds. matplotlib's object API on an Agg canvas: safe
    off the main thread (pyplot is not)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5.6), dpi=80)
    fig.subplots_adjust(left=0.05, right=0.95, bottom=0.09, top=0.94, wspace=0.3, hspace=0.45)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3)
    t = [s["t"] for s in series]
    plotted = {}

    ax = axes[0][0]  # rewards per step (the latest STEPS)
    per_step: dict[int, list[float]] = {}
    for step, reward in training.get("rewards") or []:
        per_step.setdefault(step, []).append(reward)
    steps = sorted(per_step)[-STEPS:]
    if steps:
        ax.boxplot([per_step[step] for step in steps], positions=steps, widths=0.6)
        for step in steps:
            ax.scatter([step] * len(per_step[step]), per_step[step], s=10, alpha=0.5, color="#1c7ed6")
    ax.set(title="reward per step" if training.get("history") else "rewards of finished runs", xlabel="step")
    plotted["rewards"] = sum(len(per_step[step]) for step in steps)

    ax = axes[0][1]  # throughput and engine busy
    ax.plot(t, [s["tokens_per_s"] for s in series], color="#2b8a3e", label="sampled tokens/s")
    ax.set(title="sampled tokens/s · engine busy", xlabel="s")
    busy = ax.twinx()
    busy.plot(t, [s["engine_busy"] for s in series], color="#e67700", alpha=0.7, label="engine busy")
    busy.set_ylim(0, 1.05)
    plotted["throughput"] = len(series)

    ax = axes[0][2]  # sessions
    for key, colour in (("sessions_running", "#1c7ed6"), ("sessions_finished", "#2b8a3e"),
                        ("sessions_failed", "#c92a2a")):
        ax.plot(t, [s[key] for s in series], color=colour, label=key.removeprefix("sessions_"))
    ax.set(title="sessions", xlabel="s")
    ax.legend(loc="upper left", fontsize=8)
    plotted["sessions"] = len(series)

    ax = axes[1][0]  # policy version over time; the trained groups' staleness per step
    ax.step(t, [s["policy_version"] for s in series], where="post", color="#5f3dc4")
    ax.set(title="policy version (line) · staleness per step (dots)", xlabel="s")
    history = (training.get("history") or [])[-STEPS:]
    stale = [(h["step"], h["staleness_mean"]) for h in history if h.get("staleness_mean") is not None]
    if stale:
        ax2 = ax.twiny()
        ax2.plot(*zip(*stale), "o", color="#e67700")
        ax2.set_xlabel("step")
    plotted["versions"] = len(series)
    plotted["staleness"] = len(stale)

    ax = axes[1][1]  # the trainer's loss
    ax.set(title="trainer loss" if history else "trainer loss (no trainer attached)", xlabel="step")
    losses = [(h["step"], h["loss"]) for h in history if h.get("loss") is not None]
    if losses:
        ax.plot(*zip(*losses), "o-", color="#c92a2a", label="loss")
        kl = [(h["step"], h["kl"]) for h in history if h.get("kl") is not None]
        if kl:
            ax.plot(*zip(*kl), "s--", color="#868e96", label="kl")
        ax.legend(fontsize=8)
    plotted["loss"] = len(losses)

    ax = axes[1][2]  # the trainer's reward mean
    means = [(h["step"], h["reward_mean"]) for h in history if h.get("reward_mean") is not None]
    ax.set(title="reward mean per step", xlabel="step")
    if means:
        ax.plot(*zip(*means), "o-", color="#1c7ed6")
    plotted["reward_mean"] = len(means)

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue(), plotted
