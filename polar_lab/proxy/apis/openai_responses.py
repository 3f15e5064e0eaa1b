"""OpenAI Responses (`POST /v1/responses`): the request model, input items → canonical request, the response
object or SSE events, and the route.

Input items are kept as loose dicts with a `type`: Codex and the Agents SDK send items this layer does not need
to understand in full. Non-function tools (Codex's `namespace`, `web_search`, `local_shell`...) are accepted
and not offered to the model. Items map onto chat messages: `message` → a message (developer → system),
consecutive `function_call` items → one assistant turn's tool calls, `function_call_output` → a tool message,
`reasoning` → the thought that opens an assistant turn (a thought alone is a turn of its own). Responses are
stored (`StoredResponses`) unless the request says `store: false`: `previous_response_id` continues one of its
own session's (its items go before the new input, and the chain stays token-exact: they are the items this proxy
answered), `GET /v1/responses/{id}` returns one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Literal

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from polar_lab.errors import RequestError
from polar_lab.proxy import conformance, constraints
from polar_lab.proxy.apis.openai_chat import token_logprobs
from polar_lab.proxy.canonical import CanonicalRequest, CompletedCall, ThoughtSigner
from polar_lab.proxy.stream_deltas import Delta
from polar_lab.proxy.http import openai_error, serve, session_key, session_of
from polar_lab.proxy.sampling import Extensions, MaxTokens, Seed, Temperature, TopK, TopLogprobs, TopP, extensions
from polar_lab.proxy.service import CallService, Prepared
from polar_lab.proxy.sessions import SHARED
from polar_lab.types import Sampling, Session


class ResponsesRequest(Extensions):  # every surface takes vLLM's extension knobs (proxy/sampling.py)
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
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None  # echoed; "auto" is not applied (docs/api-conformance.md)
    metadata: dict[str, str] | None = None
    # --- extensions (vLLM's names) ---
    top_k: TopK | None = None
    seed: Seed | None = None
    enable_response_messages: bool | None = None  # `input_messages` / `output_messages`: the recorded ids, as text


API = "openai.responses"
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# `include` values OpenAI documents; the two this proxy can fill are served, the rest name hosted tools and images
# this text model does not have (docs/api-conformance.md)
INCLUDES = {"reasoning.encrypted_content", "message.output_text.logprobs", "file_search_call.results",
            "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
            "computer_call_output.output.image_url", "code_interpreter_call.outputs"}


def to_canonical(body: ResponsesRequest, signer: ThoughtSigner | None = None) -> CanonicalRequest:
    """`body` with any previous response already expanded into its input (StoredResponses.expand). signer opens
    the `encrypted_content` of echoed reasoning items."""
    conformance.refuse(API, body)
    unknown = sorted(set(body.include or []) - INCLUDES)
    if unknown:
        raise RequestError(f"include: unknown value {unknown[0]!r} (supported: {', '.join(sorted(INCLUDES))})",
                           param="include")
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    messages += _messages(items, signer)
    functions = [t for t in body.tools or [] if t.get("type") == "function"]
    if any(not isinstance(t.get("name"), str) or not t["name"] for t in functions):
        raise RequestError("each function tool needs a name (a non-empty string)", param="tools")
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
             for t in functions]
    choice, allowed = _allowed(body.tool_choice)
    return CanonicalRequest(
        messages=messages, tools=tools, tool_choice=choice, allowed_tools=allowed,
        max_tokens=body.max_output_tokens,
        logprobs="message.output_text.logprobs" in (body.include or []), top_logprobs=body.top_logprobs or 0,
        stream=bool(body.stream), model=body.model, thinking=_thinking(body.reasoning),
        output=constraints.openai_format((body.text or {}).get("format"), param="text.format"),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        sampling=Sampling(temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p,
                          top_k=-1 if body.top_k in (None, 0) else body.top_k, seed=body.seed, **extensions(body)))


def _thinking(reasoning: dict[str, Any] | None) -> bool | None:
    """`reasoning: {"effort": "none"}` turns thinking off (OpenAI's value for no reasoning); any other effort on.
    The templates have one switch, not levels: minimal to xhigh all think (docs/api-conformance.md)."""
    effort = (reasoning or {}).get("effort")
    if effort is not None and effort not in EFFORTS:
        raise RequestError(f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {effort!r}",
                           param="reasoning.effort")
    return None if effort is None else effort != "none"


def _messages(items: list[dict[str, Any]], signer: ThoughtSigner | None = None) -> list[dict[str, Any]]:
    """Input items → chat messages. A `reasoning` item opens the assistant turn the model's output began with: the
    assistant message and function calls after it join that turn. A thought followed by anything else (a user
    message, a tool result, the end of the input) is a turn of its own, its thought and no content, as the model
    produced it — dropping it would lose a turn from the prompt and break the session's chain."""
    out: list[dict[str, Any]] = []
    thought_only = False  # out[-1] is a turn a reasoning item opened, with nothing after its thought yet
    for item in items:
        kind = item.get("type", "message")
        if kind == "reasoning":
            text = _reasoning_text(item, signer)
            if thought_only:  # consecutive reasoning items: one thought
                out[-1]["reasoning_content"] += text
            else:
                out.append({"role": "assistant", "content": None, "reasoning_content": text})
            thought_only = True
            continue
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role", "user"), item.get("role", "user"))
            if role == "assistant" and thought_only:
                out[-1]["content"] = _text(item.get("content"))
            else:
                out.append({"role": role, "content": _text(item.get("content"))})
        elif kind == "function_call":
            # calls join the assistant turn they follow; after a tool result a new turn starts
            turn = out[-1] if out and out[-1]["role"] == "assistant" else None
            if turn is None:
                turn = {"role": "assistant", "content": None}
                out.append(turn)
            turn.setdefault("tool_calls", []).append({"id": item.get("call_id"), "type": "function", "function": {
                "name": item.get("name", ""), "arguments": item.get("arguments", "{}")}})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _text(item.get("output"))})
        else:
            raise RequestError(f"input items of type '{kind}' are not supported", param="input")
        thought_only = False
    return out


