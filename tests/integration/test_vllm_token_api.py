"""vLLM's token-id extensions on the proxy, against the real engine: `return_token_ids`,
`return_tokens_as_token_ids`, `/tokenize`, `/detokenize`, the `developer` role — what NeMo Gym's `vllm_model`,
SkyRL and rLLM expect of a vLLM backend. The ids they return must be exactly the recorded ones."""

import json

import httpx
import openai
import pytest

from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT
from tests.conftest import session_calls

QUESTION = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What is 6*7?"}]
IDS = {"return_token_ids": True}


def _post(lab, session, path, body):
    return httpx.post(f"{lab.url}/s/{session.key}{path}", json=body, timeout=60)


def test_return_token_ids_are_the_recorded_ids_through_the_openai_client(lab):
    s = lab.session()
    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.api_key)
    reply = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=24, seed=3, n=2, logprobs=True,
                                           top_logprobs=2, extra_body=IDS)
    calls = session_calls(lab, s)
    assert reply.model_extra["prompt_token_ids"] == calls[0].prompt_ids
    for choice, call in zip(reply.choices, calls, strict=True):
        assert choice.model_extra["token_ids"] == call.output_ids and call.output_ids
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(call.output_logprobs)
    assert "prompt_token_ids" not in calls[0].response  # one copy of the ids is kept: the record's own


@pytest.mark.parametrize("n", [1, 2])
def test_return_token_ids_in_a_stream_join_to_the_recorded_ids(lab, n):
    s = lab.session()
    body = {"messages": QUESTION, "max_tokens": 24, "seed": 4, "stream": True, "n": n, **IDS}
    with httpx.stream("POST", f"{lab.url}/s/{s.key}/v1/chat/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    calls = session_calls(lab, s)
    assert [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c] == [calls[0].prompt_ids]
    for call in calls:
        streamed = [t for c in chunks for ch in c["choices"] if ch["index"] == call.choice_index
                    for t in ch.get("token_ids") or []]
        assert streamed == call.output_ids and streamed


def test_a_forced_calls_prefill_is_in_the_prompt_ids_not_the_generated_ones(lab):
    s = lab.session()
    r = _post(lab, s, "/v1/chat/completions", {"messages": QUESTION, "tools": [CALC_TOOL], "max_tokens": 40, **IDS,
                                               "tool_choice": {"type": "function", "function": {"name": "calculator"}}})
    (call,) = session_calls(lab, s)
    assert r.json()["prompt_token_ids"] == call.prompt_ids and r.json()["choices"][0]["token_ids"] == call.output_ids


def test_tokenize_changes_nothing_a_later_call_sees(lab):
    """The same two calls with and without a /tokenize between them: the same call indices and the same prompts."""
    def two_calls(tokenize_between: bool):
        s = lab.session()
        body = {"messages": QUESTION, "max_tokens": 12, "seed": 9, **IDS}
        first = _post(lab, s, "/v1/chat/completions", body).json()
        follow = QUESTION + [first["choices"][0]["message"], {"role": "user", "content": "Thanks."}]
        if tokenize_between:
            _post(lab, s, "/tokenize", {"messages": follow})
        _post(lab, s, "/v1/chat/completions", {**body, "messages": follow})
        return [(c.call_index, c.prompt_ids, c.render["mode"]) for c in session_calls(lab, s)]

    assert two_calls(True) == two_calls(False)


def test_tokens_as_token_ids_name_each_sampled_id(lab):
    s = lab.session()
    r = _post(lab, s, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 8, "logprobs": True,
                                               "top_logprobs": 1, "return_tokens_as_token_ids": True})
    (call,) = session_calls(lab, s)
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in call.output_ids]


def test_tokenize_of_a_chat_is_what_the_engine_is_sent_for_those_messages_turn_after_turn(lab, tokenizer):
    """Turn 1 from the template; turn 2 continues turn 1's recorded ids (the echoed assistant turn as sampled):
    /tokenize must give the very ids the next chat completion is recorded with, tools and the developer role
    included."""
    s = lab.session()
    messages = [{"role": "developer", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What is 6*7?"}]
    for turn in range(2):
        ask = _post(lab, s, "/tokenize", {"messages": messages, "tools": [CALC_TOOL]}).json()
        reply = _post(lab, s, "/v1/chat/completions", {"messages": messages, "tools": [CALC_TOOL], "max_tokens": 30,
                                                       "seed": turn, **IDS}).json()
        call = session_calls(lab, s)[-1]
        assert ask["tokens"] == call.prompt_ids == reply["prompt_token_ids"] and ask["count"] == len(ask["tokens"])
        assert ask["max_model_len"] == lab.engine.max_model_len
        messages = messages + [reply["choices"][0]["message"], {"role": "user", "content": "And 2+2?"}]
    assert call.render["mode"] == "continued"  # turn 2 really did reuse turn 1's ids


def test_tokenize_renders_with_the_sessions_own_template(lab, tokenizer):
    from polar_lab.templates import with_empty_think

    s = lab.session(chat_template=with_empty_think(tokenizer.chat_template))
    ask = _post(lab, s, "/tokenize", {"messages": QUESTION}).json()["tokens"]
    _post(lab, s, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 4})
    (call,) = session_calls(lab, s)
    assert ask == call.prompt_ids
    assert ask != _post(lab, lab.session(), "/tokenize", {"messages": QUESTION}).json()["tokens"]  # not the model's


def test_the_developer_role_renders_as_system(lab):
    s = lab.session()
    as_system = _post(lab, s, "/tokenize", {"messages": QUESTION}).json()["tokens"]
    as_developer = _post(lab, s, "/tokenize", {"messages": [{**QUESTION[0], "role": "developer"}, QUESTION[1]]})
    assert as_developer.json()["tokens"] == as_system


def test_tokenize_and_detokenize_of_text_round_trip(lab, tokenizer):
    s = lab.session()
    text = "What is 37*12+5?"
    r = _post(lab, s, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer.encode(text) and r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])
    assert _post(lab, s, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": text}
    no_prompt = _post(lab, s, "/tokenize", {"messages": QUESTION, "add_generation_prompt": False}).json()["tokens"]
    with_prompt = _post(lab, s, "/tokenize", {"messages": QUESTION}).json()["tokens"]
    assert with_prompt[:len(no_prompt)] == no_prompt and len(with_prompt) > len(no_prompt)
    assert session_calls(lab, s) == []  # nothing here is a model call


@pytest.mark.parametrize("path, body, status, param", [
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": QUESTION, "continue_final_message": True}, 400, "continue_final_message"),
])
def test_bad_tokenizer_requests_are_400_in_openai_shape(lab, path, body, status, param):
    r = _post(lab, lab.session(), path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


def test_tokenizer_routes_need_a_key(lab):
    r = httpx.post(lab.url + "/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer pl-nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_responses_enable_response_messages_gives_the_recorded_ids(lab, tokenizer):
    s = lab.session()
    r = _post(lab, s, "/v1/responses", {"input": QUESTION[1]["content"], "instructions": SYSTEM_PROMPT,
                                        "max_output_tokens": 16, "enable_response_messages": True}).json()
    (call,) = session_calls(lab, s)
    (given,), (sampled,) = r["input_messages"], r["output_messages"]
    assert given["tokens"] == call.prompt_ids and sampled["tokens"] == call.output_ids
    assert given["message"] == tokenizer.decode(call.prompt_ids) and sampled["type"] == "raw_message_tokens"
    assert "input_messages" not in call.response
