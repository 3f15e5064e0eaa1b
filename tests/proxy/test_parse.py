"""Tool-call and reasoning parsing of generated text (Hermes/Qwen format)."""

import json

import pytest

from polar_lab.proxy.parse import parse_output

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*7"}}\n</tool_call>'


@pytest.mark.parametrize("text, content, names, n_errors", [
    ("The answer is 21.", "The answer is 21.", [], 0),                          # plain answer
    (CALL, None, ["calculator"], 0),                                            # call, no content
    ("Let me compute.\n" + CALL, "Let me compute.", ["calculator"], 0),         # content before call
    (CALL + "\n" + CALL.replace("3*7", "1+1"), None, ["calculator"] * 2, 0),    # two calls
    # a botched call: the raw text comes back as content, so the harness echoes exactly what was sampled
    ('<tool_call>\n{"name": "calculator", "argu', '<tool_call>\n{"name": "calculator", "argu', [], 1),
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", [], 1),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', [], 1),
    ("<tool_call>\nIt equals 5.", "<tool_call>\nIt equals 5.", [], 1),
    (CALL + " trailing", None, ["calculator"], 1),                              # call kept, tail reported
    ("<tool_call>\n" + CALL, "<tool_call>", ["calculator"], 1),                  # a stray open tag stays content
    ('<tool_call>{"name":"f","arguments":{"x":1}}</tool_call>', None, ["f"], 0),  # compact JSON
    ('<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>', None, ["f"], 0),  # string args
])
def test_parse_table(text, content, names, n_errors):
    parsed = parse_output(text)
    assert parsed.content == content
    assert [c["name"] for c in parsed.tool_calls] == names
    assert len(parsed.errors) == n_errors


def test_arguments_are_the_exact_text_the_model_wrote():
    # Spacing the model chose survives, so the harness echoes back byte-identical arguments.
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression":  "3 * 7"}}\n</tool_call>'
    (call,) = parse_output(text).tool_calls
    assert call["arguments"] == '{"expression":  "3 * 7"}'
    assert json.loads(call["arguments"]) == {"expression": "3 * 7"}


def test_tool_parsing_can_be_off():
    parsed = parse_output(CALL, parse_tools=False)
    assert parsed.content == CALL and parsed.tool_calls == []


def test_reasoning_is_split_from_content():
    parsed = parse_output("<think>\nadd them\n</think>\n\nThe answer is 2.")
    assert (parsed.reasoning, parsed.content) == ("add them", "The answer is 2.")


def test_every_call_gets_a_distinct_id():
    parsed = parse_output(CALL + "\n" + CALL)
    assert len({c["id"] for c in parsed.tool_calls}) == 2


def test_content_and_calls_re_render_to_the_generated_text(tokenizer):
    # The template renders content, then "\n", then each call: the parse must invert exactly that.
    from polar_lab.proxy.render import Renderer

    renderer = Renderer(tokenizer)
    for text in ["<tool_call>\n" + CALL, "Let me see.\n" + CALL, CALL, "<tool_call>\nIt equals 5."]:
        parsed = parse_output(text)
        message = {"role": "assistant", "content": parsed.content,
                   "tool_calls": [{"id": c["id"], "type": "function",
                                   "function": {"name": c["name"], "arguments": c["arguments"]}}
                                  for c in parsed.tool_calls]}
        prompt = renderer.render([{"role": "user", "content": "q"}], []).text
        full = renderer.render([{"role": "user", "content": "q"}, message, {"role": "user", "content": "n"}], []).text
        assert full.startswith(prompt + text + "<|im_end|>"), text


def test_a_marker_inside_an_argument_string_does_not_end_the_call():
    """Seen on the real engine under a forced call's grammar: the JSON is valid, a string in it holds a marker."""
    for inner in ("<tool_call>+3", "x</tool_call>!4"):
        args = json.dumps({"expression": inner})
        parsed = parse_output(f'<tool_call>\n{{"name": "calculator", "arguments": {args}}}\n</tool_call>')
        assert [(c["name"], c["arguments"]) for c in parsed.tool_calls] == [("calculator", args)], parsed
        assert parsed.errors == [] and parsed.content is None