def _reasoning_text(item: dict[str, Any], signer: ThoughtSigner | None) -> str:
    """An echoed reasoning item's thought: sealed in its `encrypted_content` (what a client that keeps no state,
    Codex with store=false, sends back), else its content or summary text."""
    sealed = item.get("encrypted_content")
    if sealed is not None and signer is not None:
        text = signer.unseal(sealed) if isinstance(sealed, str) else None
        if text is None:
            raise RequestError("reasoning item: encrypted_content was not produced by this server (or was altered)",
                               param="input")
        return text
    return _text(item.get("content") or item.get("summary")) or ""


def _text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"content must be a string or a list of parts, not {type(content).__name__}",
                           param="input")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"content parts of type '{kind}' are not supported by this text model",
                               param="input")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any]:
    if choice is None or isinstance(choice, str):
        return choice or "auto"
    if choice.get("type") == "function":
        if not isinstance(choice.get("name"), str) or not choice["name"]:
            raise RequestError("tool_choice of type 'function' needs a name", param="tool_choice")
        return {"name": choice["name"]}
    return "auto"  # hosted-tool choices name tools we do not offer


def _allowed(choice: str | dict[str, Any] | None) -> tuple[str | dict[str, Any], list[str] | None]:
    """`tool_choice: {"type": "allowed_tools", "mode": "required", "tools": [...]}`: a call of one of those
    tools is forced (the grammar holds it to them). In mode "auto" the choice would not be held to the list
    (an unforced turn is not constrained), so that mode is refused rather than ignored."""
    if not isinstance(choice, dict) or choice.get("type") != "allowed_tools":
        return _tool_choice(choice), None
    names = [t.get("name") for t in choice.get("tools") or [] if isinstance(t, dict)]
    if not names or not all(isinstance(n, str) and n for n in names):
        raise RequestError("tool_choice.tools must name function tools", param="tool_choice.tools")
    if choice.get("mode") != "required":
        raise RequestError("tool_choice allowed_tools is supported in mode 'required' only", param="tool_choice.mode")
    return ({"name": names[0]} if len(names) == 1 else "required"), names


