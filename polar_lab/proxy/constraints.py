"""Constrained decoding: structured outputs and forced tool calls, as the grammars vLLM enforces while sampling.

Both become one xgrammar *structural tag* (JSON text), which vLLM's structured outputs take as
`StructuredOutputsParams(structural_tag=...)` (engine/worker.py) and compile against the tokenizer:

- a structured output (Chat `response_format`, Responses `text.format`, Anthropic `output_config.format`,
  Google `responseSchema`) is the JSON schema itself, or any JSON object for JSON mode;
- a forced tool call (a named tool, `required`/`any`, Google's allowed names) is the model family's own call
  format with each allowed tool's parameter schema inside, built by xgrammar's `get_model_structural_tag`
  for the families it knows (Hermes/Qwen3 JSON calls, Qwen3.5 XML calls, Llama 3 JSON calls). Mistral's
  format has no builtin there: its forced calls keep the prefill alone (`Renderer.forced_prefill`), and say so.

Two changes to the grammar make "the output ends as a valid document" hold on small models as well as large:
whitespace between JSON tokens is limited to one character (a small model otherwise pads with newlines until
`max_tokens`; measured on tiny-calc: 5 of 10 schema outputs never closed), and a JSON number without bounds
gets the bounds of an exactly representable integer, ±(2**53 - 1) (RFC 7493's I-JSON range, what every JSON
parser reads exactly), which caps its digits (unbounded, 3 of 10 ran on in digits or an exponent).

A schema keyword the grammar cannot enforce is a 400 that names it (`uniqueItems` at `properties.tags`), not a
constraint silently dropped: the caller would believe it held. In tool parameter schemas the same keywords
are dropped instead, because agents send their tools' schemas as they are and a forced call should still be
a call; the dropped ones are listed in the call's record (`render["not_enforced"]`). `oneOf` is enforced as
`anyOf` (a value matching two branches is not refused), as OpenAI's strict mode documents for its own subset.

Every output token of a constrained call was sampled under the constraint (the grammar covers the whole
output), so the engine's logprobs are those of a renormalised distribution, not the policy's: the recorded
call says `sampling["constraint"]`, and trajectory builders leave such tokens out of the loss by default.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from polar_lab.errors import RequestError

# Keywords xgrammar 0.2's JSON schema converter enforces (checked one by one: an instance breaking each was
# refused by the compiled grammar), and annotations that constrain nothing.
ENFORCED = {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
            "enum", "const", "anyOf", "oneOf", "$ref", "$defs", "definitions", "minimum", "maximum",
            "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern", "format",
            "minProperties", "maxProperties", "propertyNames"}
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "strict", "propertyOrdering", "discriminator", "example"}
_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # their keys are names, their values schemas
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames")
_DATA = ("enum", "const", "default", "examples", "example")  # values, not schemas
FORMATS = {"email", "date-time", "date", "time", "uuid", "uri", "ipv4", "ipv6", "hostname", "duration"}

NUMBER_BOUND = 2**53 - 1  # unbounded numbers get [-NUMBER_BOUND, NUMBER_BOUND]
MAX_DEPTH = 32  # nesting of a schema (and of any value in it); deeper is a 400 before any compiler sees it
JSON_MODE_SHARE = 0.125  # JSON mode: a string may take this share of max_tokens, in characters
CALL_CHARS = 40  # characters of a call's wrapper besides its name and arguments (`<tool_call>\n{"name": ...}`)
ARRAY_BOUND = 8  # items of an array whose schema sets no maxItems (budgeted)
PROPERTY_CHARS = 8  # characters a property takes besides its name and value: quotes, colon, comma, whitespace
NUMBER_CHARS = 20  # characters a bounded number takes at most: 16 digits, sign, point, whitespace
MAX_WHITESPACE = 1  # characters of whitespace in a row the grammar lets the model write between JSON tokens

# tool parser (formats.py) → xgrammar's builtin structural tag for that family's calls
XGRAMMAR_FAMILIES = {"hermes": "qwen_3", "qwen3_json": "qwen_3", "qwen3_coder": "qwen_3_5", "qwen3_xml": "qwen_3_5",
                     "llama3_json": "llama"}


@dataclass(frozen=True)
class OutputFormat:
    """What a request asks its text to be: `json_schema` (with the schema) or `json_object` (any JSON object)."""

    kind: str
    schema: dict[str, Any] | None = None
    name: str = ""
    param: str = "response_format"  # the request field that asked for it, as the provider names it


def output_structure(fmt: OutputFormat, *, max_tokens: int) -> str:
    """The structural tag (JSON text) that makes the whole output one JSON document of `fmt`, able to close
    within `max_tokens` (see `budgeted`)."""
    if fmt.kind == "json_object":
        schema = any_object(max_tokens)
    else:
        schema = budgeted(checked_schema(fmt.schema, param=fmt.param, strict=True)[0], max_tokens)
    tag = {"type": "structural_tag",
           "format": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}}
    return _compiles(json.dumps(tag), param=fmt.param)


def output_or_call(fmt: OutputFormat, tool_parser: str | None, tools: list[dict[str, Any]], *, parallel: bool,
                   max_tokens: int) -> str:
    """A structured output in a turn that may also call tools (tool_choice "auto"): either the JSON document, or
    text and calls in the family's format (`can_force`) — what an agent with an output type and tools needs."""
    xgrammar = _xgrammar()
    if xgrammar is None:
        raise RequestError(f"{fmt.param}: constrained sampling needs xgrammar (installed with vLLM)", param=fmt.param)
    document = json.loads(output_structure(fmt, max_tokens=max_tokens))["format"]
    calls = json.loads(tool_structure(tool_parser, tools, "required", parallel=parallel, max_tokens=max_tokens)[0])
    tag = {"type": "structural_tag", "format": {"type": "or", "elements": [document, calls["format"]]}}
    return _compiles(json.dumps(tag), param=fmt.param)


