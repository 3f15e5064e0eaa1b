"""Each provider's shapes where a demanding SDK user found them wrong (issue 18), on the real engine: logprobs,
model lists, Google's countTokens, error shape, JSON-array streams and candidates, Anthropic tool results."""

import anthropic
import httpx
import openai
import orjson
import pytest
from google import genai
from google.genai import types as gtypes

from polar_lab.harness.calculator import CALC_TOOL
from tests.conftest import session_calls
from tests.shapes import provider_error

QUESTION = [{"role": "user", "content": "What is 12*7?"}]


def _genai(session):
    return genai.Client(api_key=session.key, http_options=gtypes.HttpOptions(base_url=session.google_base_url))


def _check_top(entries: list[tuple[int | str, float]], sampled: tuple[int | str, float], k: int) -> None:
    """Exactly k alternatives, most likely first, the sampled token among them whenever it ranks in the k."""
    assert len(entries) == k
    assert [lp for _, lp in entries] == sorted((lp for _, lp in entries), reverse=True)
    if sampled[1] >= entries[-1][1]:
        assert sampled in entries


def test_top_logprobs_are_exactly_k_with_the_sampled_token_where_it_ranks(lab):
    s = lab.session()
    reply = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key, max_retries=0).chat.completions.create(
        model="m", messages=QUESTION, logprobs=True, top_logprobs=3, max_tokens=12, seed=4)
    content = reply.choices[0].logprobs.content
    (call,) = session_calls(lab, s)
    assert [round(t.logprob, 5) for t in content] == [round(lp, 5) for lp in call.output_logprobs]
    for t in content:
        _check_top([(a.token, a.logprob) for a in t.top_logprobs], (t.token, t.logprob), 3)
    response = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key, max_retries=0).responses.create(
        model="m", input="What is 12*7?", include=["message.output_text.logprobs"], top_logprobs=2,
        max_output_tokens=12)
    (text,) = [o for o in response.output if o.type == "message"]
    logprobs = text.content[0].logprobs
    assert len(logprobs) == len(session_calls(lab, s)[-1].output_ids) > 0
    for t in logprobs:
        _check_top([(a.token, a.logprob) for a in t.top_logprobs], (t.token, t.logprob), 2)
    gemini = _genai(s)  # held: a google-genai client closes when collected
    google = gemini.models.generate_content(model="m", contents="What is 12*7?", config=gtypes.GenerateContentConfig(
        response_logprobs=True, logprobs=3, seed=4, max_output_tokens=12))
    result = google.candidates[0].logprobs_result
    assert [c.token_id for c in result.chosen_candidates] == session_calls(lab, s)[-1].output_ids
    for chosen, top in zip(result.chosen_candidates, result.top_candidates):
        _check_top([(c.token_id, c.log_probability) for c in top.candidates],
                   (chosen.token_id, chosen.log_probability), 3)


def test_each_sdk_lists_and_gets_models_in_its_own_shape(lab):
    s = lab.session()
    assert [m.id for m in openai.OpenAI(base_url=s.openai_base_url, api_key=s.key).models.list()] == [lab.engine.model_name]
    claude = anthropic.Anthropic(base_url=s.anthropic_base_url, api_key=s.key, max_retries=0)
    listed = list(claude.models.list())
    assert [m.id for m in listed] == [lab.engine.model_name] and listed[0].type == "model"
    assert claude.models.retrieve("claude-sonnet-4-5").id == "claude-sonnet-4-5"  # every name is served
    gemini = _genai(s)
    assert [m.name for m in gemini.models.list()] == [f"models/{lab.engine.model_name}"]
    got = gemini.models.get(model="gemini-2.5-pro")
    assert got.name == "models/gemini-2.5-pro" and got.input_token_limit == lab.engine.max_model_len


def test_google_count_tokens_counts_what_generate_content_renders(lab):
    s = lab.session()
    gemini = _genai(s)
    counted = gemini.models.count_tokens(model="m", contents="What is 12*7?").total_tokens
    reply = gemini.models.generate_content(model="m", contents="What is 12*7?",
                                           config=gtypes.GenerateContentConfig(max_output_tokens=4))
    assert counted == reply.usage_metadata.prompt_token_count == len(session_calls(lab, s)[0].prompt_ids)


