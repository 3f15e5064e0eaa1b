"""The walking skeleton end to end: the official openai SDK → proxy → real vLLM → store."""

import asyncio
import json
import math

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
    # a named tool_choice forces the call; the tiny model botches the JSON about 1 time in 10, so seeds are
    # tried until one parses — and every botched one must have its error recorded, not hidden
    for seed in range(6):
        reply = client.chat.completions.create(model="tiny-calc", messages=QUESTION, tools=[CALC_TOOL], max_tokens=60,
                                               seed=seed,
                                               tool_choice={"type": "function", "function": {"name": "calculator"}})
        call = _records_of(lab, s)[-1]
        if reply.choices[0].message.tool_calls:
            break
        assert call.parse["errors"]
    else:
        pytest.fail("no parseable forced tool call in 6 seeds")
    generated = call.render["prefill"] + tokenizer.decode(call.output_ids, skip_special_tokens=True)
    (tc,) = reply.choices[0].message.tool_calls
    assert tc.function.name == "calculator"
    assert tc.function.arguments in generated  # verbatim, not re-serialised
    json.loads(tc.function.arguments)
    assert reply.choices[0].finish_reason == "tool_calls" and not call.parse["errors"]


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


def test_logprobs_and_top_logprobs_are_the_samplers_own(lab):
    s = lab.session()
    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.api_key)
    reply = client.chat.completions.create(model="tiny-calc", messages=QUESTION, max_tokens=12, seed=4,
                                           logprobs=True, top_logprobs=3)
    (call,) = _records_of(lab, s)
    content = reply.choices[0].logprobs.content
    assert [t.logprob for t in content] == call.output_logprobs  # the recorded numbers, not recomputed ones
    for token in content:
        tops = [t.logprob for t in token.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert token.logprob <= tops[0] + 1e-6  # nothing is likelier than the most likely
        if token.logprob >= tops[-1]:  # the sampled token is among the top 3: it is listed
            assert token.token in [t.token for t in token.top_logprobs]
        assert sum(math.exp(lp) for lp in tops) <= 1 + 1e-4


def test_tool_choice_required_makes_the_model_call_a_tool(lab):
    s = lab.session()
    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.api_key)
    replies = [client.chat.completions.create(model="tiny-calc", messages=QUESTION, tools=[CALC_TOOL], max_tokens=60,
                                              tool_choice="required", seed=seed) for seed in range(4)]
    calls = _records_of(lab, s)
    assert all(c.sampling["constraint"] == "tool_call" for c in calls)  # a grammar forced it (not trained)
    assert all(r.choices[0].message.tool_calls[0].function.name == "calculator" for r in replies)


def test_n_choices_on_the_real_engine_are_seeded_apart_and_recorded_apart(lab):
    s = lab.session()
    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.api_key)
    reply = client.chat.completions.create(model="tiny-calc", messages=QUESTION, max_tokens=24, n=3, seed=11,
                                           temperature=1.0)
    calls = _records_of(lab, s)
    assert [c.choice_index for c in calls] == [0, 1, 2] and len({c.request_id for c in calls}) == 1
    assert [c.sampling["seed"] for c in calls] == [11, 12, 13]
    assert len({tuple(c.output_ids) for c in calls}) == 3  # three samples, not one copied
    for choice, call in zip(reply.choices, calls):
        assert choice.index == call.choice_index and len(call.output_logprobs) == len(call.output_ids)
    again = client.chat.completions.create(model="tiny-calc", messages=QUESTION, max_tokens=24, seed=12,
                                           temperature=1.0)
    assert _records_of(lab, s)[-1].output_ids == calls[1].output_ids  # choice 1 is exactly seed 12
    assert again.choices[0].message.content == reply.choices[1].message.content


def test_a_sessions_forced_temperature_overrides_the_harnesss(lab):
    s = lab.session(sampling={"temperature": 0.0})  # greedy, whatever the harness asks
    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.api_key)
    for seed in (1, 2, 3):
        client.chat.completions.create(model="tiny-calc", messages=QUESTION, max_tokens=24, temperature=1.5,
                                       seed=seed)
    calls = _records_of(lab, s)
    assert {c.sampling["temperature"] for c in calls} == {0.0}
    assert all(c.sampling["overridden"] == {"temperature": 1.5} for c in calls)  # what the harness asked for
    assert len({tuple(c.output_ids) for c in calls}) == 1  # greedy: the seeds do not matter
    free = lab.session()  # the control: the same requests without the forced value differ
    client = openai.OpenAI(base_url=free.openai_base_url, api_key=free.api_key)
    for seed in (1, 2, 3):
        client.chat.completions.create(model="tiny-calc", messages=QUESTION, max_tokens=24, temperature=1.5,
                                       seed=seed)
    assert len({tuple(c.output_ids) for c in _records_of(lab, free)}) > 1
    assert not any("overridden" in c.sampling for c in _records_of(lab, free))


def test_a_session_key_in_the_authorization_header_alone_is_enough(lab):
    s = lab.session()
    client = openai.OpenAI(base_url=lab.url + "/v1", api_key=s.key)  # no key in the path
    client.chat.completions.create(model="tiny-calc", messages=QUESTION, max_tokens=4)
    assert len(_records_of(lab, s)) == 1
