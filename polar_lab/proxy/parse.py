"""Reading tool calls and reasoning out of generated text, with the parsers of the model's family.

`OutputParser` is the one entry point. For Hermes tool calls and `<think>` thoughts (tiny-calc, Qwen3 and
Qwen2.5 and their Hermes-format peers) it uses polar_lab's own reader below, because vLLM's lacks two things
the chain needs:
- the arguments as the model wrote them: vLLM's `hermes` parser re-serialises them (`json.dumps`), so a
  harness that echoes the call back re-renders other text, and other token ids, than were sampled whenever
  the model's JSON was not in json.dumps' own spacing;
- an answer without a thought: vLLM's `qwen3` reasoning parser reads output with no `</think>` as all
  thought, right when the prompt opened the thought, wrong when the model simply did not think.
Every other family (`qwen3_coder` XML calls, `mistral`, `llama3_json`, any name vLLM registers) is read by
vLLM's own parsers (`vllm.parser.ParserManager`, as `vllm serve` does).

The own reader: the model writes `<tool_call>\n{"name": N, "arguments": {...}}\n</tool_call>`. We return the
arguments as the exact substring the model produced whenever the block has the template's shape, because a
harness echoes them back and the chat template re-renders them verbatim: same text, same token ids.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from typing import Any

from polar_lab.proxy.canonical import ParsedOutput
from polar_lab.proxy.formats import FORMATS, OWN, THINKING, reads_own

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
    for start, body, closed, trailing, last in _blocks(text):
        call, error = _parse_block(body.strip(), closed=closed)
        if call is None:
            errors.append(error)
            continue
        calls.append(call)
        first_start = start if first_start is None else first_start
        if trailing.strip() and last:
            errors.append(f"text after a tool call was dropped: {trailing.strip()[:80]!r}")
    if not calls:
        # Nothing usable: hand back exactly what the model wrote, so a harness that echoes it re-renders
        # the same text (and the same token ids) instead of an empty turn.
        return ParsedOutput(content=text, reasoning=reasoning, errors=errors)
    head = text[:first_start]
    content = head[:-1] if head.endswith("\n") else head  # the template puts one "\n" before a call
    return ParsedOutput(content=content or None, reasoning=reasoning, tool_calls=calls, errors=errors)


def _blocks(text: str) -> list[tuple[int, str, bool, str, bool]]:
    r"""(start, body, closed, text after the close, last) of each `<tool_call>` block. A block whose body is one
    JSON object followed by the close marker ends there, even when a string inside it holds a marker (a model
    may write "<tool_call>" into an argument; the grammar of a forced call allows it); any other block ends at
    the first close marker, or at the next opening.

    >>> [b[1] for b in _blocks('<tool_call>\n{"name": "f", "arguments": {"s": "</tool_call>"}}\n</tool_call>')]
    ['\n{"name": "f", "arguments": {"s": "</tool_call>"}}\n']
    """
    out = []
    at = text.find(TOOL_OPEN)
    while at != -1:
        inner = at + len(TOOL_OPEN)
        end = _json_block_end(text, inner)
        if end is not None:
            following = text.find(TOOL_OPEN, end)
            body, closed = text[inner:end - len(TOOL_CLOSE)], True
            trailing = text[end:following if following != -1 else len(text)]
        else:
            following = text.find(TOOL_OPEN, inner)
            body, close, trailing = text[inner:following if following != -1 else len(text)].partition(TOOL_CLOSE)
            closed = bool(close)
        out.append((at, body, closed, trailing, following == -1))
        at = following
    return out


_DECODER = json.JSONDecoder()


def _json_block_end(text: str, at: int) -> int | None:
    """The end of the close marker after one JSON object starting (after whitespace) at `at`; None if none."""
    i = len(text) - len(text[at:].lstrip())
    if not text.startswith("{", i):
        return None
    try:
        _, j = _DECODER.raw_decode(text, i)
    except ValueError:
        return None
    k = len(text) - len(text[j:].lstrip())
    return k + len(TOOL_CLOSE) if text.startswith(TOOL_CLOSE, k) else None


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


class OutputParser:
    """Reads one generation into content, reasoning and tool calls with the family's parsers (see above).

    tool_parser / reasoning_parser: vLLM names, or None for none of that kind (formats.resolve_parsers).
    """

    def __init__(self, tokenizer, tool_parser: str | None = OWN, reasoning_parser: str | None = "qwen3"):
        self.tokenizer = tokenizer
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self.own = reads_own(tool_parser, reasoning_parser)
        self.thinking = THINKING.get(reasoning_parser or "")
        self._single_tokens: dict[str, int | None] = {}  # a thought's closing marker → its one token id, if it is one
        if not self.own:
            self._vllm_class(tool_parser, reasoning_parser)  # import vLLM's parsers now, not on the first call

    def opens_thought(self, prompt: str, end: int | None = None) -> bool:
        """Whether `prompt[:end]` ends inside a thought its template opened (the output then starts as
        reasoning). Searched in place: prompts are long, and this runs on every call."""
        return self.thinking is not None and \
            prompt.rfind(self.thinking[0], 0, end) > prompt.rfind(self.thinking[1], 0, end)

    def thought_tokens(self, output_ids: list[int], parsed: ParsedOutput, prefill: str = "") -> int:
        """How many of the output's tokens are its thought, up to and including the token that closes it (all of
        them when the thought never closed): what the APIs report as reasoning / thinking / thoughts tokens. 0 when
        there was no thought, the prefill closed it (a forced call after an empty thought), or the family's thoughts
        have no closing marker this reader knows (gpt-oss channels: not counted rather than miscounted)."""
        close = self.thinking[1] if self.thinking else (THINK_CLOSE if self.own else None)
        if parsed.reasoning is None or close is None or close in prefill:
            return 0
        if close not in self._single_tokens:  # the marker as one token id, when the vocabulary has it
            token = self.tokenizer.convert_tokens_to_ids(close)
            one = isinstance(token, int) and self.tokenizer.decode([token], skip_special_tokens=False) == close
            self._single_tokens[close] = token if one else None
        token = self._single_tokens[close]
        if token is not None:
            return output_ids.index(token) + 1 if token in output_ids else len(output_ids)
        text = ""
        for i, piece in enumerate(self.tokenizer.batch_decode([[t] for t in output_ids], skip_special_tokens=False)):
            text += piece
            if close in text[-len(close) - len(piece):]:
                return i + 1
        return len(output_ids)

    def parse(self, text: str, *, tools: list[dict[str, Any]] | None = None, parse_tools: bool = True,
              in_thought: bool = False) -> ParsedOutput:
        """in_thought: the prompt ended inside an open thought (the template opened it), so the output starts
        as reasoning."""
        if self.own:  # tool_parser None ("none"): no calls are read, as for the other families
            return parse_output(text, parse_tools=parse_tools and self.tool_parser is not None)
        thinks = self.thinking is not None and (in_thought or text.lstrip().startswith(self.thinking[0]))
        tool = self.tool_parser if parse_tools and tools else None
        try:
            reasoning, content, calls = self._vllm_parse(text, tool, self.reasoning_parser if thinks else None, tools)
        except Exception as exc:  # noqa: BLE001 - a parser bug is a parse error on this call, never a 500
            return ParsedOutput(content=text, errors=[f"{self.tool_parser} parser failed: {exc!r}"[:300]])
        errors = [f"unterminated thought: no {self.thinking[1]}"] if thinks and self.thinking[1] not in text else []
        fmt = FORMATS.get(tool or "")
        if fmt is not None:
            body = text.split(self.thinking[1], 1)[-1] if thinks else text  # what follows the thought
            closed = body.count(fmt.close) if fmt.close else len(calls or [])
            if fmt.close and body.count(fmt.open) > closed:  # vLLM reads a cut-off call as a whole one
                errors.append(f"unterminated tool call: {body[body.rindex(fmt.open):][:80]!r}")
                calls = (calls or [])[:closed]
                if not calls:  # nothing usable: hand back what the model wrote, as the own reader does
                    content = body
            if fmt.open in (content or "") and not any(e.startswith("unterminated tool") for e in errors):
                errors.append(f"a tool call the {tool} parser could not read: {content[content.index(fmt.open):][:80]!r}")
        return ParsedOutput(content=content.lstrip("\n") or None if content else None,
                            reasoning=reasoning.strip("\n") if reasoning is not None else None,
                            tool_calls=[_call(c.name, c.arguments) for c in calls or []], errors=errors)

    def _vllm_parse(self, text: str, tool: str | None, reasoning: str | None, tools):
        """(thought, content, calls): the thought first, then calls in what follows it — as vLLM's server does. One
        combined parser would read call markup inside the thought as a call."""
        thought, content = (self._vllm_call(text, None, reasoning, None)[:2] if reasoning else (None, text))
        if reasoning and thought is None and self.thinking[1] in text:
            # vLLM's qwen3 reads call markup before `</think>` as "no thought"; the prompt opened it, so it is one
            thought, _, content = text.partition(self.thinking[1])
            thought = thought.removeprefix(self.thinking[0])
        if tool is None or not content:
            return thought, content, []
        _, content, calls = self._vllm_call(content, tool, None, tools)
        return thought, content, calls

    def _vllm_call(self, text: str, tool: str | None, reasoning: str | None, tools):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(messages=[{"role": "user", "content": ""}], model="polar_lab",
                                        tools=tools if tool else None, tool_choice="auto" if tool else "none")
        cls = self._vllm_class(tool, reasoning)
        if cls is None:  # neither kind asked for: the text is the content
            return None, text, []
        parser = cls(self.tokenizer, request.tools)  # one per call: vLLM's keep state between calls
        return parser.parse(text, request, enable_auto_tools=tool is not None)

    @functools.lru_cache(maxsize=8)  # noqa: B019 - one parser per Lab, a handful of (tool, reasoning) pairs
    def _vllm_class(self, tool: str | None, reasoning: str | None):
        from vllm.parser import ParserManager

        return ParserManager.get_parser(tool_parser_name=tool, reasoning_parser_name=reasoning,
                                        enable_auto_tools=tool is not None, tokenizer=self.tokenizer)