def test_google_paths_answer_errors_in_googles_shape(lab):
    s = lab.session()
    for path in ("/v1/models/m:countTokens", "/v1beta/models/m:countTokens", "/v1/models/m:generateContent"):
        r = httpx.post(f"{lab.url}{path}", json={"contents": "not a list"}, headers={"x-goog-api-key": s.key})
        assert r.status_code == 400 and "contents" in provider_error("google.generate_content", r)
    r = httpx.get(f"{lab.url}/v1/models/m", headers={"x-goog-api-key": "pl-wrong"})
    assert r.status_code == 401 and provider_error("google.generate_content", r)
    r = httpx.get(f"{lab.url}/v1/models/m", headers={"x-api-key": "pl-wrong", "anthropic-version": "2023-06-01"})
    assert r.status_code == 401 and provider_error("anthropic.messages", r)


def test_stream_generate_content_without_sse_is_one_json_array(lab):
    s = lab.session()
    body = {"contents": [{"role": "user", "parts": [{"text": "What is 12*7?"}]}],
            "generationConfig": {"maxOutputTokens": 16, "seed": 3, "responseLogprobs": True}}
    r = httpx.post(f"{s.base_url}/s/{s.key}/v1beta/models/m:streamGenerateContent", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    chunks = orjson.loads(r.content)
    assert isinstance(chunks, list) and chunks[-1]["candidates"][0]["finishReason"] in ("STOP", "MAX_TOKENS")
    text = "".join(p.get("text", "") for c in chunks for p in c["candidates"][0]["content"]["parts"])
    (call,) = session_calls(lab, s)
    assert text == "".join(p.get("text", "") for p in call.response["candidates"][0]["content"]["parts"])
    assert chunks[-1]["usageMetadata"]["candidatesTokenCount"] == len(call.output_ids)
    chosen = chunks[-1]["candidates"][0]["logprobsResult"]["chosenCandidates"]  # with the candidate's end
    assert [c["tokenId"] for c in chosen] == call.output_ids


def test_candidate_count_returns_that_many_candidates(lab):
    s = lab.session()
    gemini = _genai(s)
    reply = gemini.models.generate_content(model="m", contents="What is 12*7?", config=gtypes.GenerateContentConfig(
        candidate_count=3, seed=2, max_output_tokens=8))
    assert [c.index for c in reply.candidates] == [0, 1, 2]
    assert sorted(c.choice_index for c in session_calls(lab, s)) == [0, 1, 2]


def test_anthropic_tool_results_say_when_they_failed_and_refuse_images(lab):
    s = lab.session()
    claude = anthropic.Anthropic(base_url=s.anthropic_base_url, api_key=s.key, max_retries=0)
    tool = {"name": "calculator", "description": "d", "input_schema": CALC_TOOL["function"]["parameters"]}
    turn = [{"role": "user", "content": "What is 1/0?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "calculator",
                                               "input": {"expression": "1/0"}}]}]
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "division by zero", "is_error": True}
    claude.messages.create(model="m", max_tokens=8, tools=[tool], messages=turn + [{"role": "user",
                                                                                     "content": [result]}])
    prompt = lab.tokenizer.decode(session_calls(lab, s)[-1].prompt_ids)
    assert "Error: division by zero" in prompt
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError, match="'image'"):
        claude.messages.create(model="m", max_tokens=8, tools=[tool], messages=turn + [{"role": "user", "content": [
            {**result, "is_error": False, "content": [{"type": "text", "text": "see"}, image]}]}])
    r = httpx.post(f"{s.anthropic_base_url}/v1/messages", json={"model": "m", "max_tokens": 4, "messages": QUESTION},
                   headers={"x-api-key": s.key, "anthropic-version": "latest"})
    assert r.status_code == 400 and "anthropic-version" in provider_error("anthropic.messages", r)
