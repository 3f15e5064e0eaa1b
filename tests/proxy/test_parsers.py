"""The model family's parsers (issue 16, part 1): chosen from the chat template or by vLLM name, vLLM's own for
every family but Hermes, and what the proxy needs besides parsing (forcing and forbidding a call) per format.
The tiny-calc tokenizer serves: vLLM's Qwen3 XML and reasoning parsers need only its vocabulary."""

import json

import anthropic
import openai
import pytest

from polar_lab import Lab
from polar_lab.engine import ScriptedEngine
from polar_lab.errors import ConfigError
from polar_lab.harness.calculator import CALC_TOOL
from polar_lab.proxy.formats import detect_parsers, resolve_parsers
from polar_lab.proxy.parse import OutputParser

XML = "<tool_call>\n<function=calculator>\n<parameter=expression>\n12*7+5\n</parameter>\n</function>\n</tool_call>"
ARGS = '{"expression": "12*7+5"}'


def test_tiny_calc_is_detected_as_hermes_with_qwen3_thinking(tokenizer):
    assert detect_parsers(tokenizer.chat_template) == ("hermes", "qwen3")


def test_parser_names_are_vllms_and_an_unknown_one_is_a_config_error_that_lists_them(tokenizer):
    template = tokenizer.chat_template
    assert resolve_parsers("auto", "auto", template) == ("hermes", "qwen3")
    assert resolve_parsers("none", "none", template) == (None, None)
    assert resolve_parsers("qwen3_coder", "deepseek_r1", template) == ("qwen3_coder", "deepseek_r1")
    with pytest.raises(ConfigError, match=r"unknown tool_parser 'qwen9'.*hermes.*qwen3_coder"):
        resolve_parsers("qwen9", "auto", template)
    with pytest.raises(ConfigError, match=r"unknown reasoning_parser 'think'.*deepseek_r1"):
        resolve_parsers("hermes", "think", template)


@pytest.fixture(scope="module")
def xml_parser(tokenizer):
    return OutputParser(tokenizer, "qwen3_coder", "qwen3")


CASES = [  # (text, in_thought, content, reasoning, calls, errors)
    (XML, False, None, None, [("calculator", ARGS)], 0),
    ("<think>\nplan\n</think>\n\n" + XML, False, None, "plan", [("calculator", ARGS)], 0),
    ("plan\n</think>\n\nLet me.\n" + XML, True, "Let me.", "plan", [("calculator", ARGS)], 0),  # template opened it
    ("The answer is 4.", False, "The answer is 4.", None, [], 0),  # no thought: not read as one
    ("The answer is 4.", True, None, "The answer is 4.", [], 1),  # inside an opened thought that never closed
    # a call cut off: vLLM's parser would hand back an empty call; the text comes back, the error is recorded
    ("<tool_call>\n<function=calculator>\n<parameter=expr", False, "<tool_call>\n<function=calculator>\n<parameter=expr",
     None, [], 1),
    (XML + "\n" + XML.replace("12*7+5", "1+1"), False, None, None,
     [("calculator", ARGS), ("calculator", '{"expression": "1+1"}')], 0),
    # call markup inside the opened thought is thought: vLLM's parsers, combined, read a call with empty arguments
    ("<tool_call>\n<function=calculator>\n</think>\n\nIt is -8.", True, "It is -8.",
     "<tool_call>\n<function=calculator>", [], 0),
]


@pytest.mark.parametrize("text, in_thought, content, reasoning, calls, errors", CASES)
def test_qwen3_xml_calls_and_thoughts_through_vllms_parsers(xml_parser, text, in_thought, content, reasoning, calls,
                                                             errors):
    parsed = xml_parser.parse(text, tools=[CALC_TOOL], in_thought=in_thought)
    assert (parsed.content, parsed.reasoning) == (content, reasoning)
    assert [(c["name"], c["arguments"]) for c in parsed.tool_calls] == calls
    assert len(parsed.errors) == errors, parsed.errors
    assert len({c["id"] for c in parsed.tool_calls}) == len(calls)


def test_without_tool_parsing_the_call_markup_is_content(xml_parser):
    parsed = xml_parser.parse(XML, tools=[CALC_TOOL], parse_tools=False)
    assert (parsed.content, parsed.tool_calls, parsed.errors) == (XML, [], [])


@pytest.fixture
def xml_lab(model_path, tokenizer, tmp_path):
    engine = ScriptedEngine(tokenizer, [XML], model_path=model_path)
    with Lab(port=0, engine=engine, runs_dir=str(tmp_path), run_name="xml", tool_parser="qwen3_coder") as lab:
        yield lab


def test_a_lab_serves_xml_tool_calls_as_structured_calls_on_every_sdk(xml_lab):
    assert xml_lab.parsers == {"tool_parser": "qwen3_coder", "reasoning_parser": "qwen3"}
    assert xml_lab.reader.config["parsers"] == xml_lab.parsers  # the run folder says what read its calls
    session = xml_lab.session()
    chat = openai.OpenAI(base_url=session.openai_base_url, api_key=session.key, max_retries=0)
    reply = chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "12*7+5?"}],
                                         tools=[CALC_TOOL])
    (call,) = reply.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments, reply.choices[0].finish_reason) == \
        ("calculator", ARGS, "tool_calls")
    messages = anthropic.Anthropic(base_url=session.anthropic_base_url, api_key=session.key, max_retries=0)
    tool = {"name": "calculator", "description": "d", "input_schema": CALC_TOOL["function"]["parameters"]}
    message = messages.messages.create(model="m", max_tokens=64, tools=[tool],
                                       messages=[{"role": "user", "content": "12*7+5?"}])
    (block,) = [b for b in message.content if b.type == "tool_use"]
    assert (block.name, block.input, message.stop_reason) == ("calculator", {"expression": "12*7+5"}, "tool_use")


def test_a_forced_call_is_held_to_the_families_format_by_a_grammar(xml_lab):
    session = xml_lab.session()
    chat = openai.OpenAI(base_url=session.openai_base_url, api_key=session.key, max_retries=0)
    chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "12*7+5?"}], tools=[CALC_TOOL],
                                 tool_choice={"type": "function", "function": {"name": "calculator"}})
    (record,) = [c for c in xml_lab.reader.call_records() if c.session_id == session.id]
    assert record.render["prefill"] == "" and record.sampling["constraint"] == "tool_call"
    tag = xml_lab.engine.specs[-1].structure  # xgrammar's Qwen3.5 XML call with the tool's parameters inside
    assert json.loads(tag)["format"]["begin"] == "<tool_call>\n<function=calculator>\n"
    assert json.loads(tag)["format"]["content"]["style"] == "qwen_xml"


def test_an_unknown_parser_name_stops_the_lab_before_it_serves(model_path, tokenizer, tmp_path):
    import threading

    def loops() -> int:
        return sum(t.name == "polar-lab-loop" for t in threading.enumerate())

    engine = ScriptedEngine(tokenizer, ["ok"], model_path=model_path)
    before = loops()
    with pytest.raises(ConfigError, match="unknown tool_parser 'nope'"):
        Lab(port=0, engine=engine, runs_dir=str(tmp_path), run_name="bad", tool_parser="nope")
    assert loops() == before  # no proxy loop left serving
    assert engine.alive  # the engine is the caller's: a Lab closes only what it started
