"""A turn that holds only a thought stays in the conversation on every API, and a thinking model whose turns
alternate thought-only and thought-plus-call stays one chain.

The model thought, then stopped (no text, no call); the harness echoes that turn back in its API's shape — a
Responses `reasoning` item alone, an Anthropic `thinking` block with no text, a Google `thought` part alone, a Chat
message with `reasoning_content` and empty content — and sends a new user message or a tool result. The engine is
scripted (a real model cannot be made to stop after its thought on cue) with the Qwen3.5-format fixture's tokenizer
and template; the adapters, render, id splicing and the chain builder are the real ones.
"""

import json
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from polar_lab.harness.calculator import CALC_TOOL
from polar_lab.proxy.apis.openai_responses import _messages
from polar_lab.trajectory import prefix_merging

QWEN35 = Path("data/models/tiny-calc-qwen35")
CALL = "<tool_call>\n<function=calculator>\n<parameter=expression>\n{}\n</parameter>\n</function>\n</tool_call>"
REPLIES = [  # in turn: thought only, thought + call, thought only, thought + call
    "Nothing to compute yet.\n</think>\n\n",
    "Compute it.\n</think>\n\n" + CALL.format("2+2"),
    "Wait for the next question.\n</think>\n\n",
    "Compute it again.\n</think>\n\n" + CALL.format("3*3"),
]
FUNCTION = CALC_TOOL["function"]


@pytest.fixture
def lab(tmp_path):
    """A fresh scripted engine per test: its replies come in turn, one conversation per test."""
    if not (QWEN35 / "tokenizer.json").exists():
        pytest.skip("run `python scripts/build_tiny_model.py --family qwen35`")
    from polar_lab import Lab
    from polar_lab.engine import ScriptedEngine

    engine = ScriptedEngine(AutoTokenizer.from_pretrained(QWEN35), REPLIES, model_path=str(QWEN35))
    with Lab(port=0, engine=engine, runs_dir=str(tmp_path), run_name="thought-only") as lab:
        yield lab


def _post(session, path: str, body: dict) -> dict:
    r = httpx.post(f"{session.base_url}/s/{session.key}{path}", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


# Each API's client loop, as an SDK user writes it: echo the response into the history, then send a new user
# message (after a thought-only turn) or the tool's result (after a call). Four calls, one per reply.

def _chat(s) -> None:
    messages = [{"role": "user", "content": "Q1"}]
    for turn, follow_up in enumerate(["Q2", None, "Q3", None]):
        reply = _post(s, "/v1/chat/completions", {"messages": messages, "tools": [CALC_TOOL]})
        message = reply["choices"][0]["message"]
        assert bool(message.get("tool_calls")) == (turn % 2 == 1) and not message.get("content")
        messages.append({k: message[k] for k in ("role", "content", "reasoning_content", "tool_calls") if k in message})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
        else:
            messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "4"})


def _responses(s) -> None:
    items = [{"type": "message", "role": "user", "content": "Q1"}]
    tool = {"type": "function", **FUNCTION}
    for turn, follow_up in enumerate(["Q2", None, "Q3", None]):
        output = _post(s, "/v1/responses", {"input": items, "tools": [tool], "store": False})["output"]
        assert [o["type"] for o in output] == ["reasoning"] + ["function_call"] * (turn % 2)
        items += output
        if follow_up:
            items.append({"type": "message", "role": "user", "content": follow_up})
        else:
            items.append({"type": "function_call_output", "call_id": output[-1]["call_id"], "output": "4"})


def _anthropic(s) -> None:
    messages = [{"role": "user", "content": "Q1"}]
    tool = {"name": FUNCTION["name"], "description": FUNCTION["description"], "input_schema": FUNCTION["parameters"]}
    for turn, follow_up in enumerate(["Q2", None, "Q3", None]):
        content = _post(s, "/v1/messages", {"max_tokens": 256, "messages": messages, "tools": [tool]})["content"]
        assert [b["type"] for b in content] == ["thinking"] + ["tool_use"] * (turn % 2)
        messages.append({"role": "assistant", "content": content})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
        else:
            messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": content[-1]["id"],
                                                          "content": "4"}]})


