"""Pydantic models of the OpenAI Chat Completions request, fields in OpenAI's documented order.

Unknown fields are accepted and ignored (harnesses send `store`, `metadata`, `reasoning_effort`...);
the raw body is recorded anyway. Our extensions are fenced off at the end of each model.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from polar_lab.proxy.sampling import (Choices, Flag, MaxTokens, Penalty, Seed, StopList, StopString, Temperature,
                                      TopK, TopLogprobs, TopP)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # --- extensions (vLLM / DeepSeek convention) ---
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoiceFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class StreamOptions(_Lenient):
    include_usage: bool | None = None


class ChatCompletionRequest(_Lenient):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str = ""
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Flag | None = False
    top_logprobs: TopLogprobs | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    n: Choices = 1
    presence_penalty: Penalty | None = None
    response_format: dict[str, Any] | None = None
    seed: Seed | None = None
    stop: StopString | StopList | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    # --- extensions (vLLM's names) ---
    top_k: TopK | None = None
    ignore_eos: Flag | None = None
