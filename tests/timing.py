"""A call that must return, checked by assertion: code that loops fails its test by name instead of hanging it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def returns(fn: Callable[..., Any], *args: Any, within: float = 2.0, **kwargs: Any) -> Any:
    """fn(*args, **kwargs), or an AssertionError when it has not returned within `within` seconds. For calls that
    take micro- to milliseconds (a binary search, a cache's eviction loop), so the margin is 1000× or more; a loop
    then fails the test on an assertion, which a runner's timeout (mutmut's is not counted as a kill) does not."""
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)), daemon=True)  # a loop is left behind
    worker.start()
    worker.join(within)
    assert out, f"{getattr(fn, '__name__', fn)} did not return within {within} s"
    return out[0]