def can_force(tool_parser: str | None) -> bool:
    """Whether a grammar here can force this family's calls (else its prefill alone does)."""
    return (tool_parser or "") in XGRAMMAR_FAMILIES


def tool_structure(tool_parser: str | None, tools: list[dict[str, Any]], choice: str | dict[str, Any], *,
                   parallel: bool, max_tokens: int) -> tuple[str, list[str]]:
    """(structural tag, keywords dropped from the tools' schemas) forcing a call in the family's own format
    (`can_force`): of the named tool when `choice` is {"name": ...}, of any tool in `tools` when it is
    "required" (at most one call unless `parallel`); each tool's arguments `budgeted` to close in max_tokens."""
    xgrammar = _xgrammar()
    if xgrammar is None:
        raise RequestError("forcing a tool call needs xgrammar (installed with vLLM)", param="tool_choice")

    family = XGRAMMAR_FAMILIES[tool_parser or ""]
    dropped: list[str] = []
    bounded = []
    for tool in tools:
        function = tool["function"]
        schema, lost = checked_schema(function.get("parameters") or {"type": "object"},
                                      param=f"tools.{function['name']}.parameters", strict=False)
        schema = budgeted(schema, max_tokens - CALL_CHARS - len(function["name"]))
        dropped += [f"{function['name']}: {k}" for k in lost]
        bounded.append({"type": "function", "function": {"name": function["name"], "parameters": schema}})
    named = {"type": "function", "function": {"name": choice["name"]}} if isinstance(choice, dict) else "required"
    tag = xgrammar.get_model_structural_tag(family, tools=bounded, tool_choice=named, reasoning="disabled",
                                            parallel_tool_calls=parallel, max_whitespace_cnt=MAX_WHITESPACE)
    return _compiles(tag.model_dump_json(), param="tools"), dropped


