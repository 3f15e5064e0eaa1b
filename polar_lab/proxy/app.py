"""The proxy's HTTP app: the API-neutral routes (`/health`, `/v1/models`) and error handlers; each provider
surface in `proxy/apis/` adds its own routes.

`create_app(service)` builds it; the Lab serves it with uvicorn on its background loop.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from polar_lab.errors import EngineError, RequestError
from polar_lab.proxy import apis
from polar_lab.proxy.http import error_response, provider, session_key
from polar_lab.proxy.service import CallService

log = logging.getLogger(__name__)


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
    @app.get("/v1beta/models")
    @app.get("/s/{key}/v1beta/models")
    async def models(request: Request) -> dict[str, Any]:
        """The served model, in the caller's provider's list shape (every model name is served by it)."""
        service.registry.resolve(session_key(request), shared=True)
        kind = provider(request)
        model = model_object(kind, service.engine.model_name, service.engine)
        if kind == "google":
            return {"models": [model]}
        if kind == "anthropic":
            return {"data": [model], "has_more": False, "first_id": model["id"], "last_id": model["id"]}
        return {"object": "list", "data": [model]}

    @app.get("/v1/models/{model_id:path}")
    @app.get("/s/{key}/v1/models/{model_id:path}")
    @app.get("/v1beta/models/{model_id:path}")
    @app.get("/s/{key}/v1beta/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict[str, Any]:
        """Any model name, as the model that serves it (the proxy answers every name with its one model)."""
        service.registry.resolve(session_key(request), shared=True)
        return model_object(provider(request), model_id.removeprefix("models/"), service.engine)

    for api in apis.SURFACES:
        api.register(app, service)
    return app


def model_object(kind: str, name: str, engine) -> dict[str, Any]:
    """One model in a provider's shape: OpenAI's `model`, Anthropic's `ModelInfo`, Google's `Model`."""
    if kind == "google":
        return {"name": f"models/{name}", "baseModelId": name, "version": str(engine.policy_version),
                "displayName": name, "description": f"served by polar_lab ({engine.model_name})",
                "inputTokenLimit": engine.max_model_len, "outputTokenLimit": engine.max_model_len,
                "supportedGenerationMethods": ["generateContent", "streamGenerateContent", "countTokens"]}
    if kind == "anthropic":
        return {"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"}
    return {"id": name, "object": "model", "created": 0, "owned_by": "polar_lab", "max_model_len": engine.max_model_len}


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
