"""The canonical request every API adapter converts to, and the API-neutral result it converts back from.

Messages use OpenAI chat shape because the chat templates do: `{"role", "content": str | None,
"tool_calls": [{"id", "type": "function", "function": {"name", "arguments": str}}], "tool_call_id",
"reasoning_content"}`. Tool-call arguments stay *strings*, exactly as the model wrote them, so a harness
that echoes them back re-renders the same text (exact-id continuity depends on it).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from polar_lab.proxy.constraints import OutputFormat
from polar_lab.types import Generation, Sampling, Session


@dataclass
class CanonicalRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)  # [{"type": "function", "function": {...}}]
    tool_choice: str | dict[str, Any] = "auto"  # "auto" | "none" | "required" | {"name": ...}
    max_tokens: int | None = None  # None: the Lab's default; clipped to the context either way (CallService)
    sampling: Sampling = field(default_factory=Sampling)  # temperature, top_p, seed, stop, penalties, extensions...
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    model: str = ""
    thinking: bool | None = None  # the template's `enable_thinking` switch; None: the template's default
    output: OutputFormat | None = None  # structured output: the text must be this JSON (proxy/constraints.py)
    allowed_tools: list[str] | None = None  # a forced call may name only these (Google's allowedFunctionNames)
    parallel_tool_calls: bool = True  # False: at most one call per turn (enforced where a call is forced)
    thinking_budget: int | None = None  # at most this many thought tokens (Anthropic budget_tokens, thinkingBudget)


@dataclass
class ParsedOutput:
    """What the proxy read out of the generated text."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # [{"id", "name", "arguments": str}]
    errors: list[str] = field(default_factory=list)  # tool calls the model attempted but botched

    def info(self) -> dict[str, Any]:
        return {"num_tool_calls": len(self.tool_calls), "errors": self.errors,
                "has_reasoning": self.reasoning is not None}


@dataclass
class Choice:
    index: int
    generation: Generation
    parsed: ParsedOutput
    finish_reason: str  # "stop" | "length" | "tool_calls" | "abort"
    seed: int | None = None  # the seed the engine sampled this choice with (see service._nth_seed)
    thought_tokens: int = 0  # of its output ids, those of its thought, delimiters in (OutputParser.thought_tokens)


@dataclass
class CompletedCall:
    """One served request, everything needed to answer it and to record it."""

    session: Session
    call_index: int
    request_id: str
    created: float  # unix time: when it was received (its record's time, when replayed); its body's timestamp
    api: str
    model: str
    prompt_ids: list[int]
    render: dict[str, Any]
    sampling: dict[str, Any]
    choices: list[Choice]
    timings: dict[str, float]
    delivered: bool = True  # the caller was still there when the answer was ready (http.serve checks)
    replayed: bool = False  # answered from a recorded session's call (proxy/replay.py), not sampled

    # Usage, counted once here and written by each API in its own shape, streamed or not (the same figures)
    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.generation.output_ids) for c in self.choices)

    @property
    def thought_tokens(self) -> int:
        """Of `completion_tokens`, those inside thoughts (the APIs' reasoning / thinking / thoughts tokens)."""
        return sum(c.thought_tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Of the prompt's tokens, those the engine's prefix cache served (for its first choice: the others share
        the prompt)."""
        return self.choices[0].generation.cached_tokens if self.choices else 0


class Lenient(BaseModel):
    """Base of every surface's request models: unknown fields are accepted and ignored (harnesses send more
    than this proxy needs), and the raw body is recorded anyway."""

    model_config = ConfigDict(extra="allow")


class ThoughtSigner:
    """Signs the thoughts the proxy returns (Anthropic's thinking `signature`), so that an echoed thought can be
    checked: HMAC-SHA256 over its text with a secret of this proxy's, never sent anywhere. Also seals them (the
    Responses API's `encrypted_content`): AES-SIV under another secret, opaque to the client and refused when altered.
    Both are deterministic (SIV needs no nonce: the same thought seals to the same bytes, which tells a client only
    that two of its thoughts are equal), so a replayed answer carries the recorded signature and seal."""

    def __init__(self) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESSIV

        self._key = secrets.token_bytes(32)
        self._siv = AESSIV(AESSIV.generate_key(512))

    def seal(self, thinking: str) -> str:
        return base64.urlsafe_b64encode(self._siv.encrypt(thinking.encode(), None)).decode()

    def unseal(self, blob: str) -> str | None:
        """The sealed thought, or None when `blob` is not one this proxy sealed (or was altered)."""
        from cryptography.exceptions import InvalidTag

        try:
            return self._siv.decrypt(base64.urlsafe_b64decode(blob.encode()), None).decode()
        except (InvalidTag, ValueError, TypeError):
            return None

    def sign(self, thinking: str) -> str:
        return base64.b64encode(hmac.new(self._key, thinking.encode(), hashlib.sha256).digest()).decode()

    def verify(self, thinking: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign(thinking), signature)


class ToolArgs:
    """tool_use id → argument text as generated (bounded; oldest ids forgotten first)."""

    def __init__(self, size: int = 100_000):
        self.size = size
        self._raw: OrderedDict[str, str] = OrderedDict()

    def remember(self, tool_use_id: str, arguments: str) -> None:
        self._raw[tool_use_id] = arguments
        while len(self._raw) > self.size:
            self._raw.popitem(last=False)

    def text_for(self, tool_use_id: str | None, value: dict[str, Any]) -> str:
        raw = self._raw.get(tool_use_id or "")
        if raw is not None and json.loads(raw) == value:
            return raw
        return json.dumps(value, ensure_ascii=False)
