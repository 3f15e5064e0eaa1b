"""Replay a recorded run up to turn k and branch it live: `lab.replay(session_id, until_turn=k, harness=..., branches=N)`.

The harness — a Python agent or a CLI agent in the sandbox, unmodified — runs again on the recorded session's task,
N times. In each branch the proxy answers the first k−1 calls from the record (proxy/replay.py: matched by the
prompt it renders, id for id; no engine time), and from turn k on samples live, so the N branches share the
recorded prefix exactly and differ from turn k. A branch whose harness sends a different prompt before turn k is
reported with the first differing token and goes live from there.

What it is for: per-turn credit (the reward spread of N branches at turn k, turn by turn along a failed run), exact
reruns of a recorded run (until_turn past its last call: nothing is sampled), and regression tests of a new harness
version against a recorded run (does it still send the recorded prompts?).
"""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd

from polar_lab.errors import ConfigError
from polar_lab.proxy.replay import Script
from polar_lab.rewards.registry import get_evaluator
from polar_lab.rollout import Host, RolloutSpec, rollout_async
from polar_lab.run import Run
from polar_lab.types import Evaluator, Group, Harness

T = TypeVar("T")


class ReplayHost(Host):
    """What a replay needs of a Lab beyond a rollout's: its run folder's reader and its loop."""

    reader: Run

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        ...


@dataclass
class Replayed:
    """The branches of one replay: their group (sessions, rewards, trajectories) and what each replayed."""

    source: str  # the recorded session
    until_turn: int
    group: Group

    def frame(self) -> pd.DataFrame:
        """One row per branch: session, reward, calls replayed, exact (every call before turn k from the record),
        and where it diverged (call, token) if it did."""
        rows = []
        for s in self.group.sessions:
            info = s.info.get("replay", {})
            diverged = info.get("diverged") or {}
            rows.append({"session_id": s.id, "reward": s.reward, "status": s.status,
                         "replayed": info.get("replayed", 0), "exact": info.get("exact", False),
                         "diverged_call": diverged.get("call_index"), "diverged_token": diverged.get("token")})
        return pd.DataFrame(rows)

    @property
    def exact(self) -> int:
        """Branches that replayed every call before turn k."""
        return int(self.frame()["exact"].sum())

    def __repr__(self) -> str:
        rewards = [s.reward for s in self.group.sessions if s.reward is not None]
        spread = f", rewards {min(rewards):.2f}..{max(rewards):.2f}" if rewards else ""
        return (f"Replayed({self.source}, until_turn={self.until_turn}: {len(self.group.sessions)} branches, "
                f"{self.exact} exact{spread})")


def replay(host: ReplayHost, source: str, *, until_turn: int, harness: Harness, branches: int = 4,
           run: Run | str | Path | None = None, evaluator: str | Evaluator | None = None,
           spec: RolloutSpec | None = None,
           sampling: dict[str, Any] | None = None, seed: int | None = None, progress: bool = False) -> Replayed:
    """Run `harness` `branches` times on the task of recorded session `source` (of `run`, default the host's own
    folder), its first `until_turn` − 1 calls answered from the record. sampling: forced on the live calls (default:
    the recorded session's, without its seed, so branches differ; `seed` makes them reproducible)."""
    if until_turn < 1:
        raise ConfigError(f"until_turn counts turns from 1 (1: everything live), got {until_turn}")
    recorded = run if isinstance(run, Run) else Run(run) if run is not None else host.reader
    calls = recorded.call_records([source])
    session = next((s for s in recorded.session_records() if s.id == source), None)
    if session is None or not calls:
        raise ConfigError(f"no recorded session {source!r} with calls in {recorded.path}")
    forced = sampling if sampling is not None else {k: v for k, v in session.sampling.items() if k != "seed"}
    groups = host.run(rollout_async(host, [session.task or {}], harness, num_generations=branches,
                                    evaluator=get_evaluator(evaluator), concurrency=branches, spec=spec or RolloutSpec(),
                                    builder="prefix_merging", progress=progress, sampling=forced, seed=seed,
                                    replay=lambda: Script(calls, live_from=until_turn - 1)))
    return Replayed(source=source, until_turn=until_turn, group=groups[0])
