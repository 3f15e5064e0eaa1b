"""Reading tool calls and reasoning out of generated text (Hermes/Qwen format), without re-serialising.

The model writes `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`. We return the arguments
as the exact substring the model produced whenever the block has the template's shape, because a harness
echoes them back and the chat template re-renders them verbatim: same text, same token ids.
"""

from __future__ import annotations

import json
import re
import uuid

from polar_lab.proxy.canonical import ParsedOutput

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# The block shape the chat template renders; anything else is parsed as JSON and re-serialised.
_TEMPLATE_SHAPE = re.compile(r'^\{"name": "(?P<name>[^"\\]*)", "arguments": (?P<args>.*)\}$', re.DOTALL)


def parse_output(text: str, *, parse_tools: bool = True) -> ParsedOutput:
    r"""Split generated text into reasoning, content and tool calls.

    Content is everything before the first tool call that parses (less the one "\n" the template puts
    there), so botched blocks before it stay in the content and the message re-renders to the same text.

    >>> p = parse_output('<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>')
    >>> p.content, p.tool_calls[0]["name"], p.tool_calls[0]["arguments"]
    (None, 'calc', '{"x": 1}')
    """
    reasoning, text = _split_reasoning(text)
    if not parse_tools or TOOL_OPEN not in text:
        return ParsedOutput(content=text or None, reasoning=reasoning)
    calls, errors, first_start = [], [], None
    starts = [m.start() for m in re.finditer(re.escape(TOOL_OPEN), text)]
    for start, end in zip(starts, starts[1:] + [len(text)]):
        body, closed, trailing = text[start + len(TOOL_OPEN):end].partition(TOOL_CLOSE)
        call, error = _parse_block(body.strip(), closed=bool(closed))
        if call is None:
            errors.append(error)
            continue
        calls.append(call)
        first_start = start if first_start is None else first_start
        if trailing.strip() and end == len(text):
            errors.append(f"text after a tool call was dropped: {trailing.strip()[:80]!r}")
    if not calls:
        # Nothing usable: hand back exactly what the model wrote, so a harness that echoes it re-renders
        # the same text (and the same token ids) instead of an empty turn.
        return ParsedOutput(content=text, reasoning=reasoning, errors=errors)
    head = text[:first_start]
    content = head[:-1] if head.endswith("\n") else head  # the template puts one "\n" before a call
    return ParsedOutput(content=content or None, reasoning=reasoning, tool_calls=calls, errors=errors)


def _split_reasoning(text: str) -> tuple[str | None, str]:
    if not text.lstrip().startswith(THINK_OPEN) or THINK_CLOSE not in text:
        return None, text
    inner, _, after = text.lstrip()[len(THINK_OPEN):].partition(THINK_CLOSE)
    return inner.strip("\n"), after.lstrip("\n")


def _parse_block(body: str, *, closed: bool) -> tuple[dict | None, str]:
    """One `<tool_call>` block → {"id", "name", "arguments"} or an error message."""
    if not closed:
        return None, f"unterminated tool call: {body[:80]!r}"
    match = _TEMPLATE_SHAPE.match(body)
    if match is not None and _is_json_object(match["args"]):
        return _call(match["name"], match["args"]), ""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"tool call is not JSON ({exc.msg}): {body[:80]!r}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, f"tool call lacks a string 'name': {body[:80]!r}"
    args = obj.get("arguments", {})
    if isinstance(args, str):
        if not _is_json_object(args):
            return None, f"tool call arguments are not a JSON object: {args[:80]!r}"
        return _call(obj["name"], args), ""
    if not isinstance(args, dict):
        return None, f"tool call arguments are not a JSON object: {body[:80]!r}"
    return _call(obj["name"], json.dumps(args, ensure_ascii=False)), ""


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _call(name: str, arguments: str) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "name": name, "arguments": arguments}
