"""Google generateContent (`:generateContent`, `:streamGenerateContent`): the request models, contents/parts →
canonical request, the GenerateContentResponse or its SSE chunks, and the routes.

`:generateContent` answers JSON; `:streamGenerateContent?alt=sse` answers SSE `data:` chunks as the tokens
come (proxy/streaming.py). Function-call args travel as objects, so the argument text the model wrote is remembered per
call id (shared `ToolArgs`) and re-rendered when the harness echoes the call back.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import AliasChoices, Field

from polar_lab.errors import RequestError
from polar_lab.proxy import conformance, constraints
from polar_lab.proxy.canonical import CanonicalRequest, CompletedCall, Lenient, ToolArgs
from polar_lab.proxy.stream_deltas import Delta
from polar_lab.proxy.http import canonical, google_error, json_body, serve, session_key, validate
from polar_lab.proxy.sampling import (Choices, Flag, GoogleExtensions, MaxTokens, Penalty, Seed, StopList,
                                      Temperature, TopLogprobs, TopP, WholeTopK, extensions, stop_tuple, whole)
from polar_lab.proxy.service import CallService, Prepared
from polar_lab.types import Sampling

API = "google.generate_content"
_MODES = {"AUTO": "auto", "ANY": "required", "NONE": "none", "VALIDATED": "auto"}


class Content(Lenient):
    role: str | None = "user"
    parts: list[dict[str, Any]] = Field(default_factory=list)


def _name(camel: str, snake: str) -> Any:
    """Google's JSON takes a field by its lowerCamelCase or its proto name (protobuf's JSON mapping)."""
    return Field(default=None, validation_alias=AliasChoices(camel, snake))


class GenerationConfig(GoogleExtensions):  # vLLM's extension knobs too, camelCase or not (proxy/sampling.py)
    stopSequences: StopList | None = _name("stopSequences", "stop_sequences")  # noqa: N815 - the API's names
    candidateCount: Choices | None = _name("candidateCount", "candidate_count")  # noqa: N815
    maxOutputTokens: MaxTokens | None = _name("maxOutputTokens", "max_output_tokens")  # noqa: N815
    temperature: Temperature | None = None
    topP: TopP | None = _name("topP", "top_p")  # noqa: N815
    topK: WholeTopK | None = _name("topK", "top_k")  # noqa: N815
    seed: Seed | None = None
    presencePenalty: Penalty | None = _name("presencePenalty", "presence_penalty")  # noqa: N815
    frequencyPenalty: Penalty | None = _name("frequencyPenalty", "frequency_penalty")  # noqa: N815
    responseLogprobs: Flag | None = _name("responseLogprobs", "response_logprobs")  # noqa: N815
    logprobs: TopLogprobs | None = None
    thinkingConfig: dict[str, Any] | None = _name("thinkingConfig", "thinking_config")  # noqa: N815
    responseMimeType: str | None = _name("responseMimeType", "response_mime_type")  # noqa: N815
    responseSchema: dict[str, Any] | None = _name("responseSchema", "response_schema")  # noqa: N815
    responseJsonSchema: Any = _name("responseJsonSchema", "response_json_schema")  # noqa: N815


class GenerateContentRequest(Lenient):
    contents: list[Content] = Field(min_length=1)
    systemInstruction: Content | None = _name("systemInstruction", "system_instruction")  # noqa: N815 - the API's names
    tools: list[dict[str, Any]] | None = None
    toolConfig: dict[str, Any] | None = _name("toolConfig", "tool_config")  # noqa: N815
    generationConfig: GenerationConfig | None = _name("generationConfig", "generation_config")  # noqa: N815


def to_canonical(body: GenerateContentRequest, model: str, *, stream: bool, tool_args: ToolArgs) -> CanonicalRequest:
    messages = []
    if body.systemInstruction is not None:
        messages.append({"role": "system", "content": _texts(body.systemInstruction.parts)})
    for content in body.contents:
        messages += _convert(content, tool_args)
    config = body.generationConfig or GenerationConfig()
    conformance.refuse(API, body, config)
    top_k = whole(config.topK, param="generationConfig.topK")
    tool_choice, allowed = _tool_choice(body.toolConfig)
    return CanonicalRequest(
        messages=messages, tools=_tools(body.tools), tool_choice=tool_choice, allowed_tools=allowed,
        max_tokens=config.maxOutputTokens, stream=stream, model=model, thinking=_thinking(config.thinkingConfig),
        thinking_budget=_budget(config.thinkingConfig),
        n=config.candidateCount or 1, logprobs=bool(config.responseLogprobs), top_logprobs=config.logprobs or 0,
        output=constraints.google_format(config.model_dump(exclude_none=True)),
        sampling=Sampling(temperature=1.0 if config.temperature is None else config.temperature,
                          top_p=1.0 if config.topP is None else config.topP, top_k=top_k or -1, seed=config.seed,
                          stop=stop_tuple(config.stopSequences), presence_penalty=config.presencePenalty or 0.0,
                          frequency_penalty=config.frequencyPenalty or 0.0, **extensions(config)))


def _thinking(config: dict[str, Any] | None) -> bool | None:
    """`thinkingConfig.thinkingBudget: 0` turns thinking off (Gemini's documented switch); another budget on."""
    budget = (config or {}).get("thinkingBudget", (config or {}).get("thinking_budget"))
    return None if budget is None else budget != 0


def _budget(config: dict[str, Any] | None) -> int | None:
    """`thinkingBudget` N > 0: at most N thought tokens; -1 (dynamic), 0 (off) or none: no budget."""
    budget = (config or {}).get("thinkingBudget", (config or {}).get("thinking_budget"))
    if budget is not None and (type(budget) is not int or budget < -1):
        raise RequestError("thinkingConfig.thinkingBudget must be an integer >= -1",
                           param="generationConfig.thinkingConfig.thinkingBudget")
    return budget if budget is not None and budget > 0 else None


def _texts(parts: list[dict[str, Any]]) -> str:
    return "".join(p.get("text", "") for p in parts if "text" in p and not p.get("thought"))


def _convert(content: Content, tool_args: ToolArgs) -> list[dict[str, Any]]:
    unsupported = [k for p in content.parts for k in p if k in ("inlineData", "fileData", "executableCode")]
    if unsupported:
        raise RequestError(f"parts of type '{unsupported[0]}' are not supported by this text model", param="contents")
    if content.role == "model":
        message: dict[str, Any] = {"role": "assistant", "content": _texts(content.parts) or None}
        thought = "".join(p.get("text", "") for p in content.parts if p.get("thought"))
        if thought:
            message["reasoning_content"] = thought
        calls = [p["functionCall"] for p in content.parts if "functionCall" in p]
        if calls:
            message["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": {
                "name": c.get("name", ""), "arguments": tool_args.text_for(c.get("id"), c.get("args") or {})}}
                for c in calls]
        return [message]
    out = [{"role": "tool", "tool_call_id": r.get("id") or r.get("name"), "content": json.dumps(r.get("response"))}
           for r in (p["functionResponse"] for p in content.parts if "functionResponse" in p)]
    text = _texts(content.parts)
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out = []
    for tool in tools or []:
        for decl in tool.get("functionDeclarations") or tool.get("function_declarations") or []:
            if not isinstance(decl, dict) or not isinstance(decl.get("name"), str) or not decl["name"]:
                raise RequestError("each function declaration needs a name (a non-empty string)", param="tools")
            function = {k: decl[k] for k in ("name", "description") if k in decl}
            openapi = decl.get("parameters")  # OpenAPI's subset, upper-case types; google-genai sends the other
            function["parameters"] = constraints.from_openapi(openapi, param="tools") if openapi else (
                decl.get("parametersJsonSchema") or decl.get("parameters_json_schema") or {})
            out.append({"type": "function", "function": function})
    return out


