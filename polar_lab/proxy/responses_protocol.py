"""Pydantic models of the OpenAI Responses request (`POST /v1/responses`), fields in OpenAI's order.

Input items are kept as loose dicts with a `type` (message, function_call, function_call_output,
reasoning): Codex and the Agents SDK send items this layer does not need to understand in full. Non-function
tools (Codex's `namespace`, `web_search`, `local_shell`...) are accepted and not offered to the model.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from polar_lab.proxy.sampling import MaxTokens, Seed, Temperature, TopK, TopLogprobs, TopP


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class ResponsesRequest(_Lenient):
    model: str = ""
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = None
    stream: bool | None = False
    temperature: Temperature | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    top_logprobs: TopLogprobs | None = None
    top_p: TopP | None = None
    # --- extensions (vLLM's names) ---
    top_k: TopK | None = None
    seed: Seed | None = None
