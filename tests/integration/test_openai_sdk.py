"""The walking skeleton end to end: the official openai SDK → proxy → real vLLM → store."""

import asyncio
import json

import httpx
import openai
import pytest

from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT, calculator_agent

QUESTION = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What is 37*12+5?"}]


def _records_of(lab, session):
    return [c for c in lab.call_records() if c.session_id == session.id]


def test_plain_request_records_ids_that_decode_to_the_returned_text(lab, tokenizer):
    s = lab.session()
    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.api_key)
    reply = client.chat.completions.create(model="tiny-calc", messages=QUESTION, max_tokens=40, seed=1)
    (call,) = _records_of(lab, s)
    text = tokenizer.decode(call.output_ids, skip_special_tokens=True)
    assert text == reply.choices[0].message.content
    assert len(call.output_logprobs) == len(call.output_ids) == reply.usage.completion_tokens
    assert len(call.prompt_ids) == reply.usage.prompt_tokens
    assert call.policy_version == lab.policy_version


def test_streaming_request_matches_the_recorded_call(lab, tokenizer):
    s = lab.session()
    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.api_key)
    stream = client.chat.completions.create(model="tiny-calc", messages=QUESTION, max_tokens=40, seed=2,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    (call,) = _records_of(lab, s)
    assert text == tokenizer.decode(call.output_ids, skip_special_tokens=True)


def test_tool_call_is_parsed_from_exactly_the_recorded_tokens(lab, tokenizer):
    s = lab.session()
    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.api_key)
    # a named tool_choice forces the call, so this holds for any sample of the model
    reply = client.chat.completions.create(model="tiny-calc", messages=QUESTION, tools=[CALC_TOOL], max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "calculator"}})
    (call,) = _records_of(lab, s)
    prefill = call.render["prefill"]
    generated = prefill + tokenizer.decode(call.output_ids, skip_special_tokens=True)
    if reply.choices[0].message.tool_calls:
        (tc,) = reply.choices[0].message.tool_calls
        assert tc.function.name == "calculator"
        assert tc.function.arguments in generated  # verbatim, not re-serialised
        json.loads(tc.function.arguments)
        assert reply.choices[0].finish_reason == "tool_calls"
    else:  # the model botched the JSON: the error is recorded, not hidden
        assert call.parse["errors"]


def test_tool_choice_none_never_samples_a_tool_call(lab):
    s = lab.session()
    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.api_key)
    ask = dict(model="tiny-calc", messages=QUESTION, tools=[CALC_TOOL], max_tokens=30)
    # the same seeds under "auto" do call the tool, so "none" has something to prevent
    assert any(client.chat.completions.create(**ask, seed=seed, tool_choice="auto").choices[0].message.tool_calls
               for seed in range(3))
    for seed in range(3):
        reply = client.chat.completions.create(**ask, seed=seed, tool_choice="none")
        assert not reply.choices[0].message.tool_calls
        assert "<tool_call>" not in (reply.choices[0].message.content or "")


def test_unknown_key_is_401_in_openai_shape(lab):
    client = openai.OpenAI(base_url=lab.url + "/v1", api_key="pl-wrong")
    with pytest.raises(openai.AuthenticationError) as err:
        client.chat.completions.create(model="tiny-calc", messages=QUESTION)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"


def test_malformed_json_is_400_in_openai_shape(lab):
    s = lab.session()
    r = httpx.post(s.openai_base_url + "/chat/completions", content=b'{"messages": [',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_prompt_longer_than_the_context_is_400(lab):
    s = lab.session()
    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.api_key)
    huge = " ".join(["seven"] * (lab.engine.max_model_len + 10))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-calc", messages=[{"role": "user", "content": huge}])
    assert err.value.code == "context_length_exceeded"
    assert _records_of(lab, s) == []


def test_64_concurrent_sessions_no_errors_every_call_recorded_once(lab):
    import json as _json
    from pathlib import Path

    tasks = [_json.loads(line) for line in Path("data/tasks/calc_test.jsonl").read_text().splitlines()[:64]] \
        if Path("data/tasks/calc_test.jsonl").exists() else \
        [{"question": f"What is {i}+{i}?", "answer": 2 * i} for i in range(64)]
    sessions = [lab.session(t) for t in tasks]

    async def run_all():
        return await asyncio.gather(*(calculator_agent(s, t, max_tokens=64) for s, t in zip(sessions, tasks)))

    results = lab.run(run_all(), timeout=600)
    ids = {s.id for s in sessions}
    calls = [c for c in lab.call_records() if c.session_id in ids]
    expected = sum(sum(m["role"] == "assistant" for m in r["messages"]) for r in results)
    assert len(calls) == expected
    assert len({c.call_id for c in calls}) == len(calls)  # each call exactly once
    for s, r in zip(sessions, results):  # each session's calls are numbered 0..k-1
        assert sorted(c.call_index for c in calls if c.session_id == s.id) == list(range(len(
            [m for m in r["messages"] if m["role"] == "assistant"])))


def test_seed_reproduces_a_sample_and_stop_cuts_it_where_asked(lab):
    s = lab.session()
    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.api_key)
    ask = dict(model="tiny-calc", messages=QUESTION, max_tokens=40, seed=123, temperature=1.0)
    first = client.chat.completions.create(**ask).choices[0].message.content
    assert client.chat.completions.create(**ask).choices[0].message.content == first
    assert len(first) > 4
    stop = first[2:4]
    cut = client.chat.completions.create(**ask, stop=[stop]).choices[0]
    assert cut.message.content == first[:first.index(stop)]
    assert cut.finish_reason == "stop"
