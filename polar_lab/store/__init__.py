"""The run store: append-only JSON-lines records of calls and sessions in one run folder."""

from polar_lab.store.runstore import RunStore, calls_frame, load_calls, load_sessions

__all__ = ["RunStore", "calls_frame", "load_calls", "load_sessions"]
