"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`): the request models, content blocks →
canonical request, the message body or SSE events, and the routes.

Lenient like the real harnesses need: Claude Code sends `thinking`, `context_management`, `output_config`,
`metadata`, `cache_control` on blocks, server tools without `input_schema`, and a `role: "system"` entry
inside `messages`. Unknown fields are accepted and ignored; the raw body is recorded anyway.
Continuity detail: Anthropic returns tool input as a JSON *object*, so a harness echoes it back as an object
and the exact text the model wrote is gone; `ToolArgs` (canonical.py) remembers it per tool_use id.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field

from polar_lab.errors import RequestError
from polar_lab.proxy import conformance, constraints
from polar_lab.proxy.canonical import CanonicalRequest, CompletedCall, Lenient, ThoughtSigner, ToolArgs
from polar_lab.proxy.stream_deltas import Delta
from polar_lab.proxy.http import anthropic_error, canonical, json_body, serve, session_key, validate
from polar_lab.proxy.sampling import (AnthropicTemperature, Extensions, MaxTokens, NonNegativeTopK, StopList, TopP,
                                      extensions, stop_tuple)
from polar_lab.proxy.service import CallService, Prepared
from polar_lab.types import Sampling


class Block(Lenient):
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


class Message(Lenient):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(Lenient):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # None: a server tool (web search...) we do not run
    type: str | None = None


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(Extensions):  # every surface takes vLLM's extension knobs (proxy/sampling.py)
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
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's name for output_config.format


class CountTokensRequest(Lenient):
    model: str = ""
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None


Block.model_rebuild()

API = "anthropic.messages"
BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's per-request line; it would break every chain
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}
TOOL_ERROR = "Error: "  # what a failed tool result (`is_error`) starts with in the prompt
VERSION = re.compile(r"\d{4}-\d{2}-\d{2}")  # an `anthropic-version` is a date (2023-06-01; the SDK 2.14 sends 2026-10-21)
MIN_THINKING_BUDGET = 1024  # Anthropic's least thinking.budget_tokens


def to_canonical(body: MessagesRequest, tool_args: ToolArgs, signer: ThoughtSigner) -> CanonicalRequest:
    conformance.refuse(API, body)
    messages = [{"role": "system", "content": _system_text(body.system)}] if body.system else []
    for m in body.messages:
        messages += _convert(m, tool_args, signer)
    return CanonicalRequest(
        messages=messages, tools=[_tool(t) for t in body.tools or [] if t.input_schema is not None],
        tool_choice=_tool_choice(body.tool_choice), max_tokens=body.max_tokens,
        sampling=Sampling(temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p, top_k=-1 if not body.top_k else body.top_k,
                          stop=stop_tuple(body.stop_sequences), **extensions(body)),
        stream=bool(body.stream), model=body.model,
        thinking=_thinking(body.thinking, body.max_tokens),
        thinking_budget=(body.thinking or {}).get("budget_tokens") if (body.thinking or {}).get("type") == "enabled"
        else None,
        output=constraints.anthropic_format(body.output_config, body.output_format),
        parallel_tool_calls=not (body.tool_choice and body.tool_choice.disable_parallel_tool_use))


def _thinking(config: dict[str, Any] | None, max_tokens: int) -> bool | None:
    """`thinking: {"type": "enabled" | "adaptive" | "disabled"}` → the template's enable_thinking, checked as
    Anthropic checks it: "enabled" needs an integer `budget_tokens` of at least 1024 and below max_tokens (the
    budget itself goes to the engine as CanonicalRequest.thinking_budget)."""
    kind = (config or {}).get("type")
    if kind not in (None, "enabled", "adaptive", "disabled"):
        raise RequestError(f"thinking.type must be 'enabled', 'adaptive' or 'disabled', got {kind!r}",
                           param="thinking.type")
    if kind == "enabled":
        budget = config.get("budget_tokens")
        if type(budget) is not int or budget < MIN_THINKING_BUDGET:
            raise RequestError(f"thinking.budget_tokens: Input should be an integer >= {MIN_THINKING_BUDGET}",
                               param="thinking.budget_tokens")
        if budget >= max_tokens:
            raise RequestError("`max_tokens` must be greater than `thinking.budget_tokens`", param="max_tokens")
    return None if kind is None else kind != "disabled"


def _system_text(system: str | list[Block] | None) -> str:
    text = system if isinstance(system, str) else "\n\n".join(b.text or "" for b in system or [] if b.type == "text")
    return "\n".join(line for line in text.split("\n") if not line.startswith(BILLING_HEADER))


