"""The conformance walk (issue 18): every request field the installed official SDK documents, on each API, is
applied (it changes what reaches the engine or what comes back), refused with the provider's 400, or ignored
with its reason listed in docs/api-conformance.md. The engine is scripted: what is checked is the proxy."""

import copy
import re
import typing
from pathlib import Path

import httpx
import pytest

from polar_lab.harness.calculator import CALC_TOOL
from polar_lab.proxy import conformance
from polar_lab.proxy.conformance import APPLIED, FIELDS
from tests.shapes import provider_error

TOOL = CALC_TOOL["function"]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
PATHS = {"openai.chat": "/v1/chat/completions", "openai.responses": "/v1/responses",
         "anthropic.messages": "/v1/messages", "google.generate_content": "/v1beta/models/m:generateContent"}
BASES = {
    "openai.chat": {"model": "m", "messages": [{"role": "user", "content": "2+2"}], "max_tokens": 8},
    "openai.responses": {"model": "m", "input": "2+2", "max_output_tokens": 8},
    "anthropic.messages": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "2+2"}]},
    "google.generate_content": {"contents": [{"role": "user", "parts": [{"text": "2+2"}]}],
                                "generationConfig": {"maxOutputTokens": 8}},
}
CHAT_TOOLS = {"tools": [{"type": "function", "function": TOOL}]}
RESPONSES_TOOLS = {"tools": [{"type": "function", **TOOL}]}
ANTHROPIC_TOOLS = {"tools": [{"name": TOOL["name"], "description": "d", "input_schema": TOOL["parameters"]}]}
GOOGLE_TOOLS = {"tools": [{"functionDeclarations": [{"name": TOOL["name"], "description": "d",
                                                       "parametersJsonSchema": TOOL["parameters"]}]}]}