def _google(s) -> None:
    contents = [{"role": "user", "parts": [{"text": "Q1"}]}]
    tools = [{"functionDeclarations": [FUNCTION]}]
    for turn, follow_up in enumerate(["Q2", None, "Q3", None]):
        parts = _post(s, "/v1beta/models/m:generateContent",
                      {"contents": contents, "tools": tools})["candidates"][0]["content"]["parts"]
        assert [("thought" if p.get("thought") else "call") for p in parts] == ["thought"] + ["call"] * (turn % 2)
        contents.append({"role": "model", "parts": parts})
        if follow_up:
            contents.append({"role": "user", "parts": [{"text": follow_up}]})
        else:
            call = parts[-1]["functionCall"]
            contents.append({"role": "user", "parts": [{"functionResponse": {
                "id": call.get("id"), "name": call["name"], "response": {"result": "4"}}}]})


@pytest.mark.parametrize("conversation", [_chat, _responses, _anthropic, _google],
                         ids=["chat", "responses", "anthropic", "google"])
def test_thought_only_and_thought_plus_call_turns_stay_one_chain(lab, conversation):
    s = lab.session(harness=conversation.__name__)
    conversation(s)
    calls = sorted(lab.call_records([s.id]), key=lambda c: c.call_index)
    assert len(calls) == 4
    for earlier, later in zip(calls, calls[1:]):  # each turn went back as the ids the model sampled
        assert earlier.call_id in later.render.get("spliced", []), later.render
        assert later.prompt_ids[:len(earlier.prompt_ids) + len(earlier.output_ids)] == \
            earlier.prompt_ids + earlier.output_ids
    (chain,) = prefix_merging(calls)
    assert chain.token_ids == calls[-1].prompt_ids + calls[-1].output_ids
    assert lab.chain_breaks().empty


def test_responses_keeps_a_thought_only_turn_as_its_own_assistant_turn():
    """The repro from issue 40: the turn-1 thought used to be dropped and glued onto the turn-2 answer."""
    items = [{"type": "message", "role": "user", "content": "Q1"},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "T1"}]},
             {"type": "message", "role": "user", "content": "Q2"},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "T2"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A2"}]}]
    assert _messages(items) == [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": None, "reasoning_content": "T1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning_content": "T2"},
    ]


@pytest.mark.parametrize("items, expected", [
    # a thought, then the call it led to: one turn
    ([{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "T"}]},
      {"type": "function_call", "call_id": "c1", "name": "calculator", "arguments": "{}"}],
     [{"role": "assistant", "content": None, "reasoning_content": "T", "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}]}]),
    # a thought after an answered turn opens the next turn: it is not added to (nor overwrites) the earlier one
    ([{"type": "message", "role": "assistant", "content": "A1"},
      {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "T2"}]},
      {"type": "function_call", "call_id": "c2", "name": "calculator", "arguments": "{}"}],
     [{"role": "assistant", "content": "A1"},
      {"role": "assistant", "content": None, "reasoning_content": "T2", "tool_calls": [
          {"id": "c2", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}]}]),
    # a thought last in the input, then a tool result: both kept in order
    ([{"type": "reasoning", "summary": [{"type": "summary_text", "text": "S"}]},
      {"type": "function_call_output", "call_id": "c1", "output": "4"}],
     [{"role": "assistant", "content": None, "reasoning_content": "S"},
      {"role": "tool", "tool_call_id": "c1", "content": "4"}]),
])
def test_responses_reasoning_items_open_the_turn_they_belong_to(items, expected):
    assert _messages(items) == expected
    assert json.loads(json.dumps(_messages(items))) == expected  # plain data: it goes into the record as is