def _convert(m: Message, tool_args: ToolArgs, signer: ThoughtSigner) -> list[dict[str, Any]]:
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    if m.role == "assistant":
        return [_assistant(m.content, tool_args, signer)]
    out, texts = [], []
    for block in m.content:
        if block.type == "tool_result":
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block)})
        elif block.type == "text":
            texts.append(block.text or "")
        else:
            raise RequestError(f"content blocks of type '{block.type}' are not supported by this text model",
                               param="messages")
    if texts:
        out.append({"role": m.role if m.role != "system" else "system", "content": "\n\n".join(texts)})
    return out


def _assistant(blocks: list[Block], tool_args: ToolArgs, signer: ThoughtSigner) -> dict[str, Any]:
    text = "".join(b.text or "" for b in blocks if b.type == "text")
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    for b in blocks:  # as Anthropic does: a signed thought must come back as it was signed
        if b.type == "thinking" and b.signature and not signer.verify(b.thinking or "", b.signature):
            raise RequestError("Invalid `signature` in `thinking` block: the thought differs from the one this "
                               "proxy signed (edited?)", param="messages")
    thinking = "".join(b.thinking or "" for b in blocks if b.type == "thinking")
    if thinking:
        message["reasoning_content"] = thinking
    calls = [b for b in blocks if b.type == "tool_use"]
    if calls:
        message["tool_calls"] = [{"id": b.id, "type": "function", "function": {
            "name": b.name, "arguments": tool_args.text_for(b.id, b.input or {})}} for b in calls]
    return message


def _result_text(block: Block) -> str:
    """A tool result's text; one that failed (`is_error`) says so first, as Anthropic's own prompt does
    (the chat templates have no flag for it). Content other than text is refused, as at the top level."""
    if isinstance(block.content, list):
        other = [b.type for b in block.content if b.type != "text"]
        if other:
            raise RequestError(f"tool_result content blocks of type '{other[0]}' are not supported by this text "
                               f"model", param="messages")
        text = "\n".join(b.text or "" for b in block.content)
    else:
        text = block.content or ""
    return f"{TOOL_ERROR}{text}" if block.is_error else text


def _tool(t: Tool) -> dict[str, Any]:
    function = {"name": t.name, "parameters": t.input_schema}
    if t.description:
        function["description"] = t.description
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoice | None) -> str | dict[str, Any]:
    if choice is None or choice.type == "auto":
        return "auto"
    if choice.type == "tool":
        if not choice.name:
            raise RequestError("tool_choice of type 'tool' needs a name", param="tool_choice")
        return {"name": choice.name}
    return {"any": "required", "none": "none"}[choice.type]


def build_response(call: CompletedCall, req: CanonicalRequest, tool_args: ToolArgs,
                   signer: ThoughtSigner) -> dict[str, Any]:
    (choice,) = call.choices  # Anthropic has no n
    parsed, blocks = choice.parsed, []
    if parsed.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": signer.sign(parsed.reasoning)})
    if parsed.content:
        blocks.append({"type": "text", "text": parsed.content})
    for tc in parsed.tool_calls:
        tool_use_id = _tool_use_id(tc["id"])
        tool_args.remember(tool_use_id, tc["arguments"])
        blocks.append({"type": "tool_use", "id": tool_use_id, "name": tc["name"], "input": json.loads(tc["arguments"])})
    stop = choice.generation.stop_reason if isinstance(choice.generation.stop_reason, str) else None
    reason = _STOP_REASONS.get(choice.finish_reason, "stop_sequence" if stop else "end_turn")
    return {"id": "msg_" + call.request_id, "type": "message", "role": "assistant", "model": req.model or call.model,
            "content": blocks, "stop_reason": reason, "stop_sequence": stop,
            "usage": usage(call.prompt_tokens, call.completion_tokens, call.thought_tokens)}


def usage(prompt: int, output: int, thinking: int) -> dict[str, Any]:
    """Anthropic's usage object. Its cache fields count explicit prompt caching (`cache_control`), which this proxy
    does not do: 0, and `input_tokens` is the whole prompt (the engine's own prefix cache is not billed apart)."""
    return {"input_tokens": prompt, "output_tokens": output, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
            "output_tokens_details": {"thinking_tokens": thinking}, "service_tier": "standard"}


# the fields `message_delta` carries (the SDK's MessageDeltaUsage): cumulative, the input's included — frameworks read
# a streamed call's input tokens there
DELTA_USAGE = ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens",
               "output_tokens_details")


