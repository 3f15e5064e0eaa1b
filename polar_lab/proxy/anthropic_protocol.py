"""Pydantic models of the Anthropic Messages request, fields in Anthropic's documented order.

Lenient like the real harnesses need: Claude Code sends `thinking`, `context_management`, `output_config`,
`metadata`, `cache_control` on blocks, server tools without `input_schema`, and a `role: "system"` entry
inside `messages`. Unknown fields are accepted and ignored; the raw body is recorded anyway.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from polar_lab.proxy.sampling import AnthropicTemperature, MaxTokens, NonNegativeTopK, StopList, TopP


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class Block(_Lenient):
    """Any content block; `type` decides which of the optional fields matter."""

    type: str
    text: str | None = None  # text
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None  # tool_result
    is_error: bool | None = None  # tool_result
    thinking: str | None = None  # thinking
    signature: str | None = None  # thinking


class Message(_Lenient):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(_Lenient):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # None: a server tool (web search...) we do not run
    type: str | None = None


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(_Lenient):
    model: str = ""
    messages: list[Message] = Field(min_length=1)
    max_tokens: MaxTokens
    system: str | list[Block] | None = None
    metadata: dict[str, Any] | None = None
    stop_sequences: StopList | None = None
    stream: bool | None = False
    temperature: AnthropicTemperature | None = None
    top_k: NonNegativeTopK | None = None
    top_p: TopP | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None


class CountTokensRequest(_Lenient):
    model: str = ""
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None


Block.model_rebuild()