def checked_schema(schema: Any, *, param: str, strict: bool) -> tuple[dict[str, Any], list[str]]:
    """A copy of `schema` the grammar enforces whole: numbers bounded (see the module docstring). strict: a
    keyword it cannot enforce is a RequestError naming it and where; otherwise it is dropped and listed."""
    if not isinstance(schema, dict):
        raise RequestError(f"{param} must be a JSON schema object, got {type(schema).__name__}", param=param)
    _check_depth(schema, param)
    out = copy.deepcopy(schema)
    dropped: list[str] = []
    stack: list[tuple[dict[str, Any], str]] = [(out, "")]
    while stack:
        node, where = stack.pop()
        for key in list(node):
            here = f"{where}.{key}" if where else key
            if key not in ENFORCED and key not in ANNOTATIONS:
                if strict:
                    raise RequestError(f"{param}: JSON schema keyword '{key}' at '{here}' is not supported: the "
                                       f"grammar that constrains sampling cannot enforce it", param=param)
                dropped.append(here)
                del node[key]
            elif key == "format" and (not isinstance(node[key], str) or node[key] not in FORMATS):
                if strict:
                    raise RequestError(f"{param}: string format {node[key]!r} at '{here}' is not supported "
                                       f"(supported: {', '.join(sorted(FORMATS))})", param=param)
                dropped.append(here)
                del node[key]
            elif not _well_typed(key, node[key]):
                raise RequestError(f"{param}: '{here}' must be {_SHAPES[key]}, got {node[key]!r:.60}", param=param)
        stack += [(child, path) for child, _, path in _children(node, where)]
        types = node.get("type")
        types = types if isinstance(types, list) else [types]
        if ("integer" in types or "number" in types) and "enum" not in node and "const" not in node:
            if "minimum" not in node and "exclusiveMinimum" not in node:
                node["minimum"] = -NUMBER_BOUND
            if "maximum" not in node and "exclusiveMaximum" not in node:
                node["maximum"] = NUMBER_BOUND
    return out, dropped


_SIZES = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_SHAPES = {**{k: "a non-negative integer" for k in _SIZES}, **{k: "a number" for k in _BOUNDS},
           "properties": "an object", "$defs": "an object", "definitions": "an object", "required": "a list of names",
           "anyOf": "a list of schemas", "oneOf": "a list of schemas", "prefixItems": "a list of schemas",
           "pattern": "a string", "type": "a type name or a list of them", "enum": "a list"}


def _well_typed(key: str, value: Any) -> bool:
    """Whether a keyword's value has the JSON Schema type the grammar (and `budgeted`) will read it as."""
    if key in _SIZES:
        return type(value) is int and value >= 0
    if key in _BOUNDS:
        return type(value) in (int, float) and value == value and abs(value) != float("inf")
    if key in ("properties", "$defs", "definitions"):
        return isinstance(value, dict)
    if key in ("required", "anyOf", "oneOf", "prefixItems", "enum"):
        return isinstance(value, list) and (key != "required" or all(isinstance(v, str) for v in value))
    if key == "pattern":
        return isinstance(value, str)
    if key == "type":
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    return True


def any_object(max_tokens: int) -> dict[str, Any]:
    """JSON mode's schema: any JSON object, with every string at most JSON_MODE_SHARE of the budget in characters
    and numbers bounded (see `budgeted`); nesting and sizes are free, so a document can still run out of
    tokens, and then ends with finish_reason "length", as OpenAI's does."""
    bound = {"minimum": -NUMBER_BOUND, "maximum": NUMBER_BOUND}
    value = {"anyOf": [{"type": "string", "maxLength": max(8, int(max_tokens * JSON_MODE_SHARE))},
                       {"type": "integer", **bound}, {"type": "number", **bound}, {"type": "boolean"},
                       {"type": "null"}, {"type": "array", "items": {"$ref": "#/$defs/value"}},
                       {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}}]}
    return {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}, "$defs": {"value": value}}


