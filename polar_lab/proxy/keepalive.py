"""uvicorn's HTTP protocol with a keep-alive timer that never closes a connection on a request that has arrived.

uvicorn arms its idle timer (`timeout_keep_alive`) when a response is sent and closes the connection when it fires.
A client starts its own idle clock only when it has read that response, and a busy client reads late: httpx with a
pool of 1,000 connections spends tens of seconds in the pool's bookkeeping, so it may send the next request on a
connection the server has held idle for its whole timeout. If that request is already in the socket when the timer
fires, closing the socket with unread bytes makes the kernel send a reset: the client gets `httpx.ReadError` for a
request the proxy never saw. Two things keep that from happening:

- the timer checks the socket first: with bytes waiting, it waits one more period (the read runs next, and a read
  cancels the timer), so a request that has arrived is served;
- the proxy's default idle timeout (`ProxyConfig.keep_alive_s`, 300 s) is longer than its clients keep idle
  connections (httpx 5 s, Node 5 s, Go and Rust's hyper 90 s), so the server is not the side that closes first.

A connection that ends with a reset also cancels its timer (uvicorn cancels it only on a clean close), so a reset
connection's state is not kept until the timer fires.
"""

from __future__ import annotations

import select

from uvicorn.protocols.http.auto import AutoHTTPProtocol  # httptools' protocol where installed, else h11's


def bytes_waiting(transport) -> bool:
    """Whether the connection's socket has something to read (a request, or the client's EOF or reset)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    poller = select.poll()  # not select(): descriptors go past 1,024 under load
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


class KeepAliveProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing() and bytes_waiting(self.transport):
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)
            return
        super().timeout_keep_alive_handler()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._unset_keepalive_if_required()
