"""The request path every API surface shares, and the error shapes: each error leaves in the caller's API shape.

`serve` is the one path: session key → body (size-capped JSON object) → the surface's pydantic model →
canonical request → `CallService.complete` → record → the surface's response, or its SSE stream.
Session keys come from the URL path (`/s/{key}/...`), `Authorization: Bearer`, `x-api-key`,
`x-goog-api-key` or `?key=`; under the Lab's shared key the request names its session instead (`session_of`).
The surfaces themselves live in `proxy/apis/`.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from polar_lab.errors import RequestError
from polar_lab.proxy import streaming
from polar_lab.proxy.service import MAX_TOKENS_HEADER, CallService, max_tokens_header
from polar_lab.proxy.sessions import SHARED, note_call_error
from polar_lab.types import Session

_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                 405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
                 503: "server_error"}
_GOOGLE_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 405: "INVALID_ARGUMENT",
                  409: "FAILED_PRECONDITION", 413: "INVALID_ARGUMENT", 503: "UNAVAILABLE"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    405: "invalid_request_error", 409: "invalid_request_error", 413: "request_too_large",
                    503: "overloaded_error"}


def openai_error(status: int, message: str, *, code: str | None = None, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def anthropic_error(status: int, message: str, *, param: str | None = None, **_: Any) -> JSONResponse:
    body = {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"),
                                       "message": _naming(message, param)}}
    return JSONResponse(body, status_code=status)


def google_error(status: int, message: str, *, param: str | None = None, **_: Any) -> JSONResponse:
    body = {"error": {"code": status, "message": _naming(message, param),
                      "status": _GOOGLE_STATUS.get(status, "INTERNAL")}}
    return JSONResponse(body, status_code=status)


def _naming(message: str, param: str | None) -> str:
    """These shapes have no `param` field: the message names the offending field instead."""
    return message if not param or param in message else f"{param}: {message}"


def error_response(request: Request, status: int, message: str, *, code: str | None = None,
                   param: str | None = None) -> JSONResponse:
    """An error in the shape of the API the caller was speaking."""
    shape = {"anthropic": anthropic_error, "google": google_error}.get(provider(request), openai_error)
    return shape(status, message, code=code, param=param)


GOOGLE_METHODS = (":generateContent", ":streamGenerateContent", ":countTokens")


def provider(request: Request) -> str:
    """Which provider's API a request speaks: "anthropic" | "google" | "openai". By the path where it tells
    (`/v1/messages`, `/v1beta/`, a `model:method` path), else by the provider's own headers — the paths
    `/v1/models...` are shared: google-genai with a base_url uses `/v1/models/...` and sends `x-goog-api-key`,
    the anthropic SDK sends `anthropic-version`."""
    path = request.url.path
    if "/v1/messages" in path:
        return "anthropic"
    if "/v1beta/" in path or path.endswith(GOOGLE_METHODS):  # not any colon: OpenAI's fine-tuned ids have them
        return "google"
    if "/v1/models" in path:  # shared by all three: the caller's headers tell
        if "x-goog-api-key" in request.headers:
            return "google"
        if "anthropic-version" in request.headers:
            return "anthropic"
    return "openai"


async def serve(request: Request, service: CallService, schema, api: str, to_canonical, *, build,
                 stream, expand=None) -> Response:
    """The one request path every API shares: auth → parse → canonical → engine → record → respond.
    build(call, req, body) → the response body; stream(prepared, body) → the API's stream Writer (a streamed
    request is served by proxy/streaming.py, token by token); expand(session, body) → the body with what the
    session keeps for it filled in (a stored previous response), before its conversion."""
    owner = service.registry.resolve(session_key(request), shared=True)
    raw, size = await json_body(request, service.config.max_body_bytes)
    session = owner if owner is not SHARED else session_of(request, service, raw)
    body = validate(schema, raw)
    if expand is not None:
        body = expand(session, body)
    req = canonical(to_canonical, body)
    inline = size <= service.config.inline_render_bytes
    try:
        if req.stream:
            return await streaming.respond(service, session, req, raw, body, api=api, inline=inline, build=build,
                                           writer=stream)
        call = await service.complete(session, req, api=api, inline=inline)
        call.delivered = not await request.is_disconnected()  # a harness that timed out: its retry follows
        response = build(call, req, body)
        service.record(call, raw, response)  # before anything is sent: nothing served goes unrecorded
    except Exception as exc:
        note_call_error(session, exc)  # why a run failed decides its reward (rollout.failure_cause)
        raise
    header = max_tokens_header(call.sampling["max_tokens"], call.sampling["max_tokens_source"])
    return Response(orjson.dumps(response), media_type="application/json", headers={MAX_TOKENS_HEADER: header})


def session_of(request: Request, service: CallService, raw: dict[str, Any] | None = None, *,
               required: bool = True, create: bool = True) -> Session | None:
    """The session a request under the shared key names: the session header, else the configured body field.
    Naming none is a 400, or None when not `required`; naming a closed one is a 409 (a framework still running a
    rollout whose run ended: nothing more goes into it). create: a new name may open a session (when the Lab
    allows it)."""
    cfg = service.config
    name, where = request.headers.get(cfg.session_header), f"header {cfg.session_header}"
    if not name and cfg.session_field and raw is not None:
        name, where = body_field(raw, cfg.session_field), f"body field '{cfg.session_field}'"
    if name is not None and not isinstance(name, str | int):
        raise RequestError(f"the {where} names a session by a string, got {type(name).__name__}",
                           param=cfg.session_field)
    if name in (None, "") and not required:
        return None
    if name in (None, ""):
        also = f" or the body field '{cfg.session_field}'" if cfg.session_field else ""
        raise RequestError(f"a request under the shared key must name its session: send the {cfg.session_header} "
                           f"header{also} with the session's name or id", code="missing_session_id")
    session = service.registry.named(str(name), where=where, create=create)
    if session.closed_at is not None:
        raise RequestError(f"session {str(name)!r} is closed ({session.status}): its run is over", status=409,
                           code="session_closed")
    return session


def body_field(raw: dict[str, Any], path: str) -> Any:
    """The value at a dotted path in the body; None where any step is missing."""
    value: Any = raw
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def canonical(to_canonical, body):
    """The adapter's conversion is a pure function of the body: whatever it trips over is the caller's input.
    (The protocol models keep provider items loose on purpose; this is their last line of defence.)"""
    try:
        return to_canonical(body)
    except RequestError:
        raise
    except (TypeError, AttributeError, KeyError, ValueError, IndexError) as exc:
        raise RequestError(f"malformed request: {type(exc).__name__}: {exc}") from None


def validate(model, raw: dict[str, Any]):
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def session_key(request: Request) -> str | None:
    key = request.path_params.get("key")
    if key:
        return key
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    headers = request.headers
    return headers.get("x-api-key") or headers.get("x-goog-api-key") or request.query_params.get("key")


async def json_body(request: Request, limit: int) -> tuple[dict[str, Any], int]:
    """The body as a JSON object, and its size in bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"request body of {declared} bytes exceeds the limit of {limit}", status=413,
                           code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"request body exceeds the limit of {limit} bytes", status=413,
                               code="request_too_large")
        chunks.append(chunk)
    try:
        data = orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    return data, size


def _validation_error(exc: ValidationError) -> RequestError:
    """The most telling problem, named by the caller's field path. A value that fits none of a union's types
    gets one error per type: the deepest one, and then one that is not a bare type mismatch ("at most 16
    items" rather than "not a string"), says the most."""
    def telling(error) -> tuple[int, bool]:
        path = [p for p in error["loc"] if not _union_tag(p)]
        return len(path), not error["type"].endswith(("_type", "literal_error"))

    first = max(exc.errors(), key=telling)  # the first of the best, in pydantic's order
    loc = ".".join(str(p) for p in first["loc"] if not _union_tag(p))
    extra = f" (and {exc.error_count() - 1} more problems)" if exc.error_count() > 1 else ""
    return RequestError(f"{loc}: {first['msg']}{extra}", param=loc or None)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "bytes"}


def _union_tag(part: str | int) -> bool:
    """pydantic names a union's members in the error path (`stop.constrained-str`, `tool_choice.NamedToolChoice`):
    not field names, so left out of the path the caller sees. Provider field names are snake_case or
    lowerCamelCase, never one of these."""
    return isinstance(part, str) and (part in _TYPE_NAMES or part[:1].isupper() or any(c in part for c in "[-,"))
