"""A run folder read back without an engine: its calls, sessions, trajectories, chain breaks and metrics.

`Run(path)` needs no vLLM, no GPU and no port, so a finished run can be analysed in any process:

    run = Run.latest()                      # or Run("data/runs/run-20261201-...")
    run.trajectories("prefix_merging")      # rewards from sessions.jsonl
    run.chain_breaks(); run.metrics()

A Lab reads its own folder through one (`lab.reader`), so there is one implementation of every read: the
Lab only lends it its store (whose index answers `session_ids=` queries without reading the whole file) and
its tokenizer. Calls are read from the file each time (a long run's calls do not stay in memory);
sessions incrementally, under a lock (a Lab's rollouts read them from several threads). A line torn by a
machine crash is skipped, counted in `torn_lines` and warned about once.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pandas as pd

from polar_lab.errors import StoreError, warn_at_caller
from polar_lab.rewards.table import COLUMNS as REWARD_COLUMNS
from polar_lab.store import RunStore, calls_frame
from polar_lab.store.delta import Expander
from polar_lab.store.runstore import JsonLines
from polar_lab.trajectory import sft
from polar_lab.trajectory.builders import BUILDERS
from polar_lab.trajectory.report import chain_breaks, drift_summary
from polar_lab.types import ModelCall, Session, Trajectory

_SESSION_FIELDS = {f.name for f in dataclasses.fields(Session)} - {"key", "base_url", "_closer"}


class Run:
    def __init__(self, path: str | Path, *, store: RunStore | None = None, tokenizer=None):
        """path: a run folder (data/runs/<run>). store: the RunStore writing it, when a Lab reads its own
        folder. tokenizer: for chain breaks; default the one of the model in the run's config.json."""
        self.path = Path(path)
        if not self.path.is_dir():
            raise StoreError(f"no run folder at {self.path}")
        if not any((self.path / name).exists() for name in ("calls.jsonl", "sessions.jsonl", "config.json")):
            raise StoreError(f"{self.path} is not a polar_lab run folder (no calls.jsonl, sessions.jsonl or "
                             f"config.json in it)")
        self._store = store
        self._tokenizer = tokenizer
        self._sessions_log = JsonLines(self.path / "sessions.jsonl")
        self._sessions: dict[str, dict[str, Any]] = {}  # id → the latest record of that session
        self._sessions_lock = threading.Lock()  # read-and-merge is one step
        self._torn_calls = (0, b"")  # (torn lines, unterminated tail) of calls.jsonl at the last full read
        self._warned: set[str] = set()

    @classmethod
    def latest(cls, runs_dir: str | Path = "data/runs") -> Run:
        """The run folder in `runs_dir` written to most recently."""
        folders = [p for p in Path(runs_dir).glob("*") if p.is_dir() and (p / "calls.jsonl").exists()]
        if not folders:
            raise StoreError(f"no run folders in {runs_dir}")
        return cls(max(folders, key=lambda p: (p / "calls.jsonl").stat().st_mtime))

    def __repr__(self) -> str:
        return f"<Run {self.path}>"

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def config(self) -> dict[str, Any]:
        """The LabConfig the run was made with, as a dict ({} if the folder has no config.json)."""
        path = self.path / "config.json"
        return orjson.loads(path.read_bytes()) if path.exists() else {}

    @property
    def torn_lines(self) -> dict[str, int]:
        """Lines that could not be read (torn by a machine crash, or referring to a call not before them), per file,
        as of the last read; a last line without its newline counts (in a run still being written it may be a write
        in progress)."""
        calls_torn, calls_tail = self._torn_calls
        log = self._sessions_log
        return {"calls.jsonl": calls_torn + bool(calls_tail), "sessions.jsonl": log.torn + bool(log.tail)}

    # ---- calls and sessions ------------------------------------------------------------------
    def call_records(self, session_ids: list[str] | None = None) -> list[ModelCall]:
        """The recorded calls, in recording order; only these sessions' when `session_ids` is given."""
        if session_ids is not None and self._store is not None:
            return self._store.read_calls(session_ids)  # by offset, without reading the rest
        log, expander = JsonLines(self.path / "calls.jsonl"), Expander()
        records = (expander.expand(record) for record in log.read())
        calls = [_call(record, self.path) for record in records if record is not None]
        self._torn_calls = (log.torn + len(expander.unresolved), log.tail)  # unreadable lines count as torn
        self._check_torn("calls.jsonl")
        if session_ids is None:
            return calls
        wanted = set(session_ids)
        return [c for c in calls if c.session_id in wanted]

    def calls(self) -> pd.DataFrame:
        """One row per recorded call (pandas)."""
        return calls_frame(self.call_records())

    def session_records(self) -> list[Session]:
        """The latest state of every session, as `Session` records (without their keys)."""
        self._read_sessions()
        return [_session(record) for record in self._sessions.values()]

    def sessions(self) -> pd.DataFrame:
        """The latest state of each session (one row per session)."""
        self._read_sessions()
        return pd.DataFrame(list(self._sessions.values()))

    def rewards(self) -> pd.DataFrame:
        """One row per closed session: group, task id, session id, reward, status, failure cause (the table reward
        plots draw).
        `step` is 0: a run folder keeps no step boundaries (a trainer's steps are in `trainer.rewards`)."""
        groups: dict[str | None, int] = {}
        rows = [{"step": 0, "group": groups.setdefault(s.group_id, len(groups)),
                 "task_id": (s.task or {}).get("id", s.group_id), "session_id": s.id, "reward": s.reward,
                 "status": s.status, "failure": s.info.get("failure")}
                for s in self.session_records() if s.status != "open"]
        return pd.DataFrame(rows, columns=REWARD_COLUMNS)

    # ---- what is built from them -------------------------------------------------------------
    def trajectories(self, builder: str | Callable[[list[ModelCall]], list[Trajectory]] = "prefix_merging", *,
                     session_ids: list[str] | None = None) -> list[Trajectory]:
        """Training samples rebuilt from the recorded calls; each carries its session's reward. builder: a name in
        `BUILDERS`, or a function of the calls (e.g. `partial(prefix_merging, train_constrained=True)`).

        A call answered after its session closed (one still in the engine when a run hit its deadline) is left
        out: the run is what its harness saw, and whether that call was written before the group was built
        would otherwise depend on timing."""
        if not callable(builder) and builder not in BUILDERS:
            raise ValueError(f"unknown builder {builder!r}; choose from {sorted(BUILDERS)}")
        self._read_sessions()
        closed = {sid: r.get("closed_at") for sid, r in self._sessions.items() if r.get("status") != "open"}
        calls = [c for c in self.call_records(session_ids)
                 if closed.get(c.session_id) is None or c.timings.get("responded", 0.0) <= closed[c.session_id]]
        trajectories = (builder if callable(builder) else BUILDERS[builder])(calls)
        for traj in trajectories:
            traj.reward = self._sessions.get(traj.session_id, {}).get("reward")
        return trajectories

    def sft_dataset(self, *, min_reward: float = 1.0, builder: str = "prefix_merging",
                    session_ids: list[str] | None = None):
        """The accepted runs' chains (reward >= min_reward) as SFT data: a `datasets.Dataset` with `messages` and
        `tools` (TRL's conversational form) and `input_ids` / `labels` / `assistant_masks` (the tokenized form,
        labels -100 where the loss mask is 0). See polar_lab.trajectory.sft."""
        return sft.sft_dataset(self, min_reward=min_reward, builder=builder, session_ids=session_ids)

    def sft_acceptance(self, *, min_reward: float = 1.0, session_ids: list[str] | None = None) -> pd.DataFrame:
        """Per task: runs, accepted runs, masked runs and the rate (Polar's Table 2)."""
        return sft.acceptance(self, min_reward=min_reward, session_ids=session_ids)

    def chain_breaks(self, *, session_ids: list[str] | None = None) -> pd.DataFrame:
        """Every prefix-merging chain break (of these sessions), classified (see polar_lab.trajectory.drift)."""
        self._read_sessions()
        harness_of = {sid: str(r.get("info", {}).get("harness", "unknown")) for sid, r in self._sessions.items()}
        return chain_breaks(self.call_records(session_ids), self.tokenizer, harness_of)

    def drift_report(self) -> pd.DataFrame:
        """Chain breaks counted by harness and class, with an example of each."""
        return drift_summary(self.chain_breaks())

    def metrics(self, trainer_dir: str = "grpo") -> pd.DataFrame:
        """The trainer's metrics, one row per step (`<run>/grpo/metrics.jsonl`, where GRPOTrainer writes them
        unless its `output_dir` says otherwise)."""
        path = self.path / trainer_dir / "metrics.jsonl"
        if not path.exists():
            raise StoreError(f"no trainer metrics in {path}: no trainer wrote into this run folder")
        return pd.DataFrame(JsonLines(path).read())

    @property
    def tokenizer(self):
        """The tokenizer of the run's model (loaded from config.json's model folder the first time)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            model = self.config.get("engine", {}).get("model")
            if not model:
                raise StoreError(f"{self.path}/config.json names no model: pass Run(path, tokenizer=...)")
            self._tokenizer = AutoTokenizer.from_pretrained(model)
        return self._tokenizer

    # ---- internals -----------------------------------------------------------------------------
    def _read_sessions(self) -> None:
        with self._sessions_lock:
            for record in self._sessions_log.read():
                self._sessions[record["id"]] = record
        self._check_torn("sessions.jsonl")

    def _check_torn(self, name: str) -> None:
        torn = self.torn_lines[name]
        if torn and name not in self._warned and self._store is None:  # a live Lab's tail is a write in progress
            self._warned.add(name)
            warn_at_caller(f"{self.path / name}: {torn} torn line(s) skipped (a write cut by a machine crash); the "
                           f"records around them are whole")


def _call(record: dict[str, Any], path: Path) -> ModelCall:
    try:
        return ModelCall.from_record(record)
    except TypeError as exc:
        names = {f.name for f in dataclasses.fields(ModelCall)}
        raise StoreError(f"{path}/calls.jsonl was written by a different polar_lab build: its records lack "
                         f"{sorted(names - set(record))} ({exc})") from None


def _session(record: dict[str, Any]) -> Session:
    data = {k: v for k, v in record.items() if k in _SESSION_FIELDS}
    info = dict(data.get("info") or {})
    if "reward_parts" not in record and "reward_parts" in info:  # written before it was a field
        data["reward_parts"] = info.pop("reward_parts")
    data["info"] = info
    return Session(key="", **data)
