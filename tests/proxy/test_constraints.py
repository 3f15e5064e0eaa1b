"""The grammars of structured outputs and forced calls (proxy/constraints.py), without an engine: what a schema
becomes, what it may not hold, and the budget it is sized to. The real engine's side is
tests/integration/test_structured_outputs.py."""

import json

import httpx
import pytest

from polar_lab.errors import RequestError
from polar_lab.proxy import constraints
from polar_lab.proxy.constraints import NUMBER_BOUND, OutputFormat, budgeted, checked_schema

ANSWER = {"type": "object", "properties": {"value": {"type": "integer"}, "why": {"type": "string"},
                                            "steps": {"type": "array", "items": {"type": "string"}}},
          "required": ["value", "why", "steps"]}


def test_unbounded_numbers_strings_and_arrays_get_bounds_sized_to_the_budget():
    schema = budgeted(checked_schema(ANSWER, param="p", strict=True)[0], 200)
    props = schema["properties"]
    assert (props["value"]["minimum"], props["value"]["maximum"]) == (-NUMBER_BOUND, NUMBER_BOUND)
    assert props["steps"]["maxItems"] == constraints.ARRAY_BOUND
    # 1 + 8 strings share what is left after the skeleton; the whole document fits in 200 characters
    (share,) = {props["why"]["maxLength"], props["steps"]["items"]["maxLength"]}
    skeleton = 2 + sum(len(n) + constraints.PROPERTY_CHARS for n in props) + constraints.NUMBER_CHARS
    assert skeleton + 9 * (share + constraints.PROPERTY_CHARS) <= 200 < skeleton + 9 * (share + 1 + 8)
    assert "maxLength" not in ANSWER["properties"]["why"]  # the caller's schema is left as it was


def test_a_schemas_own_bounds_are_kept():
    own = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "s": {"type": "string", "maxLength": 3}, "e": {"enum": ["a", "b"]}}}
    assert budgeted(checked_schema(own, param="p", strict=True)[0], 50)["properties"] == own["properties"]


@pytest.mark.parametrize("keyword, schema", [
    ("uniqueItems", {"type": "array", "uniqueItems": True}), ("not", {"not": {"type": "string"}}),
    ("allOf", {"allOf": [{"type": "object"}]}), ("if", {"if": {"type": "string"}, "then": {}}),
    ("contains", {"type": "array", "contains": {"type": "integer"}}),
])
def test_a_keyword_the_grammar_cannot_enforce_is_refused_or_dropped_and_listed(keyword, schema):
    wrapped = {"type": "object", "properties": {"x": schema}}
    with pytest.raises(RequestError, match=f"'{keyword}' at 'properties.x.{keyword}'"):
        checked_schema(wrapped, param="response_format", strict=True)
    kept, dropped = checked_schema(wrapped, param="tools.f.parameters", strict=False)
    assert f"properties.x.{keyword}" in dropped and keyword not in json.dumps(kept["properties"]["x"])


def test_a_schema_nested_past_the_limit_is_refused_before_any_compiler_sees_it():
    deep: dict = {"type": "object"}
    for _ in range(constraints.MAX_DEPTH):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(RequestError, match="nested more than"):
        checked_schema(deep, param="response_format", strict=True)


def test_googles_openapi_schema_reads_as_json_schema():
    sent = {"type": "OBJECT", "property_ordering": ["a"], "properties": {"any_of": {"type": "ARRAY", "max_items": 2,
                                                                                     "items": {"type": "STRING"}}}}
    fmt = constraints.google_format({"responseMimeType": "application/json", "responseSchema": sent})
    assert fmt.schema == {"type": "object", "propertyOrdering": ["a"], "properties": {
        "any_of": {"type": "array", "maxItems": 2, "items": {"type": "string"}}}}  # a property keeps its name
    assert fmt.param == "generationConfig.responseSchema"
    with pytest.raises(RequestError, match="responseMimeType"):
        constraints.google_format({"responseMimeType": "text/x.enum"})


def test_a_forced_call_needs_a_family_with_a_grammar():
    assert constraints.can_force("hermes") and constraints.can_force("qwen3_coder")
    assert not constraints.can_force("mistral") and not constraints.can_force(None)


