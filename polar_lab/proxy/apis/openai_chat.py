"""OpenAI Chat Completions (`POST /v1/chat/completions`): the request model, its conversion to the canonical
request, the response body or SSE chunks, and the route.

Request fields are in OpenAI's documented order; unknown fields are accepted and ignored (harnesses send
`store`, `metadata`, `reasoning_effort`...), the raw body is recorded anyway; our extensions are fenced off at
the end of each model. Streams carry the tokens as the engine samples them (proxy/streaming.py), in OpenAI's
chunk shape; the record is written before the last chunk.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field

from polar_lab.errors import RequestError
from polar_lab.proxy import conformance, constraints
from polar_lab.proxy.canonical import CanonicalRequest, CompletedCall, Lenient
from polar_lab.proxy.stream_deltas import Delta
from polar_lab.proxy.http import openai_error, serve
from polar_lab.proxy.sampling import (Choices, Extensions, Flag, MaxTokens, Penalty, Seed, StopList, StopString,
                                      Temperature, TopK, TopLogprobs, TopP, extensions, stop_tuple)
from polar_lab.proxy.service import CallService, Prepared
from polar_lab.types import Sampling


class ContentPart(Lenient):
    type: str
    text: str | None = None


class FunctionCall(Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # --- extensions (vLLM / DeepSeek convention) ---
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(Lenient):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoiceFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class StreamOptions(Lenient):
    include_usage: bool | None = None


class ChatCompletionRequest(Extensions):  # every surface takes vLLM's extension knobs (proxy/sampling.py)
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
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    user: str | None = None
    # --- extensions (vLLM's names) ---
    top_k: TopK | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # only `enable_thinking`: the rest could rewrite the template
    return_token_ids: Flag | None = None  # `prompt_token_ids` and each choice's `token_ids`: the recorded ids
    return_tokens_as_token_ids: Flag | None = None  # logprob tokens as "token_id:N" (ids that are not text)


API = "openai.chat"


def to_canonical(body: ChatCompletionRequest) -> CanonicalRequest:
    conformance.refuse(API, body)
    tool_choice: Any = body.tool_choice or "auto"
    if not isinstance(tool_choice, str):
        tool_choice = {"name": tool_choice.function.name}
    return CanonicalRequest(
        messages=[_message(m, first=i == 0) for i, m in enumerate(body.messages)],
        tools=[t.model_dump(exclude_none=True) for t in body.tools or []],
        tool_choice=tool_choice,
        max_tokens=body.max_completion_tokens or body.max_tokens, n=body.n,
        logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs or 0,
        stream=bool(body.stream), model=body.model,
        thinking=_thinking(body.chat_template_kwargs, body.reasoning_effort),
        output=constraints.openai_format(body.response_format, param="response_format"),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        sampling=Sampling(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=-1 if body.top_k in (None, 0) else body.top_k,
            seed=body.seed, stop=stop_tuple(body.stop),
            presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=_logit_bias(body.logit_bias), **extensions(body)),
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's {"token id": bias in [-100, 100]}; ids beyond the vocabulary are refused by the engine (a 400)."""
    out = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()) or not -100 <= value <= 100:
            raise RequestError(f"logit_bias maps token ids (digits) to numbers in [-100, 100], got {key!r}: {value}",
                               param="logit_bias")
        out[int(key)] = float(value)
    return out


def _thinking(kwargs: dict[str, Any] | None, effort: str | None = None) -> bool | None:
    """vLLM's `chat_template_kwargs`, of which the proxy takes `enable_thinking` (a bool) and nothing else: the
    template is the model's, and other keys could change what it renders for every later call. Without it,
    OpenAI's `reasoning_effort`: "none" turns thinking off, any other level on (one switch, no levels)."""
    unknown = sorted(set(kwargs or {}) - {"enable_thinking"})
    if unknown:
        raise RequestError(f"chat_template_kwargs supports only 'enable_thinking', got {unknown}",
                           param="chat_template_kwargs")
    value = (kwargs or {}).get("enable_thinking")
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"chat_template_kwargs.enable_thinking must be a boolean, got {value!r}",
                           param="chat_template_kwargs.enable_thinking")
    if value is None and effort is not None:
        return effort != "none"
    return value


