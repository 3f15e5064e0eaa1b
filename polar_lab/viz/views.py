"""What a Lab shows of itself while it runs: live counters, training curves, replicas, the dashboard.

`LabViews` is the part of the Lab (lab.py) that only reads: its methods read the proxy's sessions and gate, the run
store's counters, the engine's supervisor and the trainers the Lab holds, and change nothing. The dashboard
(viz/dashboard.py) draws from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import pandas as pd

from polar_lab.engine.supervisor import Restart


@runtime_checkable
class ShowsTraining(Protocol):
    """What the Lab's dashboard reads of a trainer it holds (GRPOTrainer, grpo/trainer.py, is one): the metrics of
    each step, and each run's reward with its step."""

    history: Sequence[dict[str, Any]]
    reward_log: Sequence[dict[str, Any]]
    xrays: Any  # grpo/xray.py's XRays: `steps`, step number → that step's token table


class LabViews:
    """Mixed into the Lab, which provides `registry`, `writer`, `service`, `supervisor`, `engine`, `policy_version`,
    `owned(kind)`, `adopt(obj)` and `_last_trainer` (the latest trainer it released)."""

    def stats(self) -> dict[str, Any]:
        """Live counters (what the dashboard shows): sessions by status, calls and sampled tokens recorded, the
        policy version, the proxy's gate and the engine's state and restarts."""
        statuses = [s.status for s in self.registry.all()]
        engine = self.supervisor.status()
        return {"sessions_running": statuses.count("open"), "sessions_finished": statuses.count("closed"),
                "sessions_failed": statuses.count("error") + statuses.count("timeout"),
                "calls": self.writer.num_calls, "output_tokens": self.writer.num_output_tokens,
                "policy_version": self.policy_version, "proxy": self.proxy_state,
                "engine_busy_s": self.supervisor.busy_seconds, **engine, **self.engine.replica_counts()}

    def training(self) -> dict[str, Any]:
        """What the dashboard plots of training: the newest attached trainer's metrics per step (`history`), its
        runs' rewards as (step, reward) and the steps whose loss X-ray it keeps; without a trainer, the rewards of
        this Lab's finished runs (step 0)."""
        trainer = self._trainer()
        if trainer is not None:
            return {"history": list(trainer.history), "xray_steps": list(trainer.xrays.steps),
                    "rewards": [(r["step"], r["reward"]) for r in list(trainer.reward_log) if r["reward"] is not None]}
        return {"history": [], "rewards": [(0, s.reward) for s in self.registry.all()
                                           if s.status != "open" and s.reward is not None]}

    def show_loss(self, step: int | None = None):
        """The loss X-ray of a training step (default the latest kept; GRPOConfig.xray_steps): every token of its
        samples coloured by the engine-vs-trainer gap, the importance weight, the advantage or the staleness, with
        the rule that decided it; filter by session, chain and rule (viz/xray.py)."""
        from polar_lab.viz.xray import show_loss

        trainer = self._trainer()
        kept = trainer.xrays.steps if trainer is not None else {}
        if not kept or (step is not None and step not in kept):
            raise KeyError(f"no X-ray of step {step if step is not None else '(any)'}: the trainer keeps the last "
                           f"GRPOConfig.xray_steps steps ({list(kept) or 'none yet'})")
        step = step if step is not None else next(reversed(kept))
        return show_loss(kept[step], step)

    def _trainer(self) -> Any:
        """The newest attached trainer, else the latest released (a closed trainer's curves stay on show)."""
        trainers = self.owned(ShowsTraining)
        return trainers[-1] if trainers else self._last_trainer

    def replicas(self) -> pd.DataFrame:
        """One row per engine replica (engine/replicas.py): serving, pid, requests in flight, sessions routed to
        it, policy version, busy seconds, restarts (its own, and the whole engine's). A single engine is replica 0."""
        rows = self.engine.replica_status()
        for row in rows:
            row["restarts"] += len(self.engine_restarts)
        return pd.DataFrame(rows)

    def replica_moves(self) -> pd.DataFrame:
        """Every session moved to another replica (its own was dead, out of rotation or over its queue bound)."""
        return pd.DataFrame([dataclasses.asdict(m) for m in self.engine.moves],
                            columns=["route", "from_replica", "to_replica", "why", "at"])

    @property
    def engine_restarts(self) -> list[Restart]:
        """Every replacement of the engine process so far: reason, automatic or not, startup time, outcome."""
        return list(self.supervisor.restarts)

    def dashboard(self, *, interval: float = 1.0, start: bool = True):
        """A live ipywidgets dashboard of this Lab: its counters (sessions, calls/s, tokens/s, version, proxy and
        engine state) and plots (rewards per step, throughput and engine busy, sessions, version and staleness,
        an attached trainer's loss and reward mean). Display it as the last expression of a cell; it refreshes
        every `interval` s in a background thread until the Lab closes."""
        from polar_lab.viz.dashboard import Dashboard

        for old in self.owned(Dashboard):  # the cell run again: one dashboard draws at a time
            old.close()
        board = Dashboard(self, interval=interval)
        self.adopt(board)
        return board.start() if start else board

    @property
    def proxy_state(self) -> dict[str, Any]:
        """serving / draining / paused, calls in flight, pauses so far (see polar_lab.proxy.pause)."""
        return self.service.gate.stats()

    @property
    def engine_busy_seconds(self) -> float:
        """Seconds the engine has spent stepping requests since the Lab started, restarts included (for busy
        fractions)."""
        return self.supervisor.busy_seconds
