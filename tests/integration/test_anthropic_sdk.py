"""Anthropic Messages through the proxy with the official anthropic SDK and real vLLM."""

import json

import anthropic
import httpx
import pytest

from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT, run_calculator
from polar_lab.trajectory import prefix_merging
from tests.conftest import session_calls

TOOL = {"name": "calculator", "description": CALC_TOOL["function"]["description"],
        "input_schema": CALC_TOOL["function"]["parameters"]}
QUESTION = [{"role": "user", "content": "What is 37*12+5?"}]


def _client(session):
    return anthropic.Anthropic(base_url=session.anthropic_base_url, api_key=session.api_key, max_retries=0)


def test_plain_message_records_ids_that_decode_to_the_text(lab, tokenizer):
    s = lab.session()
    reply = _client(s).messages.create(model="tiny-calc", system=SYSTEM_PROMPT, messages=QUESTION, max_tokens=40)
    (call,) = session_calls(lab, s)
    text = "".join(b.text for b in reply.content if b.type == "text")
    assert reply.usage.input_tokens == len(call.prompt_ids) and reply.usage.output_tokens == len(call.output_ids)
    assert reply.stop_reason in ("end_turn", "max_tokens")  # no tools offered: no tool_use
    assert tokenizer.decode(call.output_ids, skip_special_tokens=True) == text
    assert call.api == "anthropic.messages"


def test_streaming_events_rebuild_the_same_message(lab):
    s = lab.session()
    client = _client(s)
    with client.messages.stream(model="tiny-calc", system=SYSTEM_PROMPT, messages=QUESTION, max_tokens=60,
                                tools=[TOOL], tool_choice={"type": "tool", "name": "calculator"}) as stream:
        final = stream.get_final_message()
    (call,) = session_calls(lab, s)
    assert final.model_dump(exclude={"container"}, exclude_none=True)["content"] == call.response["content"]
    assert final.stop_reason == call.response["stop_reason"]


def _forced_tool_turn(lab, client):
    for _ in range(6):  # the tiny model sometimes botches the JSON; a forced call parses ~9 times in 10
        reply = client.messages.create(model="tiny-calc", system=SYSTEM_PROMPT, messages=QUESTION, max_tokens=60,
                                       tools=[TOOL], tool_choice={"type": "tool", "name": "calculator"})
        if reply.stop_reason == "tool_use":
            return reply
    pytest.fail("no parseable tool call in 6 tries")


def test_tool_use_then_tool_result_continues_one_exact_chain(lab):
    s = lab.session()
    client = _client(s)
    first = _forced_tool_turn(lab, client)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "calculator" and "expression" in use.input
    history = QUESTION + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                        "content": run_calculator(json.dumps(use.input))}]}]
    client.messages.create(model="tiny-calc", system=SYSTEM_PROMPT, messages=history, max_tokens=40, tools=[TOOL])
    calls = [c for c in session_calls(lab, s) if c.call_index >= session_calls(lab, s)[-2].call_index]
    assert calls[-1].render["mode"] == "continued"  # the echoed tool input re-rendered to the sampled text
    assert len(prefix_merging(calls)) == 1


def test_count_tokens_matches_the_recorded_prompt(lab):
    s = lab.session()
    client = _client(s)
    counted = client.messages.count_tokens(model="tiny-calc", system=SYSTEM_PROMPT, messages=QUESTION, tools=[TOOL])
    client.messages.create(model="tiny-calc", system=SYSTEM_PROMPT, messages=QUESTION, max_tokens=5, tools=[TOOL])
    (call,) = session_calls(lab, s)
    assert counted.input_tokens == len(call.prompt_ids)


def test_claude_code_billing_header_line_is_stripped_so_chains_survive(lab):
    s = lab.session()
    client = _client(s)
    for nonce in ("a1", "b2"):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=1; nonce={nonce}"},
                  {"type": "text", "text": SYSTEM_PROMPT}]
        client.messages.create(model="tiny-calc", system=system, messages=QUESTION, max_tokens=5)
    first, second = session_calls(lab, s)
    assert first.prompt_ids == second.prompt_ids


def test_errors_come_back_in_anthropic_shape_and_sdk_types(lab):
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=lab.url, api_key="pl-wrong", max_retries=0).messages.create(
            model="m", messages=QUESTION, max_tokens=5)
    assert err.value.body["error"]["type"] == "authentication_error"
    s = lab.session()
    with pytest.raises(anthropic.BadRequestError) as err:
        _client(s).messages.create(model="m", messages=[{"role": "user", "content": "x " * 40000}], max_tokens=5)
    assert err.value.body["type"] == "error" and "context length" in err.value.body["error"]["message"]
    r = httpx.post(s.anthropic_base_url + "/v1/messages", content=b"{", headers={"x-api-key": s.key})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(s.anthropic_base_url + "/v1/messages", json={"messages": QUESTION}, headers={"x-api-key": s.key})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_the_key_in_the_x_api_key_header_alone_is_enough(lab):
    s = lab.session()
    client = anthropic.Anthropic(base_url=lab.url, api_key=s.key, max_retries=0)  # the SDK sends x-api-key
    client.messages.create(model="tiny-calc", messages=QUESTION, max_tokens=4)
    (call,) = session_calls(lab, s)
    assert call.api == "anthropic.messages"