def _message(m: ChatMessage, *, first: bool) -> dict[str, Any]:
    role = "system" if m.role == "developer" else ("tool" if m.role == "function" else m.role)
    out: dict[str, Any] = {"role": role, "content": _text(m.content)}
    if role in ("system", "user", "tool") and out["content"] is None:
        out["content"] = ""
    if m.tool_calls:
        out["tool_calls"] = [{"id": tc.id, "type": "function", "function": {
            "name": tc.function.name, "arguments": tc.function.arguments if isinstance(tc.function.arguments, str)
            else json.dumps(tc.function.arguments, ensure_ascii=False)}} for tc in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning_content or m.reasoning
    if reasoning:
        out["reasoning_content"] = reasoning
    return out


def _text(content: str | list | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type not in ("text", "input_text", "output_text") or part.text is None:
            raise RequestError(f"content parts of type '{part.type}' are not supported by this text model",
                               param="messages")
        parts.append(part.text)
    return "".join(parts)


def build_response(call: CompletedCall, req: CanonicalRequest, tokenizer,
                   body: ChatCompletionRequest | None = None) -> dict[str, Any]:
    """The response body; with vLLM's `return_token_ids`, the prompt's and each choice's token ids as recorded
    (the recorded prompt ids are the ones the engine was given, spliced turns and forced prefill included)."""
    with_ids = bool(body and body.return_token_ids)
    as_ids = bool(body and body.return_tokens_as_token_ids)
    choices = []
    for c in call.choices:
        message: dict[str, Any] = {"role": "assistant", "content": c.parsed.content}
        if c.parsed.reasoning is not None:
            message["reasoning_content"] = c.parsed.reasoning
        if c.parsed.tool_calls:
            message["tool_calls"] = [
                {"id": tc["id"], "type": "function", "function": {"name": tc["name"], "arguments": tc["arguments"]}}
                for tc in c.parsed.tool_calls]
        choice = {"index": c.index, "message": message, "logprobs": None, "finish_reason": c.finish_reason}
        if req.logprobs:
            choice["logprobs"] = {"content": token_logprobs(c.generation, tokenizer, req.top_logprobs, as_ids=as_ids)}
        if with_ids:
            choice["token_ids"] = list(c.generation.output_ids)
        choices.append(choice)
    response = {
        "id": "chatcmpl-" + call.request_id, "object": "chat.completion", "created": int(call.created),
        "model": req.model or call.model, "choices": choices,
        "usage": usage(call),
        "system_fingerprint": f"polar_lab-v{call.choices[0].generation.output_versions[-1]}"
        if call.choices[0].generation.output_versions else None,
    }
    if with_ids:
        response["prompt_token_ids"] = list(call.prompt_ids)
    return response


def usage(call: CompletedCall) -> dict[str, Any]:
    """OpenAI's usage object, every field: cached = the engine's prefix-cache hits (OpenAI's automatic caching is
    the same idea), reasoning = the thoughts' tokens; all text: no audio, images, predicted outputs or cache writes."""
    prompt, completion = call.prompt_tokens, call.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": call.cached_tokens, "cache_write_tokens": 0,
                                      "text_tokens": prompt, "audio_tokens": 0, "image_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": call.thought_tokens, "text_tokens": completion,
                                          "audio_tokens": 0, "accepted_prediction_tokens": 0,
                                          "rejected_prediction_tokens": 0}}


def token_logprobs(gen, tokenizer, top_k: int, *, as_ids: bool = False) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content`: each sampled token with its logprob and the `top_k` most likely tokens at
    that position (the sampled one among them when it is one of the k; vLLM adds it to its top k otherwise).
    as_ids: each token written "token_id:N" (vLLM's `return_tokens_as_token_ids`)."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    out = []
    tops = gen.top_logprobs or [{}] * len(gen.output_ids)
    for tid, lp, alternatives in zip(gen.output_ids, gen.output_logprobs, tops):
        best = sorted(alternatives.items(), key=lambda kv: -kv[1])[:top_k]
        out.append({**entry(tid, lp), "top_logprobs": [entry(t, v) for t, v in best]})
    return out


class ChatStream:
    """`chat.completion.chunk` events as the tokens come (proxy/streaming.py): the role first, then reasoning,
    content and whole tool calls per choice, each choice's finish reason (with its logprobs, when asked for),
    the usage when `stream_options.include_usage`, `[DONE]`."""

    def __init__(self, p: Prepared, body: ChatCompletionRequest, model: str, version: int):
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # vLLM's return_token_ids in a stream: the prompt's ids in the first chunk; each choice's ids, all of them,
        # in its finishing chunk (vLLM spreads them over the chunks; joined, the two are the same list)
        self.prompt_ids = p.rendered.prompt_ids if body.return_token_ids else None
        self.n = p.req.n
        self.base = {"id": "chatcmpl-" + p.request_id, "object": "chat.completion.chunk", "created": int(p.created),
                     "model": p.req.model or model, "system_fingerprint": f"polar_lab-v{version}"}

    def event(self, choices: list, **extra: Any) -> bytes:
        return b"data: " + orjson.dumps({**self.base, "choices": choices, **extra}) + b"\n\n"

    def start(self) -> bytes:
        first = {} if self.prompt_ids is None else {"prompt_token_ids": self.prompt_ids}
        return b"".join(self.event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}], **(first if i == 0 else {})) for i in range(self.n))

    def delta(self, choice: int, d: Delta) -> bytes:
        if d.kind == "call":
            tc = d.call
            delta = {"tool_calls": [{"index": d.index, "id": tc["id"], "type": "function",
                                     "function": {"name": tc["name"], "arguments": tc["arguments"]}}]}
        else:
            delta = {"reasoning_content" if d.kind == "reasoning" else "content": d.text}
        return self.event([{"index": choice, "delta": delta, "logprobs": None, "finish_reason": None}])

    def finish(self, response: dict[str, Any]) -> bytes:
        self.base["system_fingerprint"] = response["system_fingerprint"]
        out = [self.event([{"index": ch["index"], "delta": {}, "logprobs": ch["logprobs"],
                            "finish_reason": ch["finish_reason"],
                            **({"token_ids": ch["token_ids"]} if "token_ids" in ch else {})}])
               for ch in response["choices"]]
        if self.include_usage:
            out.append(self.event([], usage=response["usage"]))
        return b"".join(out) + b"data: [DONE]\n\n"

    def error(self, status: int, message: str) -> bytes:
        body = orjson.loads(openai_error(status, message).body)
        return b"data: " + orjson.dumps(body) + b"\n\n"


def register(app: FastAPI, service: CallService) -> None:
    tokenizer = service.renderer.tokenizer

    @app.post("/v1/chat/completions")
    @app.post("/s/{key}/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(
            request, service, ChatCompletionRequest, API, to_canonical,
            build=lambda call, req, body: build_response(call, req, tokenizer, body),
            stream=lambda p, body: ChatStream(p, body, service.engine.model_name, service.engine.policy_version))
