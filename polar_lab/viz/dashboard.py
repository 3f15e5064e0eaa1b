"""Live dashboard of a Lab (ipywidgets): sessions, throughput, policy version, proxy and engine state.

A daemon thread ("polar-lab-dashboard") samples the Lab's counters (`lab.stats()`) every `interval` seconds and rewrites
one HTML widget, so it keeps updating while a rollout or a training run holds the notebook's cell (run that
in a background thread, or watch it from a second cell). Reading counters takes no locks on the hot path.
"""

from __future__ import annotations

import html
import threading
import time
from typing import Any, Protocol


class Watched(Protocol):
    """What the dashboard reads of a Lab (so viz sits below the Lab, which offers `lab.dashboard()`)."""

    closed: bool

    def stats(self) -> dict[str, Any]:
        ...

    def release(self, owned: Any) -> None:
        ...


class Dashboard:
    def __init__(self, lab: Watched, *, interval: float = 1.0):
        import ipywidgets as widgets

        self.lab = lab
        self.interval = interval
        self.widget = widgets.HTML()
        self._last: tuple[float, int, int] | None = None  # (time, calls, output tokens) of the previous sample
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refresh()

    def snapshot(self) -> dict[str, Any]:
        """The numbers the dashboard shows, as a dict (rates are since the previous snapshot)."""
        stats = self.lab.stats()
        now, calls, tokens = time.perf_counter(), stats["calls"], stats["output_tokens"]
        calls_s = tokens_s = 0.0
        if self._last is not None and now > self._last[0]:
            calls_s = (calls - self._last[1]) / (now - self._last[0])
            tokens_s = (tokens - self._last[2]) / (now - self._last[0])
        self._last = (now, calls, tokens)
        proxy, last = stats["proxy"], stats["last_restart"]
        return {"sessions_running": stats["sessions_running"], "sessions_finished": stats["sessions_finished"],
                "sessions_failed": stats["sessions_failed"], "calls": calls, "calls_per_s": calls_s,
                "tokens_per_s": tokens_s, "policy_version": stats["policy_version"], "proxy_state": proxy["state"],
                "calls_in_flight": proxy["in_flight"], "pauses": proxy["pauses"], "engine_state": stats["engine"],
                "engine_restarts": stats["engine_restarts"], "last_restart_reason": last["reason"] if last else None}

    def refresh(self) -> dict[str, Any]:
        snap = self.snapshot()
        self.widget.value = render(snap)
        return snap

    def start(self) -> Dashboard:
        """Keep refreshing in the background until `stop()` (or the Lab closes)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="polar-lab-dashboard", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def close(self) -> None:
        self.stop()
        self.lab.release(self)

    def _run(self) -> None:
        while not self._stop.wait(self.interval) and not self.lab.closed:
            self.refresh()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def render(snap: dict[str, Any]) -> str:
    colour = {"serving": "#2b8a3e", "draining": "#e67700", "paused": "#c92a2a"}.get(snap["proxy_state"], "#555")
    cells = [
        ("sessions", f"{snap['sessions_running']} running · {snap['sessions_finished']} finished · "
                     f"{snap['sessions_failed']} failed"),
        ("calls", f"{snap['calls']} recorded · {snap['calls_per_s']:.1f}/s · {snap['calls_in_flight']} in flight"),
        ("sampled tokens", f"{snap['tokens_per_s']:.0f}/s"),
        ("policy version", f"{snap['policy_version']} ({snap['pauses']} proxy pauses: syncs, restarts)"),
        ("proxy", f'<span style="color:{colour};font-weight:bold">{html.escape(snap["proxy_state"])}</span>'),
        ("engine", html.escape(f"{snap['engine_state']} · restarts: {snap['engine_restarts']}"
                               + (f" (last: {snap['last_restart_reason']})" if snap["last_restart_reason"] else ""))),
    ]
    rows = "".join(f'<tr><th style="text-align:left;padding-right:12px">{k}</th><td>{v}</td></tr>' for k, v in cells)
    return f'<table style="font-family:ui-monospace,monospace;font-size:13px">{rows}</table>'
