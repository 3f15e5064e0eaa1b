"""Append-only run folder; the RunStore owns its open files, writers on any thread share one lock.

Layout of `data/runs/<run>/`:
    calls.jsonl     one `ModelCall` per line, appended before the proxy returns the response; what an earlier
                    line of the session holds is referenced, not repeated (store/delta.py), and readers
                    rebuild whole records
    sessions.jsonl  one line per session event (opened, closed with reward)
    config.json     the LabConfig the run was made with

Durability contract: each record is one `write()` of a whole line followed by `flush()`, so once a
response has left the proxy its record is in the kernel's page cache and survives the process being
SIGKILLed. `fsync=True` also makes it survive a machine crash, at ~1 ms per call. A torn last line (only
possible on a machine crash) is skipped by readers; reopening the folder first ends it with a newline, so
records appended after it stay whole.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pandas as pd

from polar_lab.errors import StoreError
from polar_lab.store.delta import Compactor, Expander
from polar_lab.types import ModelCall, Session

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def new_run_name() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S") + f"-{time.time_ns() % 1_000_000:06d}"


def check_run_name(name: str) -> str:
    """Run names become folder names: no separators, no '..', no leading dot."""
    if not _RUN_NAME.match(name) or ".." in name:
        raise StoreError(f"bad run name {name!r}: use letters, digits, '.', '_' and '-' (no '..')")
    return name


class RunStore:
    def __init__(self, run_dir: str | Path, *, fsync: bool = False):
        self.run_dir = Path(run_dir)
        self.fsync = fsync
        self._lock = threading.Lock()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._calls = open(self.run_dir / "calls.jsonl", "ab", buffering=0)
            self._sessions = open(self.run_dir / "sessions.jsonl", "ab", buffering=0)
        except OSError as exc:
            raise StoreError(f"cannot open run folder {self.run_dir}: {exc}") from exc
        self.num_calls = 0
        self.num_output_tokens = 0  # sampled tokens recorded (dashboards: tokens/s)
        # session id → (offset, length) of its call lines, so a rollout reads back only its own calls
        self._call_index: dict[str, list[tuple[int, int]]] = {}
        self._compactor = Compactor()  # this store's records only: a reopened folder never points before itself
        for fh in (self._calls, self._sessions):
            _end_torn_line(fh)
        self._calls_end = self._calls.seek(0, os.SEEK_END)

    def append_call(self, call: ModelCall) -> None:
        with self._lock:
            record = self._compactor.compact(call, call.record())
            try:
                line = orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
                whole_request = True
            except TypeError:  # a request nested deeper than orjson writes (254): the call is kept, the body as text
                record.pop("request_ref", None)
                record.pop("request_tail", None)
                record["request"] = {"unrecorded": "nested deeper than 254 levels", "text": _as_text(call.request)}
                line = orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
                whole_request = False
            self._write(self._calls, line)
            self._compactor.written(call, whole_request=whole_request)
            self._call_index.setdefault(call.session_id, []).append((self._calls_end, len(line)))
            self._calls_end += len(line)
            self.num_calls += 1
            self.num_output_tokens += len(call.output_ids)

    def forget(self, session_id: str) -> None:
        """A closed session's calls will not be continued: later records need not point at them."""
        with self._lock:
            self._compactor.forget(session_id)

    def read_calls(self, session_ids: list[str]) -> list[ModelCall]:
        """The recorded calls of these sessions (of this process's run), in recording order, without
        reading the rest of calls.jsonl."""
        with self._lock:
            spans = sorted(span for sid in set(session_ids) for span in self._call_index.get(sid, []))
        calls, expander = [], Expander()  # a session's references are to its own earlier calls
        with open(self.run_dir / "calls.jsonl", "rb") as fh:
            for offset, length in spans:
                fh.seek(offset)
                record = expander.expand(orjson.loads(fh.read(length)))
                if record is not None:
                    calls.append(ModelCall.from_record(record))
        return calls

    def append_session(self, session: Session, event: str) -> None:
        self._append(self._sessions, {"event": event, "time": time.time(), **session.record()})

    def write_json(self, name: str, data: Any) -> None:
        (self.run_dir / name).write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))

    def _append(self, fh, data: dict[str, Any]) -> None:
        line = orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
        with self._lock:
            self._write(fh, line)

    def _write(self, fh, line: bytes) -> None:
        if fh.closed:
            raise StoreError(f"run store {self.run_dir} is closed")
        view = memoryview(line)
        while view:  # unbuffered: one write() per record, unless the OS takes less (a full disk): then the rest
            written = fh.write(view)
            if not written:
                raise StoreError(f"run store {self.run_dir}: a record could not be written whole")
            view = view[written:]
        if self.fsync:
            os.fsync(fh.fileno())

    def close(self) -> None:
        with self._lock:
            self._calls.close()
            self._sessions.close()