class StoredResponses:
    """The responses a session keeps for `previous_response_id` and `GET /v1/responses/{id}` (`store`, true unless
    the request says false, as OpenAI's). Each keeps its own input items, its output items, its previous
    response's id and its body — what its recorded call holds — so a conversation is rebuilt by walking back
    through the previous responses. A response belongs to its session, kept under (session, id): another session's
    id is a 404, as an unknown one, and a replayed branch that answers with its record's id keeps its own copy.
    Kept only for calls answered whole (not a stream its client cut off) while the session is open; dropped when it
    closes. Bounded: per session by the bytes of its kept inputs (`session_bytes`: a client that
    resends the whole conversation each turn and leaves `store` on would otherwise keep O(turns²)), and in all
    by count (`size`); the oldest go first."""

    def __init__(self, size: int = 100_000, session_bytes: int = 32 * 2**20):
        self.size, self.session_bytes = size, session_bytes
        self._kept: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()  # (session, response id) → kept
        self._by_session: dict[str, OrderedDict[str, int]] = {}  # session → its kept ids → their input bytes
        self._bytes: dict[str, int] = {}  # session → the input bytes it keeps (the sum of the above)

    def keep(self, call: CompletedCall, request: dict[str, Any], response: dict[str, Any]) -> None:
        aborted = call.render.get("stream_aborted") or any(c.finish_reason == "abort" for c in call.choices)
        if call.api != API or request.get("store") is False or aborted or call.session.closed_at is not None:
            return
        items = request.get("input")
        items = [{"type": "message", "role": "user", "content": items}] if isinstance(items, str) else items
        try:
            size = len(orjson.dumps(items))
        except (TypeError, ValueError):  # nested past orjson's limit: not kept (continuing it would 404)
            return
        sid = call.session.id
        self._kept[sid, response["id"]] = {"session": sid, "previous": request.get("previous_response_id"),
                                           "response": response, "input": items}
        mine = self._by_session.setdefault(sid, OrderedDict())
        mine[response["id"]] = size
        self._bytes[sid] = self._bytes.get(sid, 0) + size
        while self._bytes[sid] > self.session_bytes and len(mine) > 1:
            oldest, freed = mine.popitem(last=False)
            self._kept.pop((sid, oldest), None)
            self._bytes[sid] -= freed
        while len(self._kept) > self.size:
            (_, response_id), kept = self._kept.popitem(last=False)
            freed = self._by_session.get(kept["session"], {}).pop(response_id, 0)
            self._bytes[kept["session"]] = self._bytes.get(kept["session"], 0) - freed

    def get(self, session: Session, response_id: str) -> dict[str, Any]:
        kept = self._kept.get((session.id, response_id))
        if kept is None:
            raise RequestError(f"Response with id '{response_id}' not found.", status=404,
                               param="previous_response_id")
        return kept

    def expand(self, session: Session, body: ResponsesRequest) -> ResponsesRequest:
        """The body with its previous responses' input and output items before its own input (their
        instructions are not carried over, as OpenAI documents)."""
        if not body.previous_response_id:
            return body
        turns: list[list[Any]] = []  # newest first
        at: str | None = body.previous_response_id
        seen = set()
        while at and at not in seen:
            seen.add(at)
            kept = self.get(session, at)
            turns.append(kept["input"] + kept["response"]["output"])
            at = kept["previous"]
        own = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) \
            else body.input
        return body.model_copy(update={"input": [item for turn in reversed(turns) for item in turn] + own})

    def kept(self, session_id: str) -> int:
        """How many responses a session keeps (for tests and the dashboard)."""
        return len(self._by_session.get(session_id, ()))

    def drop(self, session: Session) -> None:
        self._bytes.pop(session.id, None)
        for response_id in self._by_session.pop(session.id, {}):
            self._kept.pop((session.id, response_id), None)


