"""The session registry: who may call, and which session a call belongs to. Owned by the Lab's loop thread.

A session's key is a 32-byte random secret. Keys are looked up by their SHA-256 digest, so a lookup's
timing depends on the digest, not on how many leading characters of a guess match a real key.

Frameworks that hold one client for all their rollouts (verifiers, NeMo Gym's model server) cannot give each
rollout its own key. For them a Lab may have one *shared key*: a request under it names its session (by the
session's name or id, in a header or a body field: proxy/http.py), and the registry finds it, or — only when
configured — creates it. Only sessions that opted in can be named: those with a name, and those whose `shared`
flag their owner set (a harness that hands its session's id to such a framework). Off by default: without a
shared key nothing but a session's own key is accepted.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from polar_lab.errors import AuthError, ConfigError, ContextLengthError, EngineError, RequestError
from polar_lab.store import RunStore
from polar_lab.types import CONTINUITY, FORCEABLE, SamplingSpec, Session

if TYPE_CHECKING:
    from polar_lab.proxy.replay import Script


def _check_sampling(sampling: dict[str, Any] | None) -> dict[str, Any]:
    """The forced values, checked now (SamplingError) rather than on the session's first call. What may be forced
    is declared with each field (polar_lab.types.knob); e.g. ignore_eos gives fixed-length outputs through any API,
    for benchmarks and stream tests."""
    unknown = set(sampling or {}) - FORCEABLE
    if unknown:
        raise ValueError(f"session sampling can force {sorted(FORCEABLE)}, not {sorted(unknown)}")
    SamplingSpec(**{"max_tokens": 1, **(sampling or {})})
    return dict(sampling or {})


MAX_NAME = 256  # characters in a session name


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


SHARED = object()  # resolve(..., shared=True): the key is the Lab's shared key; the request names its session


class SessionRegistry:
    def __init__(self, store: RunStore, *, base_url: str = "", auto_sessions: bool = False, proxy_socket: str = "",
                 shared_key: str | None = None, create_named: bool = False):
        """shared_key: the key under which requests name their session (None: no such key); create_named: a name
        no session has creates one (else 401)."""
        self.store = store
        self.base_url, self.proxy_socket = base_url, proxy_socket
        self.auto_sessions = auto_sessions
        self.shared_key, self.create_named = shared_key, create_named
        self._shared = _digest(shared_key) if shared_key else None
        self._by_digest: dict[bytes, Session] = {}
        self._by_id: dict[str, Session] = {}
        self._by_name: dict[str, Session] = {}
        self._call_counts: dict[str, int] = {}
        self._lock = threading.Lock()  # notebook thread creates, loop thread resolves
        self.on_close: list[Callable[[Session], None]] = []  # called after a session is closed (the proxy's caches)

    def create(self, task: dict[str, Any] | None = None, *, group_id: str | None = None,
               key: str | None = None, info: dict[str, Any] | None = None,
               chat_template: str | None = None, sampling: dict[str, Any] | None = None,
               continuity: str | None = None, name: str | None = None, replay: Script | None = None) -> Session:
        """name: what a request under the shared key calls this session (its id works too); unique in the Lab.
        replay: the recorded calls its first calls are answered from (proxy/replay.py)."""
        if continuity not in (None, *CONTINUITY):
            raise ConfigError(f"continuity must be one of {CONTINUITY} or None, got {continuity!r}")
        if name is not None and (not isinstance(name, str) or not 0 < len(name) <= MAX_NAME):
            raise ConfigError(f"a session name is a string of 1 to {MAX_NAME} characters, got {name!r}")
        session = Session(id=uuid.uuid4().hex[:12], key=key or "pl-" + secrets.token_urlsafe(32), name=name,
                          shared=name is not None,
                          task=task, group_id=group_id, info=dict(info or {}), base_url=self.base_url,
                          proxy_socket=self.proxy_socket,
                          chat_template=chat_template, sampling=_check_sampling(sampling), continuity=continuity,
                          _closer=self.close, replay=replay)
        with self._lock:
            if name is not None and (name in self._by_name or name in self._by_id):
                taken = self._by_name.get(name) or self._by_id[name]
                raise ConfigError(f"a session named {name!r} exists already (session {taken.id})")
            if name is not None:
                self._by_name[name] = session
            self._by_digest[_digest(session.key)] = session
            self._by_id[session.id] = session
            self._call_counts[session.id] = 0
        self.store.append_session(session, "opened")
        return session

    def resolve(self, key: str | None, *, shared: bool = False) -> Session | object:
        """The session a key belongs to; unknown keys get AuthError unless auto-sessions are on. shared: the Lab's
        shared key is accepted too, and answered with SHARED (the caller then finds the session by `named`)."""
        if not key:
            raise AuthError("missing API key: send the session key as a Bearer token or in the /s/{key}/ path")
        digest = _digest(key)
        session = self._by_digest.get(digest)
        if session is not None:
            return session
        if shared and self._shared is not None and secrets.compare_digest(digest, self._shared):
            return SHARED
        if self.auto_sessions:
            return self.create(key=key, info={"auto": True})
        raise AuthError("unknown API key: create a session with lab.session() and use its key")

    def named(self, name: str, *, where: str, create: bool = True) -> Session:
        """The session a request under the shared key names (by name, else by id, of the sessions that opted in); a
        name no such session has creates one when `create_named` (and `create`), else AuthError. where: what
        carried the name, for the error."""
        with self._lock:
            session = self._by_name.get(name) or self._by_id.get(name)
        if session is not None and session.shared:
            return session
        if not (self.create_named and create) or session is not None:
            raise AuthError(f"no session is named {name!r} ({where}): create it with lab.session(name=...), or "
                            f"let the Lab create named sessions (ProxyConfig.create_named_sessions)")
        if len(name) > MAX_NAME:
            raise AuthError(f"a session name has at most {MAX_NAME} characters ({where})")
        try:
            return self.create(name=name, info={"auto": True, "named_by": where})
        except ConfigError:  # two first calls of one new name at once: the other created it
            return self._by_name[name]

    def get(self, session_id: str) -> Session:
        return self._by_id[session_id]

    def all(self) -> list[Session]:
        return list(self._by_id.values())

    def next_call_index(self, session: Session) -> int:
        with self._lock:
            index = self._call_counts[session.id]
            self._call_counts[session.id] = index + 1
        return index

    def close(self, session: Session, *, reward: float | None = None, reward_parts: dict[str, float] | None = None,
              info: dict[str, Any] | None = None, status: str = "closed") -> Session:
        session.status = status
        session.reward = reward
        if reward_parts is not None:  # a second close (a status change) keeps the evaluator's parts
            session.reward_parts = dict(reward_parts)
        session.closed_at = time.time()
        session.info.update(info or {})
        if session.replay is not None:  # what it replayed, where it left the record
            session.info["replay"] = session.replay.report()
        self.store.append_session(session, status)
        for hook in self.on_close:
            hook(session)
        return session


def note_call_error(session: Session, exc: Exception) -> None:
    """Count a failed call on its session: a prompt too long for the model (the policy's doing), or an engine or
    proxy failure (the infrastructure's). Other refusals are the harness's own malformed requests."""
    kind = ("context_length" if isinstance(exc, ContextLengthError) else "engine" if isinstance(exc, EngineError)
            else None if isinstance(exc, RequestError) else "proxy")
    if kind is not None:
        session.call_errors[kind] = session.call_errors.get(kind, 0) + 1
        session.last_call_error = kind
