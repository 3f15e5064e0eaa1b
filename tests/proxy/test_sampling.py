"""The validated sampling boundary: every value that could reach vLLM is checked, on every surface, with the
provider's 400 naming the provider's own field; a 500 leaves the keep-alive connection usable.

Scripted engine (the HTTP layer is under test); the same bodies go through the real engine in
tests/integration/test_fuzz_real_engine.py.
"""

import socket

import httpx
import orjson
import pytest

from polar_lab.errors import SamplingError
from polar_lab.types import INT64_MAX, INT64_MIN, SamplingSpec
from tests.shapes import provider_error, with_sampling

# (surface, sampling fields, the field the 400 must name) — the first five were seen killing the real engine or
# giving 500s before this boundary existed
BAD = [
    ("google.generate_content", {"maxOutputTokens": 8, "seed": {"a": 1}}, "generationConfig.seed"),
    ("openai.chat", {"seed": "99999999999999999999999"}, "seed"),
    ("google.generate_content", {"maxOutputTokens": "8"}, "generationConfig.maxOutputTokens"),
    ("google.generate_content", {"maxOutputTokens": [8]}, "generationConfig.maxOutputTokens"),
    ("openai.responses", {"max_output_tokens": 99999999999999999999999}, "max_output_tokens"),
    # integers: beyond 64 bits, a float, a boolean, a numeric string, below the range
    ("openai.chat", {"seed": INT64_MAX + 1}, "seed"),
    ("openai.chat", {"seed": INT64_MIN - 1}, "seed"),
    ("openai.chat", {"max_tokens": 8.0}, "max_tokens"),
    ("openai.chat", {"max_completion_tokens": True}, "max_completion_tokens"),
    ("openai.chat", {"n": "2"}, "n"),
    ("openai.chat", {"n": 129}, "n"),
    ("openai.chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("openai.chat", {"logprobs": "yes"}, "logprobs"),
    ("openai.chat", {"top_k": -2}, "top_k"),
    ("openai.responses", {"seed": 1.5}, "seed"),
    ("anthropic.messages", {"max_tokens": 0}, "max_tokens"),
    ("anthropic.messages", {"top_k": -1}, "top_k"),
    ("google.generate_content", {"seed": INT64_MAX + 1}, "generationConfig.seed"),
    ("google.generate_content", {"topK": 2.5}, "generationConfig.topK"),
    ("google.generate_content", {"candidateCount": 129}, "generationConfig.candidateCount"),
    ("google.generate_content", {"max_output_tokens": "8"}, "generationConfig.max_output_tokens"),  # proto name
    # floats: out of range, not a number
    ("openai.chat", {"temperature": 2.5}, "temperature"),
    ("openai.chat", {"temperature": "0.5"}, "temperature"),
    ("openai.chat", {"top_p": 0}, "top_p"),
    ("openai.chat", {"frequency_penalty": 3}, "frequency_penalty"),
    ("openai.responses", {"top_p": [0.5]}, "top_p"),
    ("anthropic.messages", {"temperature": 1.5}, "temperature"),  # Anthropic's range is [0, 1]
    ("google.generate_content", {"temperature": -0.1}, "generationConfig.temperature"),
    ("google.generate_content", {"presencePenalty": 1e308}, "generationConfig.presencePenalty"),
    # stop: bounded lists of strings
    ("openai.chat", {"stop": [1]}, "stop"),
    ("openai.chat", {"stop": ["x"] * 17}, "stop"),
    ("anthropic.messages", {"stop_sequences": ["a" * 1001]}, "stop_sequences"),
    ("google.generate_content", {"stopSequences": "x"}, "generationConfig.stopSequences"),
]


@pytest.mark.parametrize("api, fields, field", BAD, ids=[f"{a}-{f}" for a, _, f in BAD])
def test_a_bad_sampling_value_is_the_providers_400_naming_the_field(scripted_lab, api, fields, field):
    engine = scripted_lab.engine
    s = scripted_lab.session()
    path, body = with_sampling(api, fields)
    prompts = len(engine.prompts)
    r = httpx.post(scripted_lab.url + path, json=body, headers={"x-api-key": s.key, "x-goog-api-key": s.key,
                                                               "Authorization": f"Bearer {s.key}"}, timeout=30)
    assert r.status_code == 400, r.text
    assert field in provider_error(api, r)
    assert len(engine.prompts) == prompts and scripted_lab.writer.num_calls == 0  # it never reached the engine


# values at the edges that every provider takes, and the engine gets exactly
GOOD = [
    ("openai.chat", {"temperature": 0, "seed": INT64_MIN, "max_tokens": 2}, {"temperature": 0, "seed": INT64_MIN}),
    ("openai.chat", {"seed": INT64_MAX, "n": 2, "max_tokens": 2}, {"seed": INT64_MAX}),
    ("openai.chat", {"stop": "", "top_k": 0, "max_tokens": 2}, {"stop": (), "top_k": -1}),
    ("openai.responses", {"temperature": 2, "top_p": 1, "max_output_tokens": 2}, {"temperature": 2, "top_p": 1}),
    ("anthropic.messages", {"top_k": 0, "stop_sequences": ["", "END"]}, {"top_k": -1, "stop": ("END",)}),
    ("google.generate_content", {"topK": 40.0, "max_output_tokens": 2}, {"top_k": 40, "max_tokens": 2}),
    ("google.generate_content", {"maxOutputTokens": 3, "seed": -2}, {"max_tokens": 3, "seed": -2}),
    ("openai.responses", {"seed": -1}, {"seed": None}),  # vLLM reads -1 as "unseeded": the record says so
]


@pytest.mark.parametrize("api, fields, expected", GOOD, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(GOOD)])
def test_edge_values_are_taken_and_reach_the_engine_as_sent(scripted_lab, api, fields, expected):
    s = scripted_lab.session()
    path, body = with_sampling(api, fields)
    r = httpx.post(scripted_lab.url + path, json=body, headers={"x-api-key": s.key, "x-goog-api-key": s.key,
                                                               "Authorization": f"Bearer {s.key}"}, timeout=30)
    assert r.status_code == 200, r.text
    calls = [c for c in scripted_lab.call_records() if c.session_id == s.id]
    sampled = calls[0].sampling
    assert {k: sampled[k] for k in expected} == {k: list(v) if isinstance(v, tuple) else v
                                                 for k, v in expected.items()}
    if fields.get("n") == 2:  # choice 1 uses seed + 1, wrapped into the 64-bit range the sampler takes
        assert calls[1].sampling["seed"] == INT64_MIN