def _tool_choice(config: dict[str, Any] | None) -> tuple[str | dict[str, Any], list[str] | None]:
    """(tool choice, the names a forced call may take): mode ANY with `allowedFunctionNames` forces a call of
    one of them (one name: that tool)."""
    calling = (config or {}).get("functionCallingConfig") or (config or {}).get("function_calling_config") or {}
    mode = _MODES.get(str(calling.get("mode", "AUTO")).upper(), "auto")
    names = calling.get("allowedFunctionNames") or calling.get("allowed_function_names") or []
    if mode != "required" or not names:
        return mode, None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise RequestError("allowedFunctionNames must be a list of names",
                           param="toolConfig.functionCallingConfig.allowedFunctionNames")
    return ({"name": names[0]} if len(names) == 1 else mode), list(names)


def build_response(call: CompletedCall, req: CanonicalRequest, tool_args: ToolArgs, tokenizer) -> dict[str, Any]:
    """One candidate per choice (`candidateCount`), with `logprobsResult` when `responseLogprobs` asks for it."""
    candidates = []
    for choice in call.choices:
        parsed, parts = choice.parsed, []
        if parsed.reasoning is not None:
            parts.append({"text": parsed.reasoning, "thought": True})
        if parsed.content:
            parts.append({"text": parsed.content})
        for tc in parsed.tool_calls:
            tool_args.remember(tc["id"], tc["arguments"])
            parts.append({"functionCall": {"id": tc["id"], "name": tc["name"], "args": json.loads(tc["arguments"])}})
        candidate = {"content": {"role": "model", "parts": parts}, "finishReason": _finish(choice.finish_reason),
                     "index": choice.index}
        if req.logprobs:
            candidate.update(_logprobs(choice.generation, tokenizer, req.top_logprobs))
        candidates.append(candidate)
    return {"candidates": candidates, "usageMetadata": usage_metadata(call),
            "modelVersion": req.model or call.model, "responseId": call.request_id}