def budgeted(schema: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """`schema` (a checked copy, changed in place) with a maximum on every string and array that has none, so
    that a document of it can close within `max_tokens`: arrays get ARRAY_BOUND items at most, and what the
    budget leaves after the document's skeleton is shared out among the strings. Counted in characters, which
    bound tokens from above (a token holds at least one): each property's name and punctuation with the
    whitespace allowed around it, NUMBER_CHARS per number. (An escape such as \\u00e9 is one character of the
    string and six of the text: a string of escapes can still run out, and the answer then ends with
    finish_reason "length", as OpenAI's does.) Measured on tiny-calc, 4 of 10 `{value: int, explanation:
    str}` answers closed within 100 tokens without these bounds. The bounds are large when the budget is
    (1,000 tokens: ~950 characters for one string); a schema's own maxima are kept. `$ref`'d definitions
    count once; how many times a node can occur is capped at the budget (past it no string fits anyway)."""
    strings: dict[int, tuple[dict[str, Any], int]] = {}  # id(node) → (node, times it can occur)
    chars = 2
    stack: list[tuple[dict[str, Any], int]] = [(schema, 1)]
    while stack:
        node, times = stack.pop()
        times = min(times, max_tokens + 1)
        types = node.get("type")
        types = types if isinstance(types, list) else [types]
        if "array" in types and "maxItems" not in node:
            node["maxItems"] = ARRAY_BOUND
        inner = times * (node.get("maxItems", ARRAY_BOUND) if "array" in types else 1)
        chars += times * sum(len(name) + PROPERTY_CHARS for name in node.get("properties") or {})
        if "integer" in types or "number" in types:
            chars += times * NUMBER_CHARS
        if "string" in types and not {"maxLength", "enum", "const", "format", "pattern"} & node.keys():
            strings[id(node)] = (node, strings.get(id(node), (node, 0))[1] + times)
            chars += times * PROPERTY_CHARS  # its quotes and whitespace
        stack += [(child, inner if key in ("items", "prefixItems") else times) for child, key, _ in _children(node, "")]
    if strings:
        share = max(1, (max_tokens - chars) // sum(times for _, times in strings.values()))
        for node, _ in strings.values():
            node["maxLength"] = share
    return schema


def _children(node: dict[str, Any], where: str) -> list[tuple[dict[str, Any], str, str]]:
    """The sub-schemas of one schema node: (sub-schema, the keyword holding it, its path)."""
    out = []
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out += [(v, key, f"{where}.{key}.{k}".lstrip(".")) for k, v in node[key].items() if isinstance(v, dict)]
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out += [(v, key, f"{where}.{key}[{i}]".lstrip(".")) for i, v in enumerate(node[key])
                    if isinstance(v, dict)]
    for key in _SCHEMA_VALUES:
        if isinstance(node.get(key), dict):
            out.append((node[key], key, f"{where}.{key}".lstrip(".")))
    return out


def _check_depth(value: Any, param: str) -> None:
    """Refuse a value nested deeper than MAX_DEPTH (the grammar compilers recurse over it)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise RequestError(f"{param} is nested more than {MAX_DEPTH} levels deep", param=param)
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack += [(child, depth + 1) for child in children if isinstance(child, (dict, list))]


def _xgrammar():
    """xgrammar (a dependency of vLLM; imported late: it loads native code), or None where it is not installed."""
    try:
        import xgrammar
    except ImportError:
        return None
    return xgrammar


_COMPILED: OrderedDict[str, str | None] = OrderedDict()  # digest of a tag → None (compiles) or the error


def _compiles(tag: str, *, param: str) -> str:
    """`tag` when xgrammar compiles it (cached by digest); else a RequestError with xgrammar's reason. vLLM checks
    again when the engine adds the request; this check gives the error in the caller's terms, before a
    stream has begun."""
    import xgrammar

    if xgrammar is None:
        raise RequestError(f"{param}: constrained sampling needs xgrammar (installed with vLLM)", param=param)
    digest = hashlib.blake2b(tag.encode(), digest_size=16).hexdigest()
    if digest not in _COMPILED:
        try:
            xgrammar.Grammar.from_structural_tag(tag)
            _COMPILED[digest] = None
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own types
            _COMPILED[digest] = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:300]
        while len(_COMPILED) > 1024:
            _COMPILED.popitem(last=False)
    error = _COMPILED[digest]
    if error is not None:
        raise RequestError(f"{param}: the schema cannot be compiled into a grammar: {error}", param=param)
    return tag


# ---- each API's way of asking for a structured output --------------------------------------------------------

def openai_format(value: Any, *, param: str) -> OutputFormat | None:
    """Chat's `response_format` ({"type": "json_schema", "json_schema": {"name", "schema", "strict"}}) or the
    Responses API's `text.format` (the same fields, not nested); `text` and None ask for nothing."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat("json_object", param=param)
    if kind == "json_schema":
        spec = value.get("json_schema") if param == "response_format" else value  # Chat nests it, Responses not
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise RequestError(f"{param}.json_schema must be an object with a 'schema' object", param=param)
        return OutputFormat("json_schema", spec.get("schema") or {"type": "object"}, str(spec.get("name", "")),
                            param=param)
    raise RequestError(f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", param=param)


def anthropic_format(output_config: Any, output_format: Any = None) -> OutputFormat | None:
    """Anthropic's `output_config.format` ({"type": "json_schema", "schema"}), or the beta's `output_format`."""
    if output_format is not None:
        value, param = output_format, "output_format"
    else:
        value, param = (output_config or {}).get("format"), "output_config.format"
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "json_schema" or not isinstance(value.get("schema"), dict):
        raise RequestError(f"{param} must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}", param=param)
    return OutputFormat("json_schema", value["schema"], param=param)


def google_format(config: dict[str, Any]) -> OutputFormat | None:
    """Google's `responseMimeType: "application/json"` with `responseJsonSchema` (JSON Schema) or `responseSchema`
    (OpenAPI's subset: upper-case types), or neither (any JSON object); "text/plain" or none: no constraint."""
    mime = config.get("responseMimeType") or config.get("response_mime_type") or "text/plain"
    json_schema = config.get("responseJsonSchema", config.get("response_json_schema"))
    schema = config.get("responseSchema", config.get("response_schema"))
    if mime == "text/plain":
        if json_schema is not None or schema is not None:
            raise RequestError("a response schema needs responseMimeType 'application/json'",
                               param="generationConfig.responseMimeType")
        return None
    if mime != "application/json":
        raise RequestError(f"responseMimeType {mime!r} is not supported (text/plain, application/json)",
                           param="generationConfig.responseMimeType")
    if json_schema is not None:
        return OutputFormat("json_schema", json_schema, param="generationConfig.responseJsonSchema")
    if schema is not None:
        return OutputFormat("json_schema", from_openapi(schema, param="generationConfig.responseSchema"),
                            param="generationConfig.responseSchema")
    return OutputFormat("json_object", param="generationConfig.responseMimeType")


def from_openapi(schema: Any, *, param: str) -> Any:
    """Google's OpenAPI-style schema as JSON Schema: its upper-case type names lowered, its keywords in camelCase
    (google-genai sends protobuf's names: `any_of`, `property_ordering`), the rest as it is."""
    _check_depth(schema, param)
    return _from_openapi(schema)


OPENAPI_FORMATS = {"enum", "int32", "int64", "float", "double", "byte", "binary", "password"}  # not JSON Schema's


def _from_openapi(schema: Any) -> Any:
    """One node: `nullable: true` becomes a "null" type (xgrammar does not read `nullable`), OpenAPI's own
    `format`s (int32, double, enum...) are left out (the type already says it), keywords camelCased."""
    if isinstance(schema, list):
        return [_from_openapi(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    schema = dict(schema)
    nullable = schema.pop("nullable", None)
    if isinstance(schema.get("format"), str) and schema["format"] in OPENAPI_FORMATS:
        del schema["format"]
    out = {}
    for key, value in schema.items():
        key = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), key)
        if key == "type" and isinstance(value, str):
            out[key] = value.lower()
        elif key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {k: _from_openapi(v) for k, v in value.items()}
        elif key in ("items", "anyOf", "oneOf", "prefixItems", "additionalProperties"):
            out[key] = _from_openapi(value)
        else:
            out[key] = value
    if nullable is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    elif nullable is True and "anyOf" in out:
        out["anyOf"] = [*out["anyOf"], {"type": "null"}]
    return out
