"""What the proxy does with every request field each provider documents: applied, refused, or ignored — and why.

One table per API surface, over the fields of the official SDK's request type (tests/proxy/test_conformance.py
checks that every field the installed SDK knows is here, that each APPLIED field changes what reaches the engine
or what comes back, that each REFUSED field is a 400 in the provider's shape, and that docs/api-conformance.md
lists each IGNORED field with its reason). An ignored constraint is worse than a 400 (the caller believes it
held), so a field is ignored only when ignoring it cannot change the answer the caller relies on: bookkeeping
(metadata, user ids, billing tiers), caching hints (vLLM caches prefixes by itself), or knobs of services this
proxy does not run. `refuse` is called by each surface's conversion with the fields the body set. A last table,
`EXTENSIONS`, lists vLLM's sampling knobs that every surface takes though no provider documents them (derived from
their declaration in polar_lab.types; tests/proxy/test_sampling_knobs.py checks each on each surface).
"""

from __future__ import annotations

from typing import Any

from polar_lab import types
from polar_lab.errors import RequestError

APPLIED = "applied"
CLIENT = "client"  # an SDK option that never leaves the client


def refused(reason: str) -> tuple[str, str]:
    return ("refused", reason)


def ignored(reason: str) -> tuple[str, str]:
    return ("ignored", reason)


_BOOKKEEPING = ignored("bookkeeping for the provider's own dashboards; kept in the recorded request body")
_CACHE = ignored("a prompt-caching hint: vLLM's prefix cache reuses every shared prefix by itself")
_TIER = ignored("a billing/latency tier of the provider's service; one engine serves every request alike")
_MODEL = ignored("every model name is served by the Lab's one model (the name is echoed back)")
_NO_MODERATION = ignored("no moderation or safety filter runs in front of the research model")
_HOSTED = "built-in hosted tools (web search, code containers, files) are not run by this proxy"
_MEDIA = "this proxy serves text models: no audio or image input or output"

FIELDS: dict[str, dict[str, Any]] = {
    "openai.chat": {
        "messages": APPLIED, "model": _MODEL, "frequency_penalty": APPLIED, "presence_penalty": APPLIED,
        "logit_bias": APPLIED, "logprobs": APPLIED, "top_logprobs": APPLIED, "max_tokens": APPLIED,
        "max_completion_tokens": APPLIED, "n": APPLIED, "parallel_tool_calls": APPLIED,
        "response_format": APPLIED, "seed": APPLIED, "stop": APPLIED, "stream": APPLIED, "stream_options": APPLIED,
        "temperature": APPLIED, "top_p": APPLIED, "tools": APPLIED, "tool_choice": APPLIED,
        "reasoning_effort": APPLIED,
        "functions": refused("the legacy `functions` parameter is not supported: send `tools`"),
        "function_call": refused("the legacy `function_call` parameter is not supported: send `tool_choice`"),
        "audio": refused(_MEDIA), "modalities": refused(_MEDIA + " (modalities other than [\"text\"])"),
        "web_search_options": refused(_HOSTED),
        "prediction": ignored("a latency hint (predicted output); the sampled answer does not depend on it"),
        "verbosity": ignored("GPT-5's verbosity level; the chat templates have no switch for it"),
        "store": _BOOKKEEPING, "metadata": _BOOKKEEPING, "user": _BOOKKEEPING, "safety_identifier": _BOOKKEEPING,
        "prompt_cache_key": _CACHE, "prompt_cache_retention": _CACHE, "prompt_cache_options": _CACHE,
        "service_tier": _TIER, "moderation": _NO_MODERATION,
    },
    "openai.responses": {
        "input": APPLIED, "instructions": APPLIED, "model": _MODEL, "max_output_tokens": APPLIED,
        "parallel_tool_calls": APPLIED, "previous_response_id": APPLIED, "reasoning": APPLIED, "store": APPLIED,
        "stream": APPLIED, "temperature": APPLIED, "text": APPLIED, "tool_choice": APPLIED, "tools": APPLIED,
        "top_logprobs": APPLIED, "top_p": APPLIED, "include": APPLIED,
        "truncation": ignored("echoed; 'auto' would drop turns from the middle of a context, which a training "
                              "chain must not do silently: an over-long input is a 400 instead"),
        "background": refused("background responses are not supported: send the request and wait, or stream"),
        "background_options": refused("background responses are not supported"),
        "conversation": refused("the Conversations API is not supported: use previous_response_id or send the "
                                "whole input"),
        "prompt": refused("stored prompt templates are not supported: send instructions and input"),
        "context_management": refused("server-side context compaction is not supported: it would rewrite the "
                                      "training chain"),
        "image": refused(_MEDIA),
        "max_tool_calls": ignored("caps built-in hosted tool calls; " + _HOSTED),
        "access_programs": ignored("access settings of the provider's account"),
        "metadata": ignored("echoed in the response and kept in the recorded body"),
        "user": _BOOKKEEPING, "safety_identifier": _BOOKKEEPING, "prompt_cache_key": _CACHE,
        "prompt_cache_retention": _CACHE, "prompt_cache_options": _CACHE, "service_tier": _TIER,
        "moderation": _NO_MODERATION, "stream_options": ignored("`include_obfuscation` pads events against a "
                                                                "side channel of the provider's network path"),
    },
    "anthropic.messages": {
        "messages": APPLIED, "model": _MODEL, "max_tokens": APPLIED, "stop_sequences": APPLIED, "system": APPLIED,
        "thinking": APPLIED, "tool_choice": APPLIED, "tools": APPLIED, "output_config": APPLIED,
        "output_format": APPLIED, "stream": APPLIED, "temperature": APPLIED, "top_k": APPLIED, "top_p": APPLIED,
        "container": refused(_HOSTED),
        "metadata": _BOOKKEEPING, "service_tier": _TIER, "cache_control": _CACHE,
        "diagnostics": ignored("diagnostic headers of Anthropic's service"),
        "inference_geo": ignored("where Anthropic runs the request; the Lab runs it here"),
        "speed": ignored("a latency tier of Anthropic's service"), "user_profile_id": _BOOKKEEPING,
        "workspace_id": _BOOKKEEPING,
    },
    # GenerateContentConfig (google-genai's snake_case names; the REST API's camelCase names are taken too)
    "google.generate_content": {
        "candidate_count": APPLIED, "frequency_penalty": APPLIED, "presence_penalty": APPLIED, "logprobs": APPLIED,
        "response_logprobs": APPLIED, "max_output_tokens": APPLIED, "response_json_schema": APPLIED,
        "response_mime_type": APPLIED, "response_schema": APPLIED, "seed": APPLIED, "stop_sequences": APPLIED,
        "system_instruction": APPLIED, "temperature": APPLIED, "thinking_config": APPLIED, "tool_config": APPLIED,
        "tools": APPLIED, "top_k": APPLIED, "top_p": APPLIED,
        "http_options": CLIENT, "automatic_function_calling": CLIENT, "should_return_http_response": CLIENT,
        "automatic_continuation": CLIENT, "continuation_token": CLIENT,
        "response_modalities": refused(_MEDIA + " (responseModalities other than [\"TEXT\"])"),
        "speech_config": refused(_MEDIA), "audio_timestamp": refused(_MEDIA), "image_config": refused(_MEDIA),
        "audio_transcription_config": refused(_MEDIA),
        "cached_content": refused("cached contents are not supported: send the contents (vLLM caches the prefix)"),
        "media_resolution": ignored("resolution of media inputs; " + _MEDIA),
        "safety_settings": _NO_MODERATION, "model_armor_config": _NO_MODERATION,
        "routing_config": _MODEL, "model_selection_config": _MODEL, "labels": _BOOKKEEPING,
        "store": _BOOKKEEPING, "service_tier": _TIER,
        "enable_enhanced_civic_answers": ignored("a Gemini product setting for election answers"),
        "generation_output_config": ignored("output settings of Gemini's media generation; " + _MEDIA),
    },
}