def build_response(call: CompletedCall, req: CanonicalRequest, body: ResponsesRequest,
                   signer: ThoughtSigner | None = None, tokenizer=None) -> dict[str, Any]:
    (choice,) = call.choices
    parsed, output = choice.parsed, []
    if parsed.reasoning is not None:
        output.append(_reasoning_item(call.request_id, parsed.reasoning, body, signer))
    if parsed.content:
        logprobs = token_logprobs(choice.generation, tokenizer, req.top_logprobs) if req.logprobs and tokenizer else []
        output.append({"type": "message", "id": "msg_" + call.request_id, "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": parsed.content, "annotations": [],
                                    "logprobs": logprobs}]})
    for tc in parsed.tool_calls:
        output.append({"type": "function_call", "id": "fc_" + tc["id"].removeprefix("call_"), "call_id": tc["id"],
                       "name": tc["name"], "arguments": tc["arguments"], "status": "completed"})
    truncated = choice.finish_reason == "length"
    usage = {"input_tokens": call.prompt_tokens, "output_tokens": call.completion_tokens,
             "total_tokens": call.prompt_tokens + call.completion_tokens,
             "input_tokens_details": {"cached_tokens": call.cached_tokens, "cache_write_tokens": 0,  # no cache writes
                                      "cache_write_tokens_details": {"ttl_30m_tokens": 0, "ttl_12h_tokens": 0}},
             "output_tokens_details": {"reasoning_tokens": call.thought_tokens}}
    response = {**_envelope(call.request_id, call.created, req, body, call.model),
                "status": "incomplete" if truncated else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
                "output": output, "usage": usage}
    if body.enable_response_messages and tokenizer is not None:  # vLLM's shape: the raw prompt and output, with ids
        raw = {"type": "raw_message_tokens"}
        response["input_messages"] = [{**raw, "message": tokenizer.decode(call.prompt_ids, skip_special_tokens=False),
                                       "tokens": list(call.prompt_ids)}]
        response["output_messages"] = [{**raw, "message": choice.generation.text,
                                        "tokens": list(choice.generation.output_ids)}]
    return response


def _reasoning_item(request_id: str, text: str, body: ResponsesRequest, signer: ThoughtSigner | None,
                    ) -> dict[str, Any]:
    item = {"type": "reasoning", "id": "rs_" + request_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}
    if signer is not None and "reasoning.encrypted_content" in (body.include or []):
        item["encrypted_content"] = signer.seal(text)
    return item


def _envelope(request_id: str, created: float, req: CanonicalRequest, body: ResponsesRequest, model: str
              ) -> dict[str, Any]:
    """A response object as it starts: in progress, no output yet."""
    return {"id": "resp_" + request_id, "object": "response", "created_at": created, "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": req.model or model, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False, "temperature": req.sampling.temperature,
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "top_p": req.sampling.top_p,
            "text": body.text or {"format": {"type": "text"}}, "truncation": body.truncation or "disabled",
            "previous_response_id": body.previous_response_id, "store": body.store is not False,
            "reasoning": body.reasoning or {"effort": None, "summary": None}, "usage": None,
            "metadata": body.metadata or {}}


