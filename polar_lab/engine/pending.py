"""The requests an engine process is working on, and how its reader thread settles them.

Each request is a future — a `concurrent.futures.Future` for a thread, an `asyncio.Future` for a caller on an event
loop — with the time it was sent and, when it streams, its `on_delta`. The reader thread hands over each engine
step at once: thread futures directly, and each event loop's share in one `call_soon_threadsafe` per step (a
cross-thread wake-up per request cost the loop more than the request). A loop's deltas of a step are queued before
that step's answers, so a caller has every delta before its generation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from collections.abc import Callable

from polar_lab.types import Generation, TokenDelta

log = logging.getLogger(__name__)

Waiter = concurrent.futures.Future | asyncio.Future


class Pending:
    def __init__(self):
        self._requests: dict[str, tuple[Waiter, float, Callable[[TokenDelta], None] | None]] = {}
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, fut: Waiter, on_delta: Callable[[TokenDelta], None] | None = None) -> str:
        """Register a request about to be sent; returns its id."""
        rid = f"g{next(self._ids)}"
        self._requests[rid] = (fut, time.perf_counter(), on_delta)
        return rid

    def discard(self, rid: str) -> bool:
        """Forget a request (aborted by its caller, or never sent); True if it was still waiting."""
        return self._requests.pop(rid, None) is not None

    def resolve(self, results: list[tuple[str, Generation | Exception]]) -> None:
        """Settle these requests: thread futures now, each loop's in one call_soon_threadsafe. A generation gets
        the seconds since it was sent (`engine_seconds`)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        now = time.perf_counter()
        for rid, result in results:
            entry = self._requests.pop(rid, None)
            if entry is None:
                continue  # aborted by its caller
            fut, t_submit, _ = entry
            if isinstance(result, Generation):
                result.engine_seconds = now - t_submit
            if isinstance(fut, asyncio.Future):
                by_loop.setdefault(fut.get_loop(), []).append((fut, result))
            else:
                settle(fut, result)
        _post(by_loop, _settle_all)

    def deliver(self, deltas: list[tuple[str, TokenDelta]]) -> None:
        """One engine step's streamed tokens, each loop's in one call_soon_threadsafe."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for rid, delta in deltas:
            entry = self._requests.get(rid)
            if entry is not None and entry[2] is not None:
                by_loop.setdefault(entry[0].get_loop(), []).append((entry[2], delta))
        _post(by_loop, _call_all)

    def fail(self, exc: Exception) -> None:
        """Every request still waiting fails with `exc`."""
        self.resolve([(rid, exc) for rid in list(self._requests)])


def settle(fut: Waiter, result: Generation | Exception) -> None:
    if fut.done():
        return  # cancelled meanwhile
    try:
        if isinstance(result, Exception):
            fut.set_exception(result)
        else:
            fut.set_result(result)
    except (concurrent.futures.InvalidStateError, asyncio.InvalidStateError):
        pass  # cancelled between the check and the set


def _post(by_loop: dict[asyncio.AbstractEventLoop, list], handler: Callable[[list], None]) -> None:
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(handler, items)
        except RuntimeError:
            pass  # that loop is closed: nobody is waiting any more


def _call_all(items: list) -> None:
    for on_delta, delta in items:
        try:
            on_delta(delta)
        except Exception:  # noqa: BLE001 - one stream's consumer must not stop the others' deltas
            log.exception("a stream's on_delta failed")


def _settle_all(items: list) -> None:
    for fut, result in items:
        settle(fut, result)