# vLLM's sampling knobs no provider documents, taken on every surface (Google's: in generationConfig, by either name):
# rows derived from their one declaration (polar_lab.types.Sampling, fields declared `extension=True`)
EXTENSIONS: dict[str, str] = {
    name: f"applied on every surface: vLLM's `{declared.vllm or name}`, {declared.bound.describe()}"
    for name, declared in types.knobs(types.Sampling) if declared.extension}


def refuse(api: str, *models: Any) -> None:
    """A RequestError for the first field the table refuses that one of `models` (a request body's pydantic
    models: the body, Google's generationConfig) sets, with its reason. A field unset, null or empty is not
    set; modalities of text alone are what this proxy serves."""
    for name, status in FIELDS[api].items():
        if not (isinstance(status, tuple) and status[0] == "refused"):
            continue
        for model in models:
            value = _value(model, name)
            if value in (None, [], {}, False):
                continue
            if name in ("modalities", "response_modalities") and isinstance(value, list) \
                    and [str(v).lower() for v in value] == ["text"]:
                continue
            raise RequestError(f"{name} is not supported: {status[1]}", param=name)


def _value(model: Any, name: str) -> Any:
    """A field of a request model by its name or its lowerCamelCase (Google's REST names), declared or extra."""
    if model is None:
        return None
    camel = name.split("_")[0] + "".join(part.title() for part in name.split("_")[1:])
    extra = model.model_extra or {}
    for key in (name, camel):
        if key in type(model).model_fields:
            value = getattr(model, key)
            if value is not None:
                return value
        if key in extra:
            return extra[key]
    return None


def markdown() -> str:
    """The tables as docs/api-conformance.md shows them (a test keeps the page equal to this)."""
    names = {"openai.chat": "OpenAI Chat Completions", "openai.responses": "OpenAI Responses",
             "anthropic.messages": "Anthropic Messages", "google.generate_content": "Google generateContent "
             "(GenerateContentConfig; REST takes the lowerCamelCase names)"}
    out = []
    for api, fields in FIELDS.items():
        out += [f"### {names[api]}", "", "| field | what the proxy does |", "|---|---|"]
        for name, status in sorted(fields.items()):
            what = status if isinstance(status, str) else f"{status[0]}: {status[1]}"
            out.append(f"| `{name}` | {what} |")
        out.append("")
    out += ["### vLLM extensions (every surface; Google: in generationConfig, lowerCamelCase too)", "",
            "| field | what the proxy does |", "|---|---|"]
    out += [f"| `{name}` | {what} |" for name, what in sorted(EXTENSIONS.items())] + [""]
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown())
