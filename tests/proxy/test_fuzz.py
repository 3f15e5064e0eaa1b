"""Bad input, generated: every API surface gets thousands of hypothesis-built bodies, plausible and not.

Each answer must be a 2xx, or a 4xx in that provider's error shape — never a 5xx, never a hang (each
request has a timeout) — and afterwards the store holds exactly one whole record per choice served.
Real HTTP (uvicorn) and the real store; the engine is scripted, so the proxy is what is under test.
Examples are derandomised: CI sees the same bodies every run.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_lab.store import load_calls

EXAMPLES_PER_SURFACE = 2500  # x 4 surfaces = 10,000 bodies per run

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False, width=32),
                      st.text(max_size=12))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                             st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                          max_leaves=8)
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer", "model", "function", "wizard", ""])
texts = st.one_of(st.text(max_size=40), json_value)
tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "custom", 3]),
                              "function": st.one_of(json_value, st.fixed_dictionaries(
                                  {"name": st.one_of(st.text(max_size=10), json_value),
                                   "parameters": json_value}))})


def _maybe(**fields):
    """A dict with any subset of these keys, plus now and then a junk key."""
    return st.fixed_dictionaries({}, optional={**fields, "zz_extra": json_value})


openai_message = st.fixed_dictionaries({"role": roles}, optional={
    "content": st.one_of(texts, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 1]),
                                                                "text": texts}), max_size=2)),
    "tool_calls": st.one_of(json_value, st.lists(st.fixed_dictionaries({
        "id": st.text(max_size=6), "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": st.text(max_size=6), "arguments": texts})}), max_size=2)),
    "tool_call_id": texts, "name": texts})
sampling = dict(temperature=st.one_of(st.floats(-1, 3), json_value), top_p=st.one_of(st.floats(-1, 2), json_value),
                max_tokens=st.one_of(st.integers(-5, 10**7), json_value), stream=st.one_of(st.booleans(), json_value),
                seed=st.one_of(st.integers(-2**63, 2**63), json_value), stop=st.one_of(st.lists(texts, max_size=5),
                                                                                     json_value))

SURFACES = {
    "openai.chat": ("/v1/chat/completions", _maybe(
        model=texts, messages=st.one_of(st.lists(openai_message, max_size=4), json_value),
        tools=st.one_of(st.lists(tool, max_size=2), json_value), n=st.one_of(st.integers(-1, 4), json_value),
        tool_choice=st.one_of(st.sampled_from(["auto", "none", "required", "any"]), json_value),
        logprobs=json_value, top_logprobs=st.one_of(st.integers(-1, 30), json_value),
        max_completion_tokens=st.one_of(st.integers(-5, 10**7), json_value), **sampling)),
    "openai.responses": ("/v1/responses", _maybe(
        model=texts, instructions=texts, max_output_tokens=st.one_of(st.integers(-5, 10**7), json_value),
        input=st.one_of(texts, st.lists(st.one_of(openai_message, st.fixed_dictionaries(
            {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"])},
            optional={"call_id": texts, "output": texts, "arguments": texts, "name": texts, "role": roles,
                      "content": texts})), max_size=3)),
        tools=st.one_of(st.lists(json_value, max_size=2), json_value), previous_response_id=texts,
        temperature=sampling["temperature"], stream=sampling["stream"])),
    "anthropic.messages": ("/v1/messages", _maybe(
        model=texts, max_tokens=st.one_of(st.integers(-5, 10**7), json_value), system=st.one_of(texts, json_value),
        messages=st.one_of(st.lists(st.fixed_dictionaries({"role": roles}, optional={"content": st.one_of(
            texts, st.lists(st.fixed_dictionaries({"type": st.sampled_from(
                ["text", "tool_use", "tool_result", "thinking", "image", "?"])}, optional={
                "text": texts, "id": texts, "name": texts, "input": json_value, "tool_use_id": texts,
                "content": texts}), max_size=3))}), max_size=4), json_value),
        tools=st.one_of(st.lists(json_value, max_size=2), json_value), tool_choice=json_value,
        thinking=json_value, metadata=json_value, stream=sampling["stream"], temperature=sampling["temperature"])),
    "google.generate_content": ("/v1beta/models/tiny-calc:generateContent", _maybe(
        contents=st.one_of(st.lists(st.fixed_dictionaries({}, optional={
            "role": roles, "parts": st.one_of(st.lists(st.fixed_dictionaries({}, optional={
                "text": texts, "functionCall": json_value, "functionResponse": json_value}), max_size=3),
                json_value)}), max_size=3), json_value),
        systemInstruction=json_value, generationConfig=json_value, tools=json_value)),
}


def _error_shaped(api: str, body) -> bool:
    if not isinstance(body, (dict, list)):
        return False
    if api == "anthropic.messages":
        return body.get("type") == "error" and isinstance(body.get("error", {}).get("message"), str)
    if api.startswith("google"):
        err = body[0]["error"] if isinstance(body, list) else body.get("error", {})
        return isinstance(err.get("message"), str) and isinstance(err.get("code"), int)
    err = body.get("error", {})
    return isinstance(err.get("message"), str) and "type" in err


@pytest.fixture(scope="module")
def fuzz_lab(model_path, tmp_path_factory):
    from transformers import AutoTokenizer

    from polar_lab import Lab
    from polar_lab.engine import ScriptedEngine

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    engine = ScriptedEngine(tokenizer, ["Hello there.", '<tool_call>\n{"name": "calculator", "arguments": '
                                                        '{"expression": "1+1"}}\n</tool_call>'],
                            model_path=model_path, max_model_len=2048)
    with Lab(port=0, engine=engine, runs_dir=str(tmp_path_factory.mktemp("fuzz")), run_name="fuzz",
             auto_sessions=True) as lab:
        yield lab


@pytest.mark.slow
@pytest.mark.parametrize("api", list(SURFACES))
def test_generated_bodies_get_2xx_or_a_provider_shaped_4xx(fuzz_lab, api):
    path, bodies = SURFACES[api]
    client = httpx.Client(base_url=fuzz_lab.url, timeout=30, headers={"x-api-key": "pl-fuzz",
                                                                       "Authorization": "Bearer pl-fuzz",
                                                                       "x-goog-api-key": "pl-fuzz"})
    served = {"choices": 0}
    before = fuzz_lab.store.num_calls

    @settings(max_examples=EXAMPLES_PER_SURFACE, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies)
    def check(body):
        r = client.post(path, json=body)
        assert r.status_code < 500, (r.status_code, body, r.text[:500])
        if r.status_code >= 400:
            assert _error_shaped(api, r.json()), (body, r.text[:500])
        else:
            served["choices"] += max(1, body.get("n", 1) if api == "openai.chat" and isinstance(body.get("n"), int)
                                     and not isinstance(body.get("n"), bool) else 1)

    try:
        check()
    finally:
        client.close()
    records = [c for c in load_calls(fuzz_lab.run_dir)][before:]
    assert len(records) == fuzz_lab.store.num_calls - before == served["choices"]  # whole lines, one per choice
