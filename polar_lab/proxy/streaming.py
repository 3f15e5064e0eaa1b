"""Streamed responses: tokens leave the proxy as the engine samples them, and the call is recorded, whole,
before the stream's final event.

`respond` (called by http.serve for `stream: true`) prepares the call, starts the engine on it, and waits for
its first token before answering: a request the engine refuses or cannot serve still gets its error status in
the caller's API shape. Then `EventStream` (an ASGI response) sends each API's events as the engine's deltas
arrive: each choice's text goes through a `deltas.Splitter`, and the API's `Writer` turns deltas into its SSE
events. At the end: the final parse (which the splitter reconciles with what was sent), the response, the
record, the closing events.

A slow reader does not hold anyone up: the events wait in the stream's own queue and are sent, all that waits at
once, as fast as the client takes them; what waits is bounded by the generation itself (max_tokens), and nothing
is dropped. The call is recorded when the generation ends, whether or not the client has read its events, and the
engine and the other sessions never wait for a reader: a weight sync drains the engine's generations, not the
readers.

A client that disconnects mid-stream (or whose connection fails) has its request aborted in the engine; what was
sampled until then is recorded once, with finish_reason "abort" — never continued (no tips, no turns) and
never trained (trajectory builders mask it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from starlette.responses import Response

from polar_lab.errors import EngineError, RequestError
from polar_lab.proxy.stream_deltas import Delta
from polar_lab.proxy.service import MAX_TOKENS_HEADER, max_tokens_header
from polar_lab.proxy.sessions import note_call_error
from polar_lab.types import Generation, Session, TokenDelta

if TYPE_CHECKING:
    from polar_lab.proxy.canonical import CanonicalRequest, CompletedCall
    from polar_lab.proxy.service import CallService, Prepared

log = logging.getLogger(__name__)


class Writer(Protocol):
    """One API's stream events. Each method returns the bytes to send."""

    def start(self) -> bytes:
        ...

    def delta(self, choice: int, delta: Delta) -> bytes:
        ...

    def finish(self, response: dict[str, Any]) -> bytes:
        """The closing events, given the response as built for a non-streamed call."""

    def error(self, status: int, message: str) -> bytes:
        """A failure after the stream began (the status line is gone)."""

    # a writer may set `content_type` (bytes) for a stream that is not server-sent events


class Feed:
    """The tokens the engine streamed for each choice, waiting for the writer (see the module docstring), and
    everything streamed so far (a disconnected call is recorded from it)."""

    def __init__(self, n: int):
        self.waiting: list[tuple[int, str]] = []
        self.ready = asyncio.Event()
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.versions: list[list[int]] = [[] for _ in range(n)]
        self.texts: list[list[str]] = [[] for _ in range(n)]

    def on_delta(self, choice: int) -> Callable[[TokenDelta], None]:
        def add(delta: TokenDelta) -> None:
            self.ids[choice] += delta.ids
            self.logprobs[choice] += delta.logprobs
            self.versions[choice] += [delta.version] * len(delta.ids)
            self.texts[choice].append(delta.text)
            self.waiting.append((choice, delta.text))
            self.ready.set()
        return add

    async def wait(self, task: asyncio.Task) -> None:
        """Until something waits or the generation is over (`task` must set `ready` when done)."""
        while not self.waiting and not task.done():
            self.ready.clear()
            await self.ready.wait()

    def take(self) -> dict[int, str]:
        """All that waits, joined per choice."""
        out: dict[int, str] = {}
        for choice, text in self.waiting:
            out[choice] = out.get(choice, "") + text
        self.waiting.clear()
        return out

    def partial(self, choice: int) -> Generation:
        """What was sampled so far, as a generation cut off by its caller."""
        return Generation(output_ids=self.ids[choice], output_logprobs=self.logprobs[choice],
                          output_versions=self.versions[choice], text="".join(self.texts[choice]),
                          finish_reason="abort")


async def respond(service: CallService, session: Session, req: CanonicalRequest, raw: dict[str, Any], body: Any,
                  *, api: str, inline: bool, build: Callable, writer: Callable[[Prepared, Any], Writer]
                  ) -> EventStream:
    """Start a streamed call; return once its first token (or its end, or its error) is there."""
    prepared = await service.prepare(session, req, api=api, inline=inline)
    feed = Feed(req.n)
    task = asyncio.create_task(service.generate(prepared, [feed.on_delta(i) for i in range(req.n)]))
    task.add_done_callback(lambda _: feed.ready.set())
    try:
        await feed.wait(task)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task.done() and task.exception() is not None:
        task.result()  # refused or failed before the first token: the caller's error, with its status
    return EventStream(service, prepared, task, feed, raw, body, build, writer(prepared, body))