class MessageStream:
    """Anthropic's stream events as the tokens come (proxy/streaming.py): `message_start`, then one content block
    per run of reasoning (a signed `thinking` block), text, or a whole `tool_use`, then `message_delta` with the
    stop reason and usage, `message_stop`."""

    def __init__(self, p: Prepared, model: str, tool_args: ToolArgs, signer: ThoughtSigner):
        self.message = {"id": "msg_" + p.request_id, "type": "message", "role": "assistant",
                        "model": p.req.model or model, "content": [], "stop_reason": None, "stop_sequence": None,
                        "usage": usage(len(p.rendered.prompt_ids), 0, 0)}
        self.tool_args, self.signer = tool_args, signer
        self.index = -1  # the open block's index
        self.open: str | None = None  # the open block's kind
        self.thought = ""  # the open thinking block's text, signed when it closes

    @staticmethod
    def event(kind: str, **data: Any) -> bytes:
        return f"event: {kind}\ndata: ".encode() + orjson.dumps({"type": kind, **data}) + b"\n\n"

    def start(self) -> bytes:
        return self.event("message_start", message=self.message)

    def delta(self, choice: int, d: Delta) -> bytes:
        out = []
        if d.kind == "call" or d.kind != self.open:
            out.append(self._close())
            self.index += 1
            self.open = d.kind
            out.append(self.event("content_block_start", index=self.index, content_block=_block_start(d)))
        if d.kind == "reasoning":
            self.thought += d.text
            out.append(self.event("content_block_delta", index=self.index,
                                  delta={"type": "thinking_delta", "thinking": d.text}))
        elif d.kind == "content":
            out.append(self.event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": d.text}))
        else:
            self.tool_args.remember(_tool_use_id(d.call["id"]), d.call["arguments"])
            out.append(self.event("content_block_delta", index=self.index,
                                  delta={"type": "input_json_delta", "partial_json": d.call["arguments"]}))
        return b"".join(out)

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        out = b""
        if self.open == "reasoning":
            out = self.event("content_block_delta", index=self.index,
                             delta={"type": "signature_delta", "signature": self.signer.sign(self.thought)})
            self.thought = ""
        self.open = None
        return out + self.event("content_block_stop", index=self.index)

    def finish(self, message: dict[str, Any]) -> bytes:
        return self._close() + self.event(
            "message_delta", delta={"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
            usage={k: message["usage"][k] for k in DELTA_USAGE}) + self.event("message_stop")

    def error(self, status: int, message: str) -> bytes:
        return self.event("error", error=orjson.loads(anthropic_error(status, message).body)["error"])


def _block_start(d: Delta) -> dict[str, Any]:
    if d.kind == "reasoning":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if d.kind == "content":
        return {"type": "text", "text": ""}
    return {"type": "tool_use", "id": _tool_use_id(d.call["id"]), "name": d.call["name"], "input": {}}


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def check_version(request: Request) -> None:
    """`anthropic-version`: a value that is not a version (a date) is a 400, as Anthropic answers one it does not
    know; every dated version is served alike (the request's fields decide what it gets). A request without the
    header is served too (Anthropic refuses it; curl users and raw harnesses omit it, every SDK sends it)."""
    version = request.headers.get("anthropic-version")
    if version is not None and not VERSION.fullmatch(version.strip()):
        raise RequestError(f"anthropic-version: {version!r} is not a valid version (e.g. 2023-06-01)",
                           param="anthropic-version")


def register(app: FastAPI, service: CallService) -> None:
    @app.post("/v1/messages")
    @app.post("/s/{key}/v1/messages")
    async def messages(request: Request) -> Response:
        check_version(request)
        return await serve(
            request, service, MessagesRequest, API, lambda body: to_canonical(body, service.tool_args, service.signer),
            build=lambda call, req, body: build_response(call, req, service.tool_args, service.signer),
            stream=lambda p, body: MessageStream(p, service.engine.model_name, service.tool_args, service.signer))

    @app.post("/v1/messages/count_tokens")
    @app.post("/s/{key}/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, int]:
        service.registry.resolve(session_key(request), shared=True)
        check_version(request)
        raw, size = await json_body(request, service.config.max_body_bytes)
        validate(CountTokensRequest, raw)
        # every field checked as for a real call; no max_tokens here, so none that a thinking budget must stay under
        body = validate(MessagesRequest, {**raw, "max_tokens": 2**62})
        req = canonical(lambda b: to_canonical(b, service.tool_args, service.signer), body)
        rendered = await service.render(req, inline=size <= service.config.inline_render_bytes)
        return {"input_tokens": len(rendered.prompt_ids)}
