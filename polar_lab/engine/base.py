"""The engine protocol: prompt ids in, sampled ids + sampler logprobs + policy versions out.

The engine knows nothing about chat templates, tools or HTTP; the proxy renders and parses.
`submit` is thread-safe and returns a `concurrent.futures.Future`, so any thread or event loop can
use it; `generate` is the asyncio form. Cancelling the future aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from polar_lab.types import Generation, SamplingSpec


@runtime_checkable
class Engine(Protocol):
    model_name: str
    model_path: str
    max_model_len: int

    @property
    def policy_version(self) -> int:
        """Version of the weights new tokens are sampled with; 0 = as loaded, +1 per `load_weights`."""
        ...

    def submit(self, prompt_ids: list[int], spec: SamplingSpec) -> concurrent.futures.Future[Generation]:
        ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        """Replace the live weights between two engine steps; returns the new policy version.
        (VLLMEngine also takes `version=`, which `Lab.restart_engine` uses to carry a version on.)"""
        ...

    def close(self) -> None:
        ...


async def generate(engine: Engine, prompt_ids: list[int], spec: SamplingSpec) -> Generation:
    """Await one generation on the current event loop; cancelling the task aborts the request.

    An engine with its own `generate` coroutine (VLLMEngine) resolves loop futures directly, one wake-up
    of the loop per engine step instead of one per request; others go through `submit`."""
    native = getattr(engine, "generate", None)
    if native is not None:
        return await native(prompt_ids, spec)
    return await asyncio.wrap_future(engine.submit(prompt_ids, spec))


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
