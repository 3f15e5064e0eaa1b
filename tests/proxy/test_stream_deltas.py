"""Streaming deltas (proxy/stream_deltas.py): fed a generation cut at arbitrary points, a Splitter sends reasoning and
content as they come and tool calls whole, and what it sent adds up to the final parse — the record's reading —
for every cut. A botched call is never sent as a call."""

import random

import pytest

from polar_lab.proxy.stream_deltas import Splitter
from polar_lab.proxy.parse import OutputParser, parse_output

CALL = '<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>'
BOTCHED = '<tool_call>\n{"name": calc}\n</tool_call>'
XML = "<tool_call>\n<function=calculator>\n<parameter=expression>\n12*7+5\n</parameter>\n</function>\n</tool_call>"

HERMES = [  # generations of the Hermes family (tiny-calc), each a case for every cut
    "plain answer",
    "<think>\nweighing it\n</think>\n\nthe answer",
    "let me compute\n" + CALL,
    "two calls\n\n" + CALL + "\n" + CALL,
    "first botched\n" + BOTCHED + "\n" + CALL,  # content up to the call that parses, botched block included
    BOTCHED,  # nothing parses: all of it is content, never a call
    "text\n" + BOTCHED + " and more text",
    CALL + " trailing words",  # dropped after a call, as the parser drops them
    "<think>a</think>" + CALL,
    "  \n<think>x</think>y\n",
    "ends in newlines\n\n",
    "\n\nleading newlines",
    'unterminated <tool_call>\n{"name": "c", "arguments": {}}',
    "a\n" + CALL + "junk" + CALL,
    BOTCHED + "\nmid\n" + CALL,
]


def stream(splitter: Splitter, text: str, rng: random.Random, parsed) -> tuple[str, str, list, list]:
    deltas = []
    at = 0
    while at < len(text):
        cut = rng.randint(1, 6)
        deltas += splitter.feed(text[at:at + cut])
        at += cut
    sent_calls = [d.call for d in deltas if d.kind == "call"]
    deltas += splitter.finish(parsed)
    order = [d.kind for d in deltas]
    assert order == sorted(order, key=["reasoning", "content", "call"].index), order  # blocks in the response's order
    return ("".join(d.text for d in deltas if d.kind == "reasoning"), "".join(d.text for d in deltas if d.kind == "content"),
            [d.call for d in deltas if d.kind == "call"], sent_calls)


def hermes_splitter() -> Splitter:
    return Splitter(thinking=("<think>", "</think>"), in_thought=False, tool_open="<tool_call>",
                    tool_close="</tool_call>", own=True)


@pytest.mark.parametrize("text", HERMES)
def test_what_a_hermes_stream_sends_adds_up_to_the_record_at_every_cut(text):
    rng = random.Random(text)
    for _ in range(40):
        parsed = parse_output(text)
        splitter = hermes_splitter()
        reasoning, content, calls, sent_early = stream(splitter, text, rng, parsed)
        assert (reasoning, content) == (parsed.reasoning or "", parsed.content or "")
        assert calls == parsed.tool_calls  # same ids too: the response and the record carry the streamed ones
        assert all(c in parsed.tool_calls for c in sent_early) and splitter.diverged == []


def test_a_call_is_sent_as_soon_as_its_block_closes_and_text_as_it_comes():
    splitter = hermes_splitter()
    assert [d.text for d in splitter.feed("Let me")] == ["Let me"]
    assert [d.text for d in splitter.feed(" compute\n<tool_")] == [" compute"]  # a marker's start waits
    (call,) = splitter.feed('call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>')
    assert call.kind == "call" and call.call["arguments"] == '{"x": 1}'
    assert splitter.sent["content"] == "Let me compute"  # the newline before the call was held back, then dropped


def test_a_thought_cut_off_by_max_tokens_is_recorded_as_text_and_the_stream_says_it_diverged():
    """The one known disagreement: the Hermes reader reads an unclosed thought as text; the stream sent it as
    reasoning before it could know. The record keeps what happened (render["stream_diverged"])."""
    text = "<think>\nstill thinking"
    splitter = hermes_splitter()
    stream(splitter, text, random.Random(0), parse_output(text))
    assert splitter.diverged and splitter.diverged[0].startswith("reasoning")


@pytest.fixture(scope="module")
def xml_parser(tokenizer):
    return OutputParser(tokenizer, "qwen3_coder", "qwen3")


@pytest.mark.parametrize("text", [
    "weighing it\n</think>\n\nthe answer",
    "weighing it\n</think>\n\n" + XML,
    "hm\n</think>\n\nlet me call\n" + XML + "\n" + XML,
    "no end of thought",
])
def test_vllm_families_stream_thought_and_text_and_send_calls_from_the_final_parse(xml_parser, text):
    """Qwen3.5: the prompt opened the thought; vLLM's parsers read the calls at the end, whole."""
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    parsed = xml_parser.parse(text, tools=tools, in_thought=True)
    for seed in range(10):
        splitter = Splitter(thinking=("<think>", "</think>"), in_thought=True, tool_open="<tool_call>",
                            tool_close="</tool_call>", own=False)
        reasoning, content, calls, sent_early = stream(splitter, text, random.Random(seed), parsed)
        assert (reasoning, content, calls) == (parsed.reasoning or "", parsed.content or "", parsed.tool_calls)
        assert sent_early == [] and splitter.diverged == []