class ResponseStream:
    """Responses API events as the tokens come (proxy/streaming.py): `response.created`, then one output item per
    run of reasoning (`reasoning_text` deltas), text (`output_text` deltas) or a whole function call, each
    closed with its `.done` events, then `response.completed` (or `.incomplete`) with the full response."""

    def __init__(self, p: Prepared, body: ResponsesRequest, model: str, signer: ThoughtSigner | None = None):
        self.envelope = _envelope(p.request_id, p.created, p.req, body, model)
        self.body, self.signer = body, signer
        self.rid = p.request_id
        self.seq = 0
        self.index = -1  # the open item's output index
        self.item: dict[str, Any] | None = None  # the open item, its text growing

    def event(self, kind: str, **data: Any) -> bytes:
        self.seq += 1
        payload = {"type": kind, "sequence_number": self.seq - 1, **data}
        return f"event: {kind}\ndata: ".encode() + orjson.dumps(payload) + b"\n\n"

    def start(self) -> bytes:
        return self.event("response.created", response=self.envelope) + \
            self.event("response.in_progress", response=self.envelope)

    def delta(self, choice: int, d: Delta) -> bytes:
        if d.kind == "call":
            item = {"type": "function_call", "id": "fc_" + d.call["id"].removeprefix("call_"), "call_id": d.call["id"],
                    "name": d.call["name"], "arguments": d.call["arguments"], "status": "completed"}
            out = self._close() + self._open(item | {"status": "in_progress", "arguments": ""})
            ids = {"item_id": item["id"], "output_index": self.index}
            return out + self.event("response.function_call_arguments.delta", **ids, delta=item["arguments"]) + \
                self.event("response.function_call_arguments.done", **ids, arguments=item["arguments"],
                           name=item["name"]) + self._close(item)
        kind = "reasoning" if d.kind == "reasoning" else "message"
        out = b""
        if self.item is None or self.item["type"] != kind:
            out = self._close()
            if kind == "reasoning":
                out += self._open({"type": "reasoning", "id": "rs_" + self.rid, "summary": [], "content": []})
            else:
                out += self._open({"type": "message", "id": "msg_" + self.rid, "status": "in_progress",
                                   "role": "assistant", "content": []})
                out += self.event("response.content_part.added", **self._ids(),
                                  part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            self.item["text"] = ""
        self.item["text"] += d.text
        kind_event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + self.event(kind_event, **self._ids(), delta=d.text, **extra)

    def _ids(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": self.index, "content_index": 0}

    def _open(self, item: dict[str, Any]) -> bytes:
        self.index += 1
        self.item = item
        return self.event("response.output_item.added", output_index=self.index, item=item)

    def _close(self, whole: dict[str, Any] | None = None) -> bytes:
        """End the open item (a function call is given `whole`)."""
        item, self.item = self.item, None
        if item is None:
            return b""
        if whole is not None:
            return self.event("response.output_item.done", output_index=self.index, item=whole)
        text, ids = item.pop("text"), {"item_id": item["id"], "output_index": self.index, "content_index": 0}
        if item["type"] == "reasoning":
            out = self.event("response.reasoning_text.done", **ids, text=text)
            done = _reasoning_item(self.rid, text, self.body, self.signer)
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out = self.event("response.output_text.done", **ids, text=text, logprobs=[]) + \
                self.event("response.content_part.done", **ids, part=part)
            done = {**item, "status": "completed", "content": [part]}
        return out + self.event("response.output_item.done", output_index=self.index, item=done)

    def finish(self, response: dict[str, Any]) -> bytes:
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return self._close() + self.event(kind, response=response)

    def error(self, status: int, message: str) -> bytes:
        error = orjson.loads(openai_error(status, message).body)["error"]
        return self.event("error", code=error["code"] or error["type"], message=message, param=error["param"])


def register(app: FastAPI, service: CallService) -> None:
    stored = service.responses = StoredResponses()  # the service holds it: tests and the dashboard read it
    service.on_record.append(stored.keep)
    service.registry.on_close.append(stored.drop)

    @app.post("/v1/responses")
    @app.post("/s/{key}/v1/responses")
    async def responses(request: Request) -> Response:
        return await serve(request, service, ResponsesRequest, API, lambda body: to_canonical(body, service.signer),
                           build=lambda call, req, body: build_response(call, req, body, service.signer,
                                                                        service.renderer.tokenizer),
                           stream=lambda p, body: ResponseStream(p, body, service.engine.model_name, service.signer),
                           expand=stored.expand)

    @app.get("/v1/responses/{response_id}")
    @app.get("/s/{key}/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str) -> Response:
        owner = service.registry.resolve(session_key(request), shared=True)
        session = owner if owner is not SHARED else session_of(request, service)
        return Response(orjson.dumps(stored.get(session, response_id)["response"]), media_type="application/json")
