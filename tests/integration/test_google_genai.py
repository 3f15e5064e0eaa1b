"""Google generateContent through the proxy with the official google-genai SDK and real vLLM."""

import json

import httpx
import pytest
from google import genai
from google.genai import errors, types

from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT, run_calculator
from polar_lab.trajectory import prefix_merging
from tests.conftest import session_calls

TOOL = types.Tool(function_declarations=[types.FunctionDeclaration(
    name="calculator", description=CALC_TOOL["function"]["description"],
    parameters_json_schema=CALC_TOOL["function"]["parameters"])])


def _client(session, *, key=None, base_url=None):
    return genai.Client(api_key=key or session.api_key, http_options=types.HttpOptions(
        base_url=base_url or session.google_base_url, retry_options=None))


def _config(**kw):
    return types.GenerateContentConfig(system_instruction=SYSTEM_PROMPT, max_output_tokens=60, **kw)


def test_plain_generate_content_records_ids_that_decode_to_the_text(lab, tokenizer):
    s = lab.session()
    client = _client(s)  # keep a reference: a collected genai.Client closes its HTTP client
    reply = client.models.generate_content(model="tiny-calc", contents="What is 37*12+5?", config=_config())
    (call,) = session_calls(lab, s)
    assert call.api == "google.generate_content"
    assert reply.usage_metadata.prompt_token_count == len(call.prompt_ids)
    assert reply.usage_metadata.candidates_token_count == len(call.output_ids)
    assert not reply.function_calls  # no tools offered
    assert (reply.text or "") == tokenizer.decode(call.output_ids, skip_special_tokens=True)


def test_streaming_yields_the_recorded_answer(lab):
    """Each stream's text is its record's; the answer comes as it was sampled, in pieces — in one of three tries: the
    proxy sends what has arrived when it writes, so on a loaded machine a short answer sampled in a few milliseconds
    can leave as one event."""
    pieces = []
    for _ in range(3):
        s = lab.session()
        client = _client(s)
        chunks = list(client.models.generate_content_stream(model="tiny-calc", contents="What is 2+3?",
                                                            config=_config()))
        (call,) = session_calls(lab, s)
        streamed = "".join(p.text or "" for c in chunks for p in c.candidates[0].content.parts or [])
        assert streamed == "".join(p.get("text", "") for p in call.response["candidates"][0]["content"]["parts"])
        assert chunks[-1].candidates[0].finish_reason is not None
        pieces.append(len(chunks))
        if len(chunks) > 2:
            break
    assert max(pieces) > 2, f"the answer came in one piece, not as it was sampled: {pieces} chunks"


def test_function_call_then_response_continues_one_exact_chain(lab):
    s = lab.session()
    client = _client(s)
    forced = _config(tools=[TOOL], tool_config=types.ToolConfig(function_calling_config=types.FunctionCallingConfig(
        mode="ANY", allowed_function_names=["calculator"])))
    question = types.Content(role="user", parts=[types.Part(text="What is 37*12+5?")])
    for _ in range(6):  # the tiny model sometimes botches the JSON of a forced call
        first = client.models.generate_content(model="tiny-calc", contents=[question], config=forced)
        if first.function_calls:
            break
    else:
        pytest.fail("no parseable function call in 6 tries")
    fc = first.function_calls[0]
    result = run_calculator(json.dumps(fc.args))
    history = [question, first.candidates[0].content,
               types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                   id=fc.id, name=fc.name, response={"result": result}))])]
    client.models.generate_content(model="tiny-calc", contents=history, config=_config(tools=[TOOL]))
    last_two = session_calls(lab, s)[-2:]
    assert last_two[-1].render["mode"] == "continued"
    assert len(prefix_merging(last_two)) == 1


def test_errors_come_back_in_google_shape(lab):
    s = lab.session()
    wrong, right = _client(s, key="pl-wrong", base_url=lab.url), _client(s)  # the path key would authenticate
    with pytest.raises(errors.ClientError) as err:
        wrong.models.generate_content(model="m", contents="hi")
    assert err.value.code == 401 and err.value.status == "UNAUTHENTICATED"
    with pytest.raises(errors.ClientError) as err:
        right.models.generate_content(model="m", contents="x " * 40000)
    assert err.value.code == 400 and err.value.status == "INVALID_ARGUMENT"
    r = httpx.post(f"{lab.url}/v1beta/models/m:generateContent?key={s.key}", content=b"{")
    assert r.status_code == 400 and r.json()["error"]["status"] == "INVALID_ARGUMENT"


def test_the_key_in_the_x_goog_api_key_header_alone_is_enough(lab):
    s = lab.session()
    client = _client(s, base_url=lab.url)  # the SDK sends x-goog-api-key; no key in the path
    client.models.generate_content(model="tiny-calc", contents="What is 2+2?", config=_config())
    (call,) = session_calls(lab, s)
    assert call.api == "google.generate_content"
