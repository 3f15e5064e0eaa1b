"""OpenAI Responses through the proxy with the official openai SDK and real vLLM."""

import json

import openai
import pytest

from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT, run_calculator
from polar_lab.trajectory import prefix_merging
from tests.conftest import session_calls

TOOL = {"type": "function", **CALC_TOOL["function"]}
FORCE = {"type": "function", "name": "calculator"}


def _client(session):
    return openai.OpenAI(base_url=session.openai_base_url, api_key=session.api_key, max_retries=0)


def test_plain_response_records_ids_that_decode_to_the_text(lab, tokenizer):
    s = lab.session()
    reply = _client(s).responses.create(model="tiny-calc", instructions=SYSTEM_PROMPT, input="What is 37*12+5?",
                                        max_output_tokens=40)
    (call,) = session_calls(lab, s)
    assert call.api == "openai.responses"
    assert reply.usage.input_tokens == len(call.prompt_ids) and reply.usage.output_tokens == len(call.output_ids)
    assert not any(o.type == "function_call" for o in reply.output)  # no tools offered
    assert reply.output_text == tokenizer.decode(call.output_ids, skip_special_tokens=True)


def test_streaming_events_end_in_the_recorded_response(lab):
    s = lab.session()
    events = list(_client(s).responses.create(model="tiny-calc", instructions=SYSTEM_PROMPT, input="What is 2+3?",
                                              tools=[TOOL], tool_choice=FORCE, max_output_tokens=60, stream=True))
    (call,) = session_calls(lab, s)
    assert events[0].type == "response.created"
    final = events[-1].response
    assert final.model_dump(exclude_none=True)["output"] == call.response["output"]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_function_call_then_output_continues_one_exact_chain(lab):
    s = lab.session()
    client = _client(s)
    for _ in range(6):  # the tiny model sometimes botches the JSON of a forced call
        first = client.responses.create(model="tiny-calc", instructions=SYSTEM_PROMPT, input="What is 37*12+5?",
                                        tools=[TOOL], tool_choice=FORCE, max_output_tokens=60)
        calls = [o for o in first.output if o.type == "function_call"]
        if calls:
            break
    else:
        pytest.fail("no parseable function call in 6 tries")
    (fc,) = calls
    json.loads(fc.arguments)
    items = [{"role": "user", "content": "What is 37*12+5?"}] + [o.model_dump(exclude_none=True) for o in first.output]
    items.append({"type": "function_call_output", "call_id": fc.call_id, "output": run_calculator(fc.arguments)})
    client.responses.create(model="tiny-calc", instructions=SYSTEM_PROMPT, input=items, tools=[TOOL],
                            max_output_tokens=40)
    last_two = session_calls(lab, s)[-2:]
    assert last_two[-1].render["mode"] == "continued"
    assert len(prefix_merging(last_two)) == 1


def test_errors_come_back_as_openai_sdk_exceptions(lab):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=lab.url + "/v1", api_key="pl-wrong", max_retries=0).responses.create(
            model="m", input="hi")
    s = lab.session()
    with pytest.raises(openai.NotFoundError) as err:
        _client(s).responses.create(model="m", input="hi", previous_response_id="resp_123")
    assert err.value.param == "previous_response_id" and "resp_123" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        _client(s).responses.create(model="m", input="x " * 40000)
    assert err.value.code == "context_length_exceeded"


def test_the_agents_sdk_continues_a_stored_response_in_one_chain(lab):
    """Runner.run(previous_response_id=...) across three turns: each call sends only its new input, the proxy
    rebuilds the rest from the session's stored responses, and the session stays one token-exact chain."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    s = lab.session(sampling={"seed": 2})
    agent = Agent(name="calc", instructions=SYSTEM_PROMPT, model_settings=ModelSettings(max_tokens=24),
                  model=OpenAIResponsesModel("m", openai.AsyncOpenAI(base_url=s.openai_base_url, api_key=s.key,
                                                                     max_retries=0)))

    async def three_turns():
        previous = None
        for question in ("What is 2+3?", "And 4*5?", "And 9-1?"):
            result = await Runner.run(agent, question, previous_response_id=previous, max_turns=1)
            previous = result.last_response_id
        return previous

    last = asyncio.run(three_turns())
    calls = session_calls(lab, s)
    assert len(calls) == 3 and [c.request.get("previous_response_id") is None for c in calls] == [True, False, False]
    assert all(len(c.request["input"]) == 1 for c in calls)  # only the new question went over the wire
    (chain,) = prefix_merging(calls)
    assert chain.call_ids == [c.call_id for c in calls]
    assert _client(s).responses.retrieve(last).id == last == calls[-1].response["id"]


def test_a_stored_response_belongs_to_its_session(lab):
    s, other = lab.session(), lab.session()
    first = _client(s).responses.create(model="m", input="What is 2+3?", max_output_tokens=8, truncation="auto")
    assert first.store is True and first.parallel_tool_calls is True  # OpenAI's defaults, echoed
    assert first.truncation == "auto"  # echoed as sent (not applied: docs/api-conformance.md)
    for client in (_client(other),):
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="m", input="and?", previous_response_id=first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
    unstored = _client(s).responses.create(model="m", input="What is 1+1?", max_output_tokens=8, store=False)
    with pytest.raises(openai.NotFoundError):
        _client(s).responses.retrieve(unstored.id)
    assert _client(s).responses.retrieve(first.id).output_text == first.output_text
    assert lab.service.responses.kept(s.id) == 1  # the unstored one is not kept
    s.close(1.0)
    assert lab.service.responses.kept(s.id) == 0  # dropped with its session
