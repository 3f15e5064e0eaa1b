"""The proxy's HTTP app: thin routes over `CallService`; every error leaves in the caller's API shape.

`create_app(service)` builds it; the Lab serves it with uvicorn on its background loop. Session keys
come from the URL path (`/s/{key}/v1/...`), `Authorization: Bearer`, `x-api-key`, `x-goog-api-key` or `?key=`.
Routes: OpenAI `/v1/chat/completions`, `/v1/responses`, `/v1/models`; Google
`/v1beta/models/{model}:generateContent` and `:streamGenerateContent` (also under `/v1/`); Anthropic `/v1/messages`, `/v1/messages/count_tokens`.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from polar_lab.errors import EngineError, RequestError
from polar_lab.proxy import anthropic_messages, google_genai, openai_chat, openai_responses
from polar_lab.proxy.anthropic_protocol import CountTokensRequest, MessagesRequest
from polar_lab.proxy.openai_protocol import ChatCompletionRequest
from polar_lab.proxy.responses_protocol import ResponsesRequest
from polar_lab.proxy.service import CallService

log = logging.getLogger(__name__)

_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                 405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error"}
_GOOGLE_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 405: "INVALID_ARGUMENT",
                  413: "INVALID_ARGUMENT", 503: "UNAVAILABLE"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    405: "invalid_request_error", 413: "request_too_large", 503: "overloaded_error"}


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
    """An error in the shape of the API the caller was speaking (decided by the path)."""
    path = request.url.path
    google = "/v1beta/" in path or path.endswith((":generateContent", ":streamGenerateContent"))
    shape = anthropic_error if "/v1/messages" in path else google_error if google else openai_error
    return shape(status, message, code=code, param=param)


def create_app(service: CallService) -> FastAPI:
    app = FastAPI(title="polar_lab proxy", docs_url=None, redoc_url=None)
    app.state.service = service
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine serves; 503 while it restarts ("engine_restarting") or stays dead
        ("engine_down"). The proxy itself still answers; restarts so far are counted."""
        engine, status = service.engine, service.engine_status()
        state = status.pop("engine")
        body = {"status": "ok" if state == "serving" else f"engine_{state}", "model": engine.model_name,
                "policy_version": engine.policy_version, "in_flight": service.in_flight,
                "calls_recorded": service.store.num_calls, **status}
        return JSONResponse(body, status_code=200 if state == "serving" else 503)

    @app.get("/v1/models")
    @app.get("/s/{key}/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        service.registry.resolve(_key(request))
        engine = service.engine
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                            "owned_by": "polar_lab", "max_model_len": engine.max_model_len}]}

    @app.post("/v1/chat/completions")
    @app.post("/s/{key}/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        tokenizer = service.renderer.tokenizer
        return await _serve(
            request, service, ChatCompletionRequest, openai_chat.API, openai_chat.to_canonical,
            build=lambda call, req, body: openai_chat.build_response(call, req, tokenizer),
            stream=lambda response, body: openai_chat.stream_chunks(
                response, bool(body.stream_options and body.stream_options.include_usage)))

    @app.post("/v1/responses")
    @app.post("/s/{key}/v1/responses")
    async def responses(request: Request) -> Response:
        return await _serve(request, service, ResponsesRequest, openai_responses.API, openai_responses.to_canonical,
                            build=openai_responses.build_response,
                            stream=lambda response, body: openai_responses.stream_events(response))

    @app.post("/v1beta/models/{model_action}")
    @app.post("/s/{key}/v1beta/models/{model_action}")
    @app.post("/v1/models/{model_action}")  # google-genai 3 uses v1 with a custom base_url
    @app.post("/s/{key}/v1/models/{model_action}")
    async def generate_content(request: Request, model_action: str) -> Response:
        model, _, action = model_action.partition(":")
        if action not in ("generateContent", "streamGenerateContent"):
            raise RequestError(f"unknown method '{action}': use generateContent or streamGenerateContent",
                               status=404)
        return await _serve(
            request, service, google_genai.GenerateContentRequest, google_genai.API,
            lambda body: google_genai.to_canonical(body, model, stream=action == "streamGenerateContent",
                                                   tool_args=service.tool_args),
            build=lambda call, req, body: google_genai.build_response(call, req, service.tool_args),
            stream=lambda response, body: google_genai.stream_chunks(response))

    @app.post("/v1/messages")
    @app.post("/s/{key}/v1/messages")
    async def messages(request: Request) -> Response:
        return await _serve(
            request, service, MessagesRequest, anthropic_messages.API,
            lambda body: anthropic_messages.to_canonical(body, service.tool_args),
            build=lambda call, req, body: anthropic_messages.build_response(call, req, service.tool_args),
            stream=lambda response, body: anthropic_messages.stream_events(response))

    @app.post("/v1/messages/count_tokens")
    @app.post("/s/{key}/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, int]:
        service.registry.resolve(_key(request))
        raw, size = await _json_body(request, service.config.max_body_bytes)
        body = _validate(CountTokensRequest, raw)
        req = anthropic_messages.to_canonical(MessagesRequest(max_tokens=1, **body.model_dump()), service.tool_args)
        rendered = await service.render(req, inline=size <= service.config.inline_render_bytes)
        return {"input_tokens": len(rendered.prompt_ids)}

    return app


async def _serve(request: Request, service: CallService, schema, api: str, to_canonical, *, build,
                 stream) -> Response:
    """The one request path every API shares: auth → parse → canonical → engine → record → respond."""
    session = service.registry.resolve(_key(request))
    raw, size = await _json_body(request, service.config.max_body_bytes)
    body = _validate(schema, raw)
    req = _canonical(to_canonical, body)
    call = await service.complete(session, req, api=api, inline=size <= service.config.inline_render_bytes)
    response = build(call, req, body)
    service.record(call, raw, response)  # before anything is sent: nothing served goes unrecorded
    if req.stream:
        return StreamingResponse(stream(response, body), media_type="text/event-stream")
    return Response(orjson.dumps(response), media_type="application/json")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(request, exc.status, exc.message, code=exc.code, param=exc.param)

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return error_response(request, 503, f"the inference engine is unavailable: {exc}",
                              code="engine_unavailable")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(request, exc.status_code, str(exc.detail))

    app.add_middleware(_CatchAll)


class _CatchAll:
    """The last net: any other exception becomes a 500 in the caller's API shape, and the connection stays
    usable. (Starlette's handler for `Exception` answers and then re-raises; uvicorn then drops the keep-alive
    connection, and the caller's next request on it is reset.) Sits inside Starlette's ServerErrorMiddleware
    and outside the handlers above, so only what they do not handle reaches it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:  # noqa: BLE001 - that is this class's whole job
            log.exception("unexpected proxy error")
            if started:
                return  # mid-stream: the status is gone; the client sees a cut stream
            response = error_response(Request(scope), 500, f"internal proxy error: {type(exc).__name__}: {exc}")
            await response(scope, receive, send)


def _canonical(to_canonical, body):
    """The adapter's conversion is a pure function of the body: whatever it trips over is the caller's input.
    (The protocol models keep provider items loose on purpose; this is their last line of defence.)"""
    try:
        return to_canonical(body)
    except RequestError:
        raise
    except (TypeError, AttributeError, KeyError, ValueError, IndexError) as exc:
        raise RequestError(f"malformed request: {type(exc).__name__}: {exc}") from None


def _validate(model, raw: dict[str, Any]):
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _key(request: Request) -> str | None:
    key = request.path_params.get("key")
    if key:
        return key
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    headers = request.headers
    return headers.get("x-api-key") or headers.get("x-goog-api-key") or request.query_params.get("key")


async def _json_body(request: Request, limit: int) -> tuple[dict[str, Any], int]:
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
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    extra = f" (and {exc.error_count() - 1} more problems)" if exc.error_count() > 1 else ""
    return RequestError(f"{loc}: {first['msg']}{extra}", param=loc or None)