class EventStream(Response):
    """The response of one streamed call (see the module docstring). Two tasks: `_produce` turns the engine's deltas
    into the API's events and, when the generation ends, records the call and queues the closing events — whether
    or not anyone reads; `_deliver` sends what is queued, as fast as the client takes it."""

    media_type = "text/event-stream"

    def __init__(self, service: CallService, prepared: Prepared, task: asyncio.Task, feed: Feed,
                 raw: dict[str, Any], body: Any, build: Callable, writer: Writer):
        super().__init__()
        self.service, self.prepared, self.task, self.feed = service, prepared, task, feed
        self.raw, self.body, self.build, self.writer = raw, body, build, writer
        self.splitters = [service.splitter(prepared, i) for i in range(prepared.req.n)]
        self.recorded = False
        self.queued: list[bytes] = []  # events produced, not yet sent (a slow reader's backlog)
        self.ended = False  # the last event is queued
        self.wake = asyncio.Event()
        self.producer = asyncio.create_task(self._produce())

    async def __call__(self, scope, receive, send) -> None:
        content_type = getattr(self.writer, "content_type", b"text/event-stream; charset=utf-8")
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", content_type), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"), (MAX_TOKENS_HEADER.encode(), max_tokens_header(
                self.prepared.specs[0].max_tokens, self.prepared.max_tokens_source).encode())]})
        sender = asyncio.create_task(self._deliver(send))
        gone = asyncio.create_task(_disconnected(receive))
        done, _ = await asyncio.wait({sender, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if sender not in done:
            sender.cancel()
        (failure,) = await asyncio.gather(sender, return_exceptions=True)
        if failure is not None and not isinstance(failure, (asyncio.CancelledError, OSError)):
            log.error("a stream failed", exc_info=failure)
        if not self.recorded:  # the caller left (or the connection failed) before the generation ended
            self.producer.cancel()
            await asyncio.gather(self.producer, return_exceptions=True)
            try:
                if not self.recorded:
                    await self._record_abort()
            except Exception:  # noqa: BLE001 - nobody is listening any more
                log.exception("recording an aborted stream failed")

    async def _deliver(self, send) -> None:
        while True:
            while not self.queued and not self.ended:
                self.wake.clear()
                await self.wake.wait()
            data, self.queued = b"".join(self.queued), []
            await _send(send, data, more=not self.ended)
            if self.ended and not self.queued:
                return

    def _queue(self, data: bytes, *, last: bool = False) -> None:
        if data:
            self.queued.append(data)
        self.ended = self.ended or last
        self.wake.set()

    async def _produce(self) -> None:
        try:
            await self._events()
        except Exception as exc:  # noqa: BLE001 - a bug here must not leave the caller waiting forever
            log.exception("a stream failed")
            self._failed(exc)  # counted as the proxy's failure, as for a non-streamed call; never recorded as "abort"
            self._queue(self.writer.error(500, f"internal proxy error: {type(exc).__name__}: {exc}"), last=True)

    async def _events(self) -> None:
        p, writer = self.prepared, self.writer
        self._queue(writer.start() + b"".join(writer.delta(i, d) for i, s in enumerate(self.splitters)
                                              for d in s.feed(p.prefill)))
        while True:
            await self.feed.wait(self.task)
            pieces = self.feed.take()
            if not pieces and self.task.done():
                break
            events = b"".join(writer.delta(i, d) for i, text in pieces.items() for d in self.splitters[i].feed(text))
            if events and "first_delta_s" not in p.timings:  # the first sampled text the caller gets, now
                p.timings["first_delta_s"] = time.time() - p.timings["received"]
            self._queue(events)
        try:
            generations = self.task.result()
        except (EngineError, RequestError) as exc:
            self._failed(exc)
            self._queue(writer.error(503 if isinstance(exc, EngineError) else exc.status, str(exc)), last=True)
            return
        call = self.service.finish(p, generations)
        tails = [writer.delta(c.index, d) for c in call.choices for d in self.splitters[c.index].finish(c.parsed)]
        diverged = [f"choice {i}: {why}" for i, s in enumerate(self.splitters) for why in s.diverged]
        if diverged:
            call.render["stream_diverged"] = diverged
        response = self.build(call, p.req, self.body)
        self._record(call, response)  # if it fails: _produce answers a 500 (an unrecorded call is not answered)
        self._queue(b"".join(tails) + writer.finish(response), last=True)

    def _record(self, call: CompletedCall, response: dict[str, Any]) -> None:
        self.recorded = True  # whatever happens next: a call is never written twice
        self.service.record(call, self.raw, response)

    async def _record_abort(self) -> None:
        """What the engine sampled for a caller that left, on disk once, as finish_reason "abort"."""
        self.task.cancel()  # aborts the engine's requests (a finished task keeps its result)
        (result,) = await asyncio.gather(self.task, return_exceptions=True)
        if isinstance(result, asyncio.CancelledError):
            generations = [self.feed.partial(i) for i in range(self.prepared.req.n)]
        elif isinstance(result, BaseException):
            return  # it failed: nothing was sampled to keep
        else:
            generations = result
        for gen in generations:
            gen.finish_reason = "abort"  # the caller never received it whole
        call = self.service.finish(self.prepared, generations)
        call.render["stream_aborted"] = True
        try:
            response = self.build(call, self.prepared.req, self.body)
        except Exception as exc:  # noqa: BLE001 - a partial output may not build; the tokens are what matter
            response = {"error": f"the client disconnected; no response was built: {exc!r}"}
        self._record(call, response)

    def _failed(self, exc: Exception) -> None:
        note_call_error(self.prepared.session, exc)
        self.recorded = True  # nothing more will be recorded, as for a non-streamed call that fails


async def _send(send, data: bytes, *, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
