"""The engine protocol: prompt ids in, sampled ids + sampler logprobs + policy versions out.

The engine knows nothing about chat templates, tools or HTTP; the proxy renders and parses.
`submit` is thread-safe and returns a `concurrent.futures.Future`, so any thread can use it; `generate` is
the asyncio form, which also streams: given `on_delta`, it calls it on the caller's loop with the tokens of
each engine step as they are sampled (`TokenDelta`), all of them before it returns the Generation.
Cancelling either aborts the request in the engine.

A new engine (a replica set, a remote engine) provides every member of `Engine` — the proxy, the Lab's
supervisor and the trainer call nothing else, and probe for nothing:
    identity      model_name, model_path, max_model_len, pid (None when not a local process)
    state         policy_version, alive, failure, busy_seconds, running, weights_file, weights_dtype
    requests      submit, generate
    weights       load_weights(state_dict, version=), preload_weights_file(path), load_weights_file(path, version=)
    lifecycle     wait_ready(timeout), close(); on_exit(engine, reason) is called if it dies unasked
    replicas      replica_status(), replica_counts(), moves, forget(route), weights_transport — one engine
                  process is replica 0 (`OneProcess` gives it these), a ReplicaSet has a row per replica
`VLLMEngine` (engine/vllm_engine.py) is the real one; `ReplicaSet` (engine/replicas.py) puts several behind
one (local processes, or Ray actors: engine/ray_replicas.py); `ScriptedEngine` (engine/fake.py) serves unit tests.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from polar_lab.types import Generation, SamplingSpec, TokenDelta


@runtime_checkable
class Engine(Protocol):
    model_name: str
    model_path: str
    max_model_len: int
    pid: int | None  # the engine process, when there is one
    busy_seconds: float  # wall time spent stepping requests (busy fraction = Δbusy / Δwall)
    running: int  # requests the engine is working on (as it last reported)
    weights_file: Path | None  # the file of the weights being served, when they came from a load
    weights_dtype: torch.dtype | None  # what it stores floating weights as: a sync writes them so (None: as given)
    on_exit: Callable[[Engine, str], None] | None  # set by the owner; called once if the engine dies unasked

    @property
    def policy_version(self) -> int:
        """Version of the weights new tokens are sampled with; 0 = as loaded, +1 per `load_weights`."""
        ...

    @property
    def alive(self) -> bool:
        """True while it serves; False once it failed or was closed."""
        ...

    @property
    def failure(self) -> str | None:
        """Why it stopped serving (None while it serves)."""
        ...

    def submit(self, prompt_ids: list[int], spec: SamplingSpec, *,
               route: str | None = None) -> concurrent.futures.Future[Generation]:
        """route: a key that keeps related requests on one replica (the proxy passes the session id, so a
        session's calls find its prefix cache); an engine without replicas ignores it."""
        ...

    async def generate(self, prompt_ids: list[int], spec: SamplingSpec,
                       on_delta: Callable[[TokenDelta], None] | None = None, *,
                       route: str | None = None) -> Generation:
        ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], *, version: int | None = None) -> int:
        """Replace the live weights between two engine steps; returns the new policy version (`version` if
        given: a replacement engine carries on from the version its weights had)."""
        ...

    def preload_weights_file(self, path: str | Path) -> str | None:
        """Get ready to load this file while still serving (a standby copy of the model: engine/standby.py), so
        that the `load_weights_file(path)` that follows only swaps it in; None when ready, else why that load
        will do all the work. An optimisation only: it never changes what the load serves."""
        ...

    def load_weights_file(self, path: str | Path, *, version: int | None = None) -> int:
        """`load_weights` from a safetensors file (engine/weights.py) (a dead engine's `weights_file`)."""
        ...

    def wait_ready(self, timeout: float = 900.0) -> Engine:
        ...

    def close(self) -> None:
        ...

    # ---- replica views (the Lab's `replicas()`, `replica_moves()` and `stats()` read these) ----
    moves: Any  # the sessions moved to another replica, oldest first (engine/replicas.py: Move)

    def replica_status(self) -> list[dict[str, Any]]:
        """One row per replica: replica, serving, pid, in_flight, sessions, policy_version, busy_s, restarts,
        failure."""
        ...

    def replica_counts(self) -> dict[str, Any]:
        """What `Lab.stats()` adds for replicas (replicas, replicas_serving, replica_moves); {} for one process."""
        ...

    def forget(self, route: str) -> None:
        """The session `route` closed: its replica is not remembered."""
        ...

    @property
    def weights_transport(self) -> str | None:
        """How the last weights reached the engine when not as a file in local shared memory (Ray: "shm",
        "object-store"); None otherwise."""
        ...


class OneProcess:
    """The replica views of an engine that is one process: it is replica 0, it moves no session."""

    moves: tuple = ()
    weights_transport: str | None = None

    def replica_status(self) -> list[dict[str, Any]]:
        return [{"replica": 0, "serving": self.alive, "pid": self.pid, "in_flight": self.running, "sessions": None,
                 "policy_version": self.policy_version, "busy_s": self.busy_seconds, "restarts": 0,
                 "failure": self.failure}]

    def replica_counts(self) -> dict[str, Any]:
        return {}

    def forget(self, route: str) -> None:
        pass


@dataclass(frozen=True)
class Rejection:
    """An engine's answer to one request it refused to add (bad sampling values, a prompt it cannot take).
    It concerns that request alone; the caller gets a 400 naming `param` when known."""

    message: str
    param: str | None = None


def versions_from_spans(spans: list[tuple[int, int, int]], n_tokens: int, default: int) -> list[int]:
    """Expand (version, start, end) spans over output positions into one version per token.

    >>> versions_from_spans([(0, 0, 2), (1, 2, 3)], 3, default=0)
    [0, 0, 1]
    """
    out = [default] * n_tokens
    for version, start, end in spans:
        out[start:min(end, n_tokens)] = [version] * (min(end, n_tokens) - start)
    return out
