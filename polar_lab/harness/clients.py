"""The SDK clients polar_lab's own harnesses make for each run, sharing one TLS context per process.

httpx builds a new `ssl.SSLContext` for every client, which loads the system's CA bundle again: 32–34 ms of CPU per
client on this project's 2-core machine (2026-12-05), paid once per harness run, since each run makes its own
client. A GRPO step of 16 tasks × 8 runs spent ~4 s of the kernel's CPU on it, on the cores the proxy and the
engine need. Here the context is built once per process and every client reuses it: `ssl.create_default_context()`,
which trusts the system's CAs, or SSL_CERT_FILE / SSL_CERT_DIR (on macOS and Windows the SDKs' own default asks the OS
trust store instead). The Lab's own URLs are plain http on loopback, where no context is used.

    >>> tls_context() is tls_context()
    True
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import anthropic
    import openai

    from polar_lab.types import Session


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The process's one TLS context: what `ssl.create_default_context()` gives, built on first use."""
    return ssl.create_default_context()


@functools.cache
def _self_closing(client_class: type) -> type:
    """An SDK's `DefaultAsyncHttpxClient` that closes itself when collected, as the client each SDK makes for itself
    does: a harness that never closes its SDK client must not leave an open connection behind (the Lab waits for
    its connections when it closes)."""

    class SelfClosing(client_class):
        def __del__(self) -> None:
            if not self.is_closed:
                with contextlib.suppress(RuntimeError):  # no running loop to close it on: the process's end will
                    asyncio.get_running_loop().create_task(self.aclose())

    return SelfClosing


def openai_client(session: Session, **options) -> openai.AsyncOpenAI:
    """An `openai.AsyncOpenAI` on the session's endpoint and key; `options` as the SDK takes them (max_retries, …)."""
    import openai

    if options.get("http_client") is None:
        options["http_client"] = _self_closing(openai.DefaultAsyncHttpxClient)(verify=tls_context())
    return openai.AsyncOpenAI(base_url=session.openai_base_url, api_key=session.api_key, **options)


def anthropic_client(session: Session, **options) -> anthropic.AsyncAnthropic:
    """An `anthropic.AsyncAnthropic` on the session's Messages endpoint and key, as `openai_client`."""
    import anthropic

    if options.get("http_client") is None:
        options["http_client"] = _self_closing(anthropic.DefaultAsyncHttpxClient)(verify=tls_context())
    return anthropic.AsyncAnthropic(base_url=session.anthropic_base_url, api_key=session.api_key, **options)
