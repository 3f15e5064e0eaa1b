"""Pause/drain/resume of the proxy around a weight sync: one small state object, owned by the Lab's loop.

States and transitions (anything else raises):

    serving ──pause()──▶ draining ──(in-flight calls finished, or drain timeout)──▶ paused
       ▲                                                                              │
       └──────────────────────────────────── resume() ◀───────────────────────────────┘

While not serving, new calls wait at the gate (a harness sees a slower answer, never an error: unmodified
harnesses rarely retry). Calls already past the gate finish normally. If they do not finish within the
drain timeout the sync goes ahead anyway: vLLM swaps weights between two engine steps, and every token
records the policy version that sampled it, so a call that spans a sync is still exact for importance
sampling. `stats()` says how many calls were left in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

SERVING, DRAINING, PAUSED = "serving", "draining", "paused"


class PauseState:
    def __init__(self) -> None:
        self.state = SERVING
        self.in_flight = 0
        self.pauses = 0
        self.undrained = 0  # calls still in flight when a drain timed out, summed over pauses
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._paused_at: float | None = None
        self.paused_seconds = 0.0

    async def wait_open(self) -> None:
        """Return once the proxy is serving."""
        while self.state != SERVING:
            await self._open.wait()

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Wrap one call: waits while the proxy is paused, then counts the call as in flight."""
        await self.wait_open()
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def pause(self, drain_timeout: float = 30.0) -> int:
        """serving → draining → paused. Returns the number of calls still in flight (0 = fully drained)."""
        self._expect(SERVING, "pause")
        self.state = DRAINING
        self._open.clear()
        self._paused_at = time.perf_counter()
        self.pauses += 1
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), drain_timeout)
        self.state = PAUSED
        self.undrained += self.in_flight
        return self.in_flight

    async def resume(self) -> None:
        """paused → serving; waiting calls go through."""
        self._expect(PAUSED, "resume")
        self.state = SERVING
        self.paused_seconds += time.perf_counter() - (self._paused_at or time.perf_counter())
        self._paused_at = None
        self._open.set()

    def stats(self) -> dict[str, Any]:
        return {"state": self.state, "in_flight": self.in_flight, "pauses": self.pauses,
                "undrained": self.undrained, "paused_seconds": round(self.paused_seconds, 4)}

    def _expect(self, state: str, action: str) -> None:
        if self.state != state:
            raise RuntimeError(f"cannot {action} the proxy while it is {self.state} (needs {state})")