def _end_torn_line(fh) -> None:
    """If the file does not end with a newline (a write cut by a machine crash), end the fragment."""
    size = os.fstat(fh.fileno()).st_size
    if size:
        with open(fh.name, "rb") as reader:
            reader.seek(size - 1)
            if reader.read(1) != b"\n":
                fh.write(b"\n")


class JsonLines:
    """Reads a JSON-lines file a writer may still be appending to: each `read()` parses only the whole lines
    added since the last one (thread-safe). A line that does not parse (torn by a machine crash) is skipped
    and counted in `torn`; a last line without its newline is left for the next read (a write in progress,
    or — in a finished run — a write a crash cut: `tail` is then not empty)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.torn = 0
        self.tail = b""  # bytes after the last newline, as of the last read
        self._lock = threading.Lock()

    def read(self) -> list[dict[str, Any]]:
        """The records appended since the previous read."""
        if not self.path.exists():
            return []
        with self._lock:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
            end = data.rfind(b"\n") + 1
            self.offset += end
            self.tail = data[end:]
            records = []
            for line in data[:end].split(b"\n"):
                if not line:
                    continue
                try:
                    records.append(orjson.loads(line))
                except orjson.JSONDecodeError:
                    self.torn += 1  # the records around it are whole
            return records


def load_calls(run_dir: str | Path) -> list[ModelCall]:
    """Every completed call of a run, in the order they were recorded (whole: references resolved; a record whose
    reference cannot be resolved is skipped, as a torn line is)."""
    expander = Expander()
    records = (expander.expand(r) for r in JsonLines(Path(run_dir) / "calls.jsonl").read())
    return [ModelCall.from_record(r) for r in records if r is not None]


def load_sessions(run_dir: str | Path) -> pd.DataFrame:
    """The latest state of each session of a run (one row per session)."""
    rows = {r["id"]: r for r in JsonLines(Path(run_dir) / "sessions.jsonl").read()}
    return pd.DataFrame(list(rows.values()))


def calls_frame(calls: list[ModelCall]) -> pd.DataFrame:
    """One row per call: the scalar facts first, the token lists last."""
    rows = []
    for c in calls:
        t = c.timings
        rows.append({
            "call_id": c.call_id, "session_id": c.session_id, "call_index": c.call_index,
            "choice_index": c.choice_index, "api": c.api, "model": c.model,
            "prompt_tokens": len(c.prompt_ids), "completion_tokens": len(c.output_ids),
            "finish_reason": c.finish_reason, "max_tokens": c.sampling.get("max_tokens"),
            "max_tokens_source": c.sampling.get("max_tokens_source"), "policy_version": c.policy_version,
            "replica": c.replica, "cached_tokens": c.cached_tokens, "replayed": c.replayed,
            "tool_calls": c.parse.get("num_tool_calls", 0), "tool_parse_errors": len(c.parse.get("errors", [])),
            "render_mode": c.render.get("mode"), "total_s": t.get("total_s"), "engine_s": t.get("engine_s"),
            "proxy_s": t.get("proxy_s"), "first_delta_s": t.get("first_delta_s"), "received": t.get("received"),
            "prompt_ids": c.prompt_ids, "output_ids": c.output_ids, "output_logprobs": c.output_logprobs,
        })
    return pd.DataFrame(rows)


def _as_text(value: Any, limit: int = 1_000_000) -> str:
    """The standard library's JSON of a value (it nests as deep as Python recurses), cut at `limit` characters."""
    try:
        return json.dumps(value)[:limit]
    except (RecursionError, TypeError, ValueError):
        return "(too deeply nested to write)"