@pytest.mark.parametrize("fields", [
    {"max_tokens": 0}, {"max_tokens": True}, {"seed": INT64_MAX + 1}, {"seed": {"a": 1}}, {"temperature": float("nan")},
    {"temperature": 2.01}, {"top_p": 0.0}, {"top_k": -2}, {"top_k": 1.0}, {"stop": ("",)}, {"stop": (1,)},
    {"stop": ("x",) * 17}, {"num_logprobs": 21}, {"ignore_eos": 1},
])
def test_no_sampling_spec_outside_the_engines_bounds_can_exist(fields):
    with pytest.raises(SamplingError) as err:
        SamplingSpec(**{"max_tokens": 4, **fields})
    assert err.value.param == next(iter(fields)) and err.value.status == 400


def test_a_sessions_forced_sampling_is_checked_when_the_session_is_made(scripted_lab):
    with pytest.raises(SamplingError, match="seed"):
        scripted_lab.session(sampling={"seed": "7"})
    with pytest.raises(SamplingError, match="max_tokens"):
        scripted_lab.session(sampling={"max_tokens": 0})


def _http(sock: socket.socket, body: bytes, key: str) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 request on an open socket; the status line, headers and body of the answer."""
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock)
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(rest) < int(headers["content-length"]):
        rest += _recv(sock)
    return int(lines[0].split()[1]), headers, rest


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    if not chunk:
        raise ConnectionError("the server closed the connection")
    return chunk


def test_a_500_is_in_the_callers_shape_and_the_connection_stays_usable(scripted_lab):
    s = scripted_lab.session()
    body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    with socket.create_connection(("127.0.0.1", scripted_lab.port), timeout=30) as sock:
        scripted_lab.engine.raise_with = ZeroDivisionError("a bug in the engine layer")
        try:
            status, headers, payload = _http(sock, body, s.key)
        finally:
            scripted_lab.engine.raise_with = None
        assert status == 500 and headers.get("connection") != "close"
        err = orjson.loads(payload)["error"]
        assert err["type"] == "server_error" and "ZeroDivisionError" in err["message"]
        status, _, payload = _http(sock, body, s.key)  # the same connection, the next request
    assert status == 200 and orjson.loads(payload)["object"] == "chat.completion"


@pytest.mark.parametrize("kind, bad, good", [
    ("Temperature", [-0.01, float("nan"), float("inf")], [0.0, 2.0]),
    ("AnthropicTemperature", [1.01, -0.5], [0.0, 1.0]),
    ("TopP", [0.0, 1.01, float("nan")], [1e-9, 1.0]),
    ("Penalty", [-2.01, 2.01], [-2.0, 2.0]),
    ("WholeTopK", [-1, -1.0, 2.0**53 + 2], [0, 40, 40.0]),
])
def test_each_sampling_type_holds_its_bounds(kind, bad, good):
    from pydantic import TypeAdapter, ValidationError

    from polar_lab.proxy import sampling

    adapter = TypeAdapter(getattr(sampling, kind))
    for value in good:
        assert adapter.validate_python(value) == value
    for value in bad:
        with pytest.raises(ValidationError):
            adapter.validate_python(value)


def test_stop_and_whole_numbers_as_the_engine_takes_them():
    from polar_lab.errors import RequestError
    from polar_lab.proxy.sampling import stop_tuple, whole

    assert stop_tuple("ab") == ("ab",) and stop_tuple(["x", "", "y"]) == ("x", "y") and stop_tuple(None) == ()
    assert whole(40.0, param="topK") == 40 and whole(None, param="topK") is None
    with pytest.raises(RequestError, match="topK must be a whole number, got 2.5") as caught:
        whole(2.5, param="topK")
    assert caught.value.param == "topK"
