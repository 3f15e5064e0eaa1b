"""vLLM's tokenizer routes (`POST /tokenize`, `POST /detokenize`), in vLLM's shapes, for frameworks that expect a
vLLM backend (NeMo Gym's `vllm_model`, SkyRL, rLLM).

`/tokenize` of a chat answers with the prompt ids a chat completion with the same messages, tools and
`chat_template_kwargs` would send the engine in that session now: the same render path (proxy/service.py
`CallService.prompt`), so its continued tips and spliced turns included. Under the Lab's shared key a request that
names no session is rendered as a session's first call (a new name never opens a session here). `/tokenize` of a
text (`prompt`) and `/detokenize` are the tokenizer's own. Nothing here is recorded: no model call is made, no
session state changes (its caches aside), and a closed session is refused (409). Large bodies are tokenised in a
worker thread, as calls are.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from pydantic import Field

from polar_lab.errors import RequestError
from polar_lab.proxy.apis import openai_chat
from polar_lab.proxy.canonical import Lenient
from polar_lab.proxy.http import canonical, json_body, session_key, session_of, validate
from polar_lab.proxy.service import CallService
from polar_lab.proxy.sessions import SHARED


class TokenizeText(Lenient):
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChat(Lenient):
    messages: list[openai_chat.ChatMessage] = Field(min_length=1)
    model: str | None = None
    tools: list[openai_chat.Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class Detokenize(Lenient):
    tokens: list[int]
    model: str | None = None


async def tokenize(request: Request, service: CallService) -> dict[str, Any]:
    owner = service.registry.resolve(session_key(request), shared=True)
    raw, size = await json_body(request, service.config.max_body_bytes)
    tokenizer = service.renderer.tokenizer
    inline = size <= service.config.inline_render_bytes

    async def run(fn, *args, **kwargs):  # on the loop when small, else in a worker thread (as calls render)
        return fn(*args, **kwargs) if inline else await asyncio.to_thread(fn, *args, **kwargs)

    if "messages" not in raw:
        body = validate(TokenizeText, raw)
        ids = await run(tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
        return _answer(ids, body.return_token_strs, service)
    body = validate(TokenizeChat, raw)
    for name, value in (("continue_final_message", body.continue_final_message),
                        ("add_special_tokens", body.add_special_tokens), ("chat_template", body.chat_template)):
        if value:  # the proxy renders with the model's (or the session's) template, its text as it is
            raise RequestError(f"{name} is not supported: the proxy renders every prompt with the session's chat "
                               f"template and adds nothing to it", param=name)
    session = owner if owner is not SHARED else session_of(request, service, raw, required=False, create=False)
    if session is not None and session.closed_at is not None:
        raise RequestError(f"session {session.id} is closed: there is no next call to tokenize", status=409,
                           code="session_closed")
    chat = validate(openai_chat.ChatCompletionRequest, {
        "messages": raw["messages"], "tools": raw.get("tools"), "chat_template_kwargs": body.chat_template_kwargs})
    req = canonical(openai_chat.to_canonical, chat)
    if not body.add_generation_prompt:
        text = await run(service.renderer.template_text, req.messages, req.tools,
                         session.chat_template if session else None, generation_prompt=False, thinking=req.thinking)
        ids = await run(service.renderer.encode, text)
    elif session is None:
        ids = (await service.render(req, inline=inline)).prompt_ids
    else:
        ids = (await service.prompt(session, req, inline=inline))[0].prompt_ids
    return _answer(ids, body.return_token_strs, service)


def _answer(ids: list[int], strs: bool | None, service: CallService) -> dict[str, Any]:
    out: dict[str, Any] = {"count": len(ids), "max_model_len": service.engine.max_model_len, "tokens": list(ids)}
    if strs:
        out["token_strs"] = service.renderer.tokenizer.convert_ids_to_tokens(list(ids))
    return out


async def detokenize(request: Request, service: CallService) -> dict[str, Any]:
    service.registry.resolve(session_key(request), shared=True)
    raw, _ = await json_body(request, service.config.max_body_bytes)
    body = validate(Detokenize, raw)
    vocab = len(service.renderer.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"token ids must be in [0, {vocab}), got {bad[:5]}", param="tokens")
    return {"prompt": service.renderer.decode(body.tokens)}


def register(app: FastAPI, service: CallService) -> None:
    @app.post("/tokenize")
    @app.post("/s/{key}/tokenize")
    async def tokenize_route(request: Request) -> dict[str, Any]:
        return await tokenize(request, service)

    @app.post("/detokenize")
    @app.post("/s/{key}/detokenize")
    async def detokenize_route(request: Request) -> dict[str, Any]:
        return await detokenize(request, service)
