"""What each provider's error body looks like, and the request bodies each surface is tested with."""

from __future__ import annotations

from typing import Any

# path and a small valid body per surface; sampling fields are added by the tests
SURFACES: dict[str, tuple[str, dict[str, Any]]] = {
    "openai.chat": ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "2+2"}]}),
    "openai.responses": ("/v1/responses", {"model": "m", "input": "2+2"}),
    "anthropic.messages": ("/v1/messages", {"model": "m", "max_tokens": 4,
                                            "messages": [{"role": "user", "content": "2+2"}]}),
    "google.generate_content": ("/v1beta/models/m:generateContent", {"contents": [{"parts": [{"text": "2+2"}]}]}),
}


def provider_error(api: str, response) -> str:
    """The error message of a response, after checking the body has that provider's error shape."""
    body = response.json()
    if api == "anthropic.messages":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return body["error"]["message"]
    if api.startswith("google"):
        err = (body[0] if isinstance(body, list) else body)["error"]
        assert err["code"] == response.status_code and isinstance(err["status"], str), body
        return err["message"]
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    return f"{err['message']} (param {err['param']})"


def with_sampling(api: str, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The surface's base body with sampling fields set (Google's go into generationConfig)."""
    path, base = SURFACES[api]
    body = {k: (list(v) if isinstance(v, list) else v) for k, v in base.items()}
    if api.startswith("google"):
        body["generationConfig"] = dict(fields)
    else:
        body.update(fields)
    return path, body