def test_a_sessions_max_tokens_cap_sizes_the_grammar(model_path, tokenizer, tmp_path):
    """A training session caps max_tokens below what the harness asks: the document must close in the cap."""
    from polar_lab import Lab
    from polar_lab.engine import ScriptedEngine

    engine = ScriptedEngine(tokenizer, ['{"value": 1}'], model_path=model_path)
    with Lab(port=0, engine=engine, runs_dir=str(tmp_path), run_name="cap") as lab:
        bodies = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}}
        lengths = []
        for sampling in ({}, {"max_tokens": 60}):
            s = lab.session(sampling=sampling)
            r = httpx.post(f"{s.openai_base_url}/chat/completions", json=bodies,
                           headers={"Authorization": f"Bearer {s.key}"}, timeout=30)
            assert r.status_code == 200
            tag = json.loads(engine.specs[-1].structure)["format"]["json_schema"]
            lengths.append(tag["properties"]["why"]["maxLength"])
        assert lengths[1] < 60 < lengths[0]


def test_an_output_format_names_the_providers_field():
    assert constraints.openai_format({"type": "json_object"}, param="text.format").param == "text.format"
    assert constraints.anthropic_format({"format": {"type": "json_schema", "schema": {}}}).param == \
        "output_config.format"
    with pytest.raises(RequestError, match="uniqueItems"):
        constraints.output_structure(OutputFormat("json_schema", {"type": "array", "uniqueItems": True}, param="x"),
                                     max_tokens=10)


@pytest.mark.parametrize("schema", [
    {"type": "string", "format": {}}, {"type": "array", "maxItems": "3"}, {"type": "array", "maxItems": 2.5},
    {"type": "array", "maxItems": None}, {"type": "object", "properties": [1]}, {"type": "string", "maxLength": -1},
    {"type": "integer", "minimum": "0"}, {"type": "object", "required": "a"}, {"type": 5},
])
def test_malformed_keyword_values_are_a_400_not_a_crash(schema):
    with pytest.raises(RequestError):
        budgeted(checked_schema({"type": "object", "properties": {"x": schema}}, param="p", strict=True)[0], 100)


def test_sizing_nested_arrays_costs_the_schema_not_its_multiplicity():
    """A million items of a million items once made a list of 10^12 entries (a MemoryError, a 500)."""
    huge = {"type": "array", "maxItems": 10**6, "items": {"type": "array", "maxItems": 10**6,
                                                          "items": {"type": "string"}}}
    schema = budgeted(checked_schema(huge, param="p", strict=True)[0], 500)
    assert schema["items"]["items"]["maxLength"] == 1  # no room: the smallest bound, the document still valid


def test_googles_nullable_and_openapi_formats_read_as_json_schema():
    fmt = constraints.google_format({"responseMimeType": "application/json", "responseSchema": {
        "type": "OBJECT", "properties": {"n": {"type": "INTEGER", "format": "int64", "nullable": True}}}})
    assert fmt.schema["properties"]["n"] == {"type": ["integer", "null"]}
    checked_schema(fmt.schema, param="p", strict=True)  # no 400 for Gemini's own keywords


def test_tools_without_a_name_are_a_400_in_the_callers_shape(model_path, tokenizer, tmp_path):
    from polar_lab import Lab
    from polar_lab.engine import ScriptedEngine

    engine = ScriptedEngine(tokenizer, ["ok"], model_path=model_path)
    with Lab(port=0, engine=engine, runs_dir=str(tmp_path), run_name="names") as lab:
        s = lab.session()
        google = {"contents": [{"parts": [{"text": "hi"}]}], "tools": [{"functionDeclarations": [{"description": "d"}]}],
                  "toolConfig": {"functionCallingConfig": {"mode": "ANY"}}}
        r = httpx.post(f"{s.base_url}/s/{s.key}/v1beta/models/m:generateContent", json=google, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["status"] == "INVALID_ARGUMENT"
        responses = {"input": "hi", "tools": [{"type": "function", "name": 5}], "tool_choice": "required"}
        r = httpx.post(f"{s.base_url}/s/{s.key}/v1/responses", json=responses, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_chat_json_schema_without_its_json_schema_object_is_a_400_as_openai_answers():
    with pytest.raises(RequestError, match="json_schema"):
        constraints.openai_format({"type": "json_schema"}, param="response_format")
    assert constraints.openai_format({"type": "json_schema", "name": "a", "schema": {"type": "object"}},
                                     param="text.format").schema == {"type": "object"}