def usage_metadata(call: CompletedCall) -> dict[str, Any]:
    """Gemini's usageMetadata: candidates count the answer and calls, thoughts apart (`thoughtsTokenCount`), the
    total both; cached = the engine's prefix-cache hits (as Gemini's implicit caching reports them). Text only."""
    answer = call.completion_tokens - call.thought_tokens
    return {"promptTokenCount": call.prompt_tokens, "candidatesTokenCount": answer,
            "thoughtsTokenCount": call.thought_tokens, "cachedContentTokenCount": call.cached_tokens,
            "totalTokenCount": call.prompt_tokens + call.completion_tokens,
            "promptTokensDetails": _text_tokens(call.prompt_tokens), "candidatesTokensDetails": _text_tokens(answer),
            "cacheTokensDetails": _text_tokens(call.cached_tokens)}


def _text_tokens(n: int) -> list[dict[str, Any]]:
    return [{"modality": "TEXT", "tokenCount": n}]


def _finish(reason: str) -> str:
    return "MAX_TOKENS" if reason == "length" else "STOP"


def _logprobs(gen, tokenizer, k: int) -> dict[str, Any]:
    """Google's `logprobsResult`: the chosen token at each step, and the k most likely there (`logprobs`)."""
    def candidate(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": tokenizer.decode([token_id]), "tokenId": token_id, "logProbability": logprob}

    tops = gen.top_logprobs or [{}] * len(gen.output_ids)
    chosen = [candidate(t, lp) for t, lp in zip(gen.output_ids, gen.output_logprobs)]
    top = [{"candidates": [candidate(t, v) for t, v in sorted(alt.items(), key=lambda kv: -kv[1])[:k]]}
           for alt in tops]
    mean = sum(gen.output_logprobs) / len(gen.output_logprobs) if gen.output_logprobs else 0.0
    return {"logprobsResult": {"topCandidates": top, "chosenCandidates": chosen}, "avgLogprobs": mean}


class ContentStream:
    """`streamGenerateContent` chunks as the tokens come (proxy/streaming.py): each a GenerateContentResponse
    with the new part (a thought's text, text, or a whole functionCall); the last one carries the finish
    reason and the usage."""

    def __init__(self, p: Prepared, model: str, tool_args: ToolArgs, *, sse: bool = True):
        self.envelope = {"modelVersion": p.req.model or model, "responseId": p.request_id}
        self.tool_args = tool_args
        self.sse = sse  # `alt=sse`; without it Google streams one JSON array, element by element
        self.content_type = b"text/event-stream; charset=utf-8" if sse else b"application/json; charset=utf-8"
        self.elements = 0

    def element(self, data: bytes) -> bytes:
        """One response of the stream: an SSE event, or the array's next element."""
        self.elements += 1
        if self.sse:
            return b"data: " + data + b"\r\n\r\n"
        return (b"[" if self.elements == 1 else b",\r\n") + data

    def chunk(self, parts: list[dict[str, Any]], finish: str | None = None, index: int = 0,
              scores: dict[str, Any] | None = None, **extra: Any) -> bytes:
        candidate = {"content": {"role": "model", "parts": parts}, **({"finishReason": finish} if finish else {}),
                     "index": index, **(scores or {})}
        return self.element(orjson.dumps({"candidates": [candidate], **extra, **self.envelope}))

    def start(self) -> bytes:
        return b""  # Google's stream begins with the first part

    def delta(self, choice: int, d: Delta) -> bytes:
        if d.kind == "call":
            self.tool_args.remember(d.call["id"], d.call["arguments"])
            part = {"functionCall": {"id": d.call["id"], "name": d.call["name"], "args": json.loads(d.call["arguments"])}}
        else:
            part = {"text": d.text, "thought": True} if d.kind == "reasoning" else {"text": d.text}
        return self.chunk([part], index=choice)

    def finish(self, response: dict[str, Any]) -> bytes:
        out = b"".join(self.chunk([], c["finishReason"], c["index"], usageMetadata=response["usageMetadata"],
                                  scores={k: c[k] for k in ("logprobsResult", "avgLogprobs") if k in c})
                       for c in response["candidates"])  # a candidate's logprobs come whole, with its end
        return out + (b"" if self.sse else b"]")

    def error(self, status: int, message: str) -> bytes:
        return self.element(google_error(status, message).body) + (b"" if self.sse else b"]")


def register(app: FastAPI, service: CallService) -> None:
    @app.post("/v1beta/models/{model_action}")
    @app.post("/s/{key}/v1beta/models/{model_action}")
    @app.post("/v1/models/{model_action}")  # google-genai 3 uses v1 with a custom base_url
    @app.post("/s/{key}/v1/models/{model_action}")
    async def generate_content(request: Request, model_action: str) -> Response:
        model, _, action = model_action.partition(":")
        if action == "countTokens":
            return await count_tokens(request, model)
        if action not in ("generateContent", "streamGenerateContent"):
            raise RequestError(f"unknown method '{action}': use generateContent, streamGenerateContent or "
                               f"countTokens", status=404)
        sse = request.query_params.get("alt") == "sse"
        return await serve(
            request, service, GenerateContentRequest, API,
            lambda body: to_canonical(body, model, stream=action == "streamGenerateContent",
                                      tool_args=service.tool_args),
            build=lambda call, req, body: build_response(call, req, service.tool_args, service.renderer.tokenizer),
            stream=lambda p, body: ContentStream(p, service.engine.model_name, service.tool_args, sse=sse))

    async def count_tokens(request: Request, model: str) -> Response:
        """`countTokens`: the prompt's tokens as this model renders it (`contents`, or a whole
        `generateContentRequest` with its system instruction and tools). Nothing is generated or recorded."""
        service.registry.resolve(session_key(request), shared=True)
        raw, size = await json_body(request, service.config.max_body_bytes)
        inner = raw.get("generateContentRequest", raw)
        if not isinstance(inner, dict):
            raise RequestError("generateContentRequest must be an object", param="generateContentRequest")
        body = validate(GenerateContentRequest, {k: v for k, v in inner.items() if k != "model"})
        req = canonical(lambda b: to_canonical(b, model, stream=False, tool_args=service.tool_args), body)
        rendered = await service.render(req, inline=size <= service.config.inline_render_bytes)
        return Response(orjson.dumps({"totalTokens": len(rendered.prompt_ids)}), media_type="application/json")