# field → (what the base needs for the field to matter, the field's value); None: checked by the test named
# beside it (tiny-calc's template has no thoughts, the Qwen3.5 fixture's has; stored responses need a first call)
APPLIED_EXAMPLES = {
    "openai.chat": {
        "messages": ({}, [{"role": "user", "content": "3+3"}]), "frequency_penalty": ({}, 0.5),
        "presence_penalty": ({}, 0.5), "logit_bias": ({}, {"11": 5}), "logprobs": ({}, True),
        "top_logprobs": ({"logprobs": True}, 2), "max_tokens": ({}, 4), "max_completion_tokens": ({}, 4),
        "n": ({}, 2), "parallel_tool_calls": ({**CHAT_TOOLS, "tool_choice": "required"}, False),
        "response_format": ({}, {"type": "json_object"}), "seed": ({}, 7), "stop": ({}, ["x"]),
        "stream": ({}, True), "stream_options": ({"stream": True}, {"include_usage": True}),
        "temperature": ({}, 0.5), "top_p": ({}, 0.5), "tools": ({}, CHAT_TOOLS["tools"]),
        "tool_choice": (CHAT_TOOLS, "required"),
        "reasoning_effort": None,  # tests/proxy/test_thinking.py::test_each_apis_thinking_switch_reaches_the_template
    },
    "openai.responses": {
        "input": ({}, "3+3"), "instructions": ({}, "Be brief."), "max_output_tokens": ({}, 4),
        "parallel_tool_calls": ({**RESPONSES_TOOLS, "tool_choice": "required"}, False),
        "previous_response_id": None,  # tests/integration/test_openai_responses.py::test_a_stored_response_belongs_to_its_session
        "store": None,  # tests/integration/test_openai_responses.py::test_a_stored_response_belongs_to_its_session
        "reasoning": None,  # tests/proxy/test_thinking.py::test_each_apis_thinking_switch_reaches_the_template
        "stream": ({}, True), "temperature": ({}, 0.5),
        "text": ({}, {"format": {"type": "json_object"}}), "tool_choice": (RESPONSES_TOOLS, "required"),
        "tools": ({}, RESPONSES_TOOLS["tools"]), "top_logprobs": ({"include": ["message.output_text.logprobs"]}, 2),
        "top_p": ({}, 0.5), "include": ({}, ["message.output_text.logprobs"]),
    },
    "anthropic.messages": {
        "messages": ({}, [{"role": "user", "content": "3+3"}]), "max_tokens": ({}, 4),
        "stop_sequences": ({}, ["x"]), "system": ({}, "Be brief."),
        "thinking": None,  # tests/proxy/test_thinking.py::test_each_apis_thinking_switch_reaches_the_template
        "tool_choice": (ANTHROPIC_TOOLS, {"type": "any"}), "tools": ({}, ANTHROPIC_TOOLS["tools"]),
        "output_config": ({}, {"format": {"type": "json_schema", "schema": SCHEMA}}),
        "output_format": ({}, {"type": "json_schema", "schema": SCHEMA}), "stream": ({}, True),
        "temperature": ({}, 0.5), "top_k": ({}, 5), "top_p": ({}, 0.5),
    },
    "google.generate_content": {
        "candidate_count": ({}, 2), "frequency_penalty": ({}, 0.5), "presence_penalty": ({}, 0.5),
        "logprobs": ({"responseLogprobs": True}, 2), "response_logprobs": ({}, True), "max_output_tokens": ({}, 4),
        "response_json_schema": ({"responseMimeType": "application/json"}, SCHEMA),
        "response_mime_type": ({}, "application/json"),
        "response_schema": ({"responseMimeType": "application/json"}, {"type": "OBJECT", "properties": {
            "a": {"type": "INTEGER"}}}),
        "seed": ({}, 7), "stop_sequences": ({}, ["x"]), "temperature": ({}, 0.5),
        "thinking_config": None,  # tests/proxy/test_thinking.py::test_each_apis_thinking_switch_reaches_the_template
        "top_k": ({}, 5), "top_p": ({}, 0.5),
        "system_instruction": ({}, {"parts": [{"text": "Be brief."}]}), "tools": ({}, GOOGLE_TOOLS["tools"]),
        "tool_config": (GOOGLE_TOOLS, {"functionCallingConfig": {"mode": "ANY"}}),
    },
}
REFUSED_EXAMPLES = {
    "functions": [{"name": "f", "parameters": {}}], "function_call": "auto", "audio": {"voice": "alloy"},
    "modalities": ["text", "audio"], "web_search_options": {"search_context_size": "low"}, "background": True,
    "background_options": {"x": 1}, "conversation": "conv_1", "prompt": {"id": "pmpt_1"},
    "context_management": [{"type": "compaction"}], "image": {"size": "1024x1024"}, "container": "cntr_1",
    "response_modalities": ["TEXT", "IMAGE"], "speech_config": {"voiceConfig": {}}, "audio_timestamp": True,
    "image_config": {"aspectRatio": "1:1"}, "audio_transcription_config": {"x": 1}, "cached_content": "cachedContents/1",
}
IGNORED_EXAMPLES = {  # a plausible value of each ignored field (default: a string)
    "store": True, "metadata": {"run": "7"}, "prediction": {"type": "content", "content": "4"}, "verbosity": "low",
    "prompt_cache_options": {"x": 1}, "moderation": {"x": 1}, "truncation": "auto", "max_tool_calls": 3,
    "access_programs": ["x"], "stream_options": {"include_obfuscation": False}, "cache_control": {"type": "ephemeral"},
    "diagnostics": {"x": 1}, "media_resolution": "MEDIA_RESOLUTION_LOW", "safety_settings": [
        {"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}], "model_armor_config": {"x": 1},
    "routing_config": {"x": 1}, "model_selection_config": {"x": 1}, "labels": {"run": "7"},
    "enable_enhanced_civic_answers": True, "generation_output_config": {"x": 1},
}
TOP_LEVEL_GOOGLE = {"system_instruction", "tools", "tool_config", "cached_content", "safety_settings", "labels"}


def sdk_fields(api: str) -> set[str]:
    if api == "openai.chat":
        from openai.types.chat import completion_create_params as params
        return set(typing.get_type_hints(params.CompletionCreateParamsBase)) | {"stream"}
    if api == "openai.responses":
        from openai.types.responses import response_create_params as params
        return set(typing.get_type_hints(params.ResponseCreateParamsBase)) | {"stream"}
    if api == "anthropic.messages":
        from anthropic.types import message_create_params as params
        return set(typing.get_type_hints(params.MessageCreateParamsBase)) | {"stream"}
    from google.genai import types
    return set(types.GenerateContentConfig.model_fields)


@pytest.fixture(scope="module")
def lab(model_path, tokenizer, tmp_path_factory):
    from polar_lab import Lab
    from polar_lab.engine import ScriptedEngine

    engine = ScriptedEngine(tokenizer, ['{"a": 4}'], model_path=model_path)
    with Lab(port=0, engine=engine, runs_dir=str(tmp_path_factory.mktemp("conformance")), run_name="c") as lab:
        yield lab


def _body(api: str, context: dict, name: str | None = None, value=None) -> dict:
    body = copy.deepcopy(BASES[api])
    if api != "google.generate_content":
        body.update(context)
        if name is not None:
            body[name] = value
        return body
    for key, v in context.items():
        (body if key in ("tools",) else body["generationConfig"])[key] = v
    if name is not None:
        (body if name in TOP_LEVEL_GOOGLE else body["generationConfig"])[_camel(name)] = value
    return body


def _camel(name: str) -> str:
    """Google's REST name of a google-genai field: response_mime_type → responseMimeType."""
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


_VOLATILE = {"id", "created", "created_at", "responseId", "call_id", "system_fingerprint"}
# what a Responses body echoes from its request: an applied field must change more than its echo
_ECHOED = {"temperature", "top_p", "max_output_tokens", "parallel_tool_calls", "text", "tools", "tool_choice",
           "instructions", "reasoning", "truncation", "store", "previous_response_id", "metadata", "model"}


def _stable(value):
    """A response body without what differs between two identical calls (ids, times)."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def _served(lab, api: str, body: dict) -> tuple:
    s = lab.session()
    r = httpx.post(f"{s.base_url}/s/{s.key}{PATHS[api]}", json=body, timeout=30)
    assert r.status_code == 200, r.text[:400]
    spec = lab.engine.specs[-1]
    if body.get("stream"):
        return lab.engine.prompts[-1], spec, _stable_stream(r.text)
    answer = r.json()
    if api == "openai.responses":  # not the request's fields echoed in the envelope
        answer = {k: v for k, v in answer.items() if k not in _ECHOED}
    return lab.engine.prompts[-1], spec, _stable(answer)


def _stable_stream(text: str) -> list:
    import json

    return [_stable(json.loads(line[5:])) for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("api", list(FIELDS))
def test_every_field_the_sdk_documents_is_classified(api):
    missing = sorted(sdk_fields(api) - set(FIELDS[api]))
    assert not missing, f"{api}: classify {missing} in polar_lab/proxy/conformance.py"


def test_the_docs_page_lists_every_field_with_what_is_done_and_why():
    page = Path("docs/api-conformance.md").read_text()
    assert conformance.markdown() in page, "regenerate the tables: python -m polar_lab.proxy.conformance"


def test_every_applied_field_has_an_example_or_names_its_test():
    for api, fields in FIELDS.items():
        assert {n for n, status in fields.items() if status == APPLIED} == set(APPLIED_EXAMPLES[api]), api
    named = re.findall(r'": None,  # (tests/\S+\.py)::(test_\w+)', Path(__file__).read_text())
    assert len(named) == sum(e is None for examples in APPLIED_EXAMPLES.values() for e in examples.values())
    for path, test in named:
        assert f"def {test}(" in Path(path).read_text(), (path, test)


@pytest.mark.parametrize("api, name", [(api, name) for api, fields in FIELDS.items() for name, status in fields.items()
                                       if status == APPLIED and APPLIED_EXAMPLES[api].get(name) is not None])
def test_an_applied_field_changes_what_reaches_the_engine_or_what_comes_back(lab, api, name):
    context, value = APPLIED_EXAMPLES[api][name]
    assert _served(lab, api, _body(api, context, name, value)) != _served(lab, api, _body(api, context))


@pytest.mark.parametrize("api, name", [(api, name) for api, fields in FIELDS.items() for name, status in fields.items()
                                       if isinstance(status, tuple) and status[0] == "refused"])
def test_a_refused_field_is_a_400_in_the_providers_shape_with_its_reason(lab, api, name):
    s = lab.session()
    r = httpx.post(f"{s.base_url}/s/{s.key}{PATHS[api]}", json=_body(api, {}, name, REFUSED_EXAMPLES[name]),
                   timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert FIELDS[api][name][1] in provider_error(api, r)


@pytest.mark.parametrize("api, name", [(api, name) for api, fields in FIELDS.items() for name, status in fields.items()
                                       if isinstance(status, tuple) and status[0] == "ignored"])
def test_an_ignored_field_is_served_as_if_absent(lab, api, name):
    """Ignored means the engine gets what it gets without the field (the docs say why): the same prompt and
    sampling, and no 5xx or surprise 400."""
    with_field = _served(lab, api, _body(api, {}, name, IGNORED_EXAMPLES.get(name, "x")))
    assert with_field[:2] == _served(lab, api, _body(api, {}))[:2]
