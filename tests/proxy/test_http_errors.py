"""The HTTP layer over a scripted engine: auth, error shapes, streaming shape, request options.

These use real HTTP (uvicorn) and the real store; only the engine is scripted. The same behaviours
are checked against real vLLM in tests/integration/.
"""

import httpx
import openai
import pytest

from tests.shapes import SURFACES, provider_error


def _post(lab, path, body=None, *, content=None, key=None, headers=None):
    headers = dict(headers or {})
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(lab.url + path, json=body, content=content, headers=headers, timeout=30)


def _assert_openai_error(r, status, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("key", [None, "", "pl-not-a-real-key"])
def test_unknown_or_missing_key_is_401(scripted_lab, key):
    r = _post(scripted_lab, "/v1/chat/completions", {"messages": MSG}, key=key)
    _assert_openai_error(r, 401, "invalid_api_key")
    assert scripted_lab.writer.num_calls == 0


@pytest.mark.parametrize("content, needle", [
    (b"{not json", "parse the JSON"),                      # malformed JSON
    (b"[1, 2]", "JSON object"),                            # JSON, but not an object
    (b'{"model": "x"}', "messages"),                       # missing required field
    (b'{"messages": []}', "messages"),                     # empty conversation
    (b'{"messages": [{"role": "wizard", "content": "x"}]}', "role"),   # unknown role
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 7}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', "n"),
])
def test_bad_bodies_are_400_in_openai_shape(scripted_lab, content, needle):
    s = scripted_lab.session()
    r = _post(scripted_lab, "/v1/chat/completions", content=content, key=s.key,
              headers={"content-type": "application/json"})
    _assert_openai_error(r, 400)
    assert needle in r.json()["error"]["message"]


def test_named_tool_choice_must_name_a_given_tool(scripted_lab):
    s = scripted_lab.session()
    body = {"messages": MSG, "tools": [{"type": "function", "function": {"name": "a"}}],
            "tool_choice": {"type": "function", "function": {"name": "b"}}}
    r = _post(scripted_lab, "/v1/chat/completions", body, key=s.key)
    _assert_openai_error(r, 400)
    assert r.json()["error"]["param"] == "tool_choice"


def test_body_over_the_cap_is_413(scripted_lab):
    s = scripted_lab.session()
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * (33 * 1024 * 1024) + b'"}]}'
    r = _post(scripted_lab, "/v1/chat/completions", content=big, key=s.key)
    _assert_openai_error(r, 413, "request_too_large")


def test_unknown_route_is_404_in_openai_shape(scripted_lab):
    _assert_openai_error(httpx.get(scripted_lab.url + "/v1/nope"), 404)


def test_key_in_path_or_bearer_both_authenticate(scripted_lab):
    s = scripted_lab.session()
    by_path = openai.OpenAI(base_url=s.openai_base_url, api_key="anything")
    by_bearer = openai.OpenAI(base_url=scripted_lab.url + "/v1", api_key=s.key)
    for client in (by_path, by_bearer):
        assert client.chat.completions.create(model="m", messages=MSG).choices[0].message.content == "Hello there."
    assert scripted_lab.calls().session_id.tolist() == [s.id, s.id]


def test_streaming_chunks_reassemble_to_the_non_streaming_answer(scripted_lab):
    s = scripted_lab.session()
    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key)
    chunks = list(client.chat.completions.create(model="m", messages=MSG, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there."
    assert chunks[-1].usage.completion_tokens == len(scripted_lab.call_records()[-1].output_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_a_stream_of_n_choices_carries_each_choice_as_recorded(scripted_lab):
    scripted_lab.engine.replies = ["Hello there.", "Goodbye now, friend."]
    s = scripted_lab.session()
    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key)
    chunks = list(client.chat.completions.create(model="m", messages=MSG, stream=True, n=2, seed=0))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    records = sorted(scripted_lab.call_records(), key=lambda c: c.choice_index)
    assert texts == {r.choice_index: r.response["choices"][r.choice_index]["message"]["content"] for r in records}
    assert texts[0] != texts[1]
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1]


def test_n_choices_are_recorded_one_per_choice(scripted_lab):
    s = scripted_lab.session()
    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key)
    reply = client.chat.completions.create(model="m", messages=MSG, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    calls = scripted_lab.call_records()
    assert [c.choice_index for c in calls] == [0, 1, 2] and len({c.request_id for c in calls}) == 1


def test_max_tokens_beyond_the_context_is_clipped_not_refused(scripted_lab):
    s = scripted_lab.session()
    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key)
    client.chat.completions.create(model="m", messages=MSG, max_tokens=10**6)
    (call,) = scripted_lab.call_records()
    assert call.sampling["max_tokens"] == scripted_lab.engine.max_model_len - len(call.prompt_ids)


@pytest.mark.parametrize("api", list(SURFACES))
def test_engine_failure_is_503_in_each_apis_shape_and_the_proxy_keeps_serving(scripted_lab, api):
    s = scripted_lab.session()
    path, body = SURFACES[api]
    headers = {"x-api-key": s.key, "x-goog-api-key": s.key}
    scripted_lab.engine.fail_with = RuntimeError("boom")
    r = _post(scripted_lab, path, body, key=s.key, headers=headers)
    assert r.status_code == 503 and "boom" in provider_error(api, r)
    error = r.json()["error"]
    if api == "anthropic.messages":
        assert error["type"] == "overloaded_error"  # what the SDK retries
    elif api == "google.generate_content":
        assert error["status"] == "UNAVAILABLE"
    else:
        assert error["type"] == "server_error" and error["code"] == "engine_unavailable"
    scripted_lab.engine.fail_with = None
    assert _post(scripted_lab, path, body, key=s.key, headers=headers).status_code == 200


def test_the_proxy_binds_loopback_by_default(scripted_lab):
    from polar_lab.config import ProxyConfig

    assert ProxyConfig().host == "127.0.0.1" and scripted_lab.url.startswith("http://127.0.0.1:")


def test_a_sync_whose_drain_times_out_loads_anyway_and_says_so(scripted_lab):
    import threading

    lab = scripted_lab
    lab.engine.delay_s = 1.5  # a call that outlives the drain timeout
    s = lab.session()
    answered = []
    call = threading.Thread(target=lambda: answered.append(
        _post(lab, "/v1/chat/completions", {"messages": MSG}, key=s.key).status_code))
    call.start()
    while lab.proxy_state["in_flight"] == 0:
        pass
    sync = lab.sync_weights({}, drain_timeout=0.1)
    call.join()
    assert sync.undrained == 1 and sync.policy_version == 1 and sync.drain_s < 1.0  # it did not wait 1.5 s
    assert answered == [200] and lab.proxy_state["undrained"] == 1


def test_health_and_models(scripted_lab):
    assert httpx.get(scripted_lab.url + "/health").json()["status"] == "ok"
    s = scripted_lab.session()
    models = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key).models.list()
    assert [m.id for m in models.data] == ["scripted"]


@pytest.mark.parametrize("path,body", [  # found by tests/proxy/test_fuzz.py: these were 500s
    ("/v1/responses", {"input": [{"role": "system", "content": [None]}]}),
    ("/v1/responses", {"input": [{"role": "user", "content": 7}]}),
])
def test_malformed_items_are_400_and_the_connection_stays_usable(scripted_lab, path, body):
    s = scripted_lab.session()
    with httpx.Client(base_url=scripted_lab.url, headers={"Authorization": f"Bearer {s.key}"}) as client:
        _assert_openai_error(client.post(path, json=body), 400)
        # a 500 used to make the server drop the keep-alive connection under the next request
        assert client.post("/v1/chat/completions", json={"messages": MSG}).status_code == 200


def test_a_client_that_hangs_up_mid_stream_leaves_one_record_and_a_serving_proxy(scripted_lab):
    s = scripted_lab.session()
    scripted_lab.engine.replies = ["word " * 200]
    with httpx.stream("POST", scripted_lab.url + "/v1/chat/completions", timeout=30,
                      json={"messages": MSG, "stream": True}, headers={"Authorization": f"Bearer {s.key}"}) as r:
        next(r.iter_bytes())  # one chunk, then hang up
    assert _post(scripted_lab, "/v1/chat/completions", {"messages": MSG}, key=s.key).status_code == 200
    calls = scripted_lab.call_records()
    assert [c.call_index for c in calls] == [0, 1]  # the abandoned stream's call is recorded exactly once


def test_one_sessions_key_cannot_write_into_another(scripted_lab):
    a, b = scripted_lab.session(), scripted_lab.session()
    # key A in the path wins over key B in the header: the call is A's, and only A's
    r = httpx.post(f"{a.openai_base_url}/chat/completions", json={"messages": MSG},
                   headers={"Authorization": f"Bearer {b.key}"}, timeout=30)
    assert r.status_code == 200
    assert scripted_lab.calls().session_id.tolist() == [a.id]
    # a key that is a prefix or a near miss of a real one is just unknown
    for guess in (a.key[:-1], a.key + "x", a.key.upper(), a.id):
        _assert_openai_error(_post(scripted_lab, "/v1/chat/completions", {"messages": MSG}, key=guess), 401)


@pytest.mark.parametrize("stream", [False, True])
def test_no_answer_leaves_before_its_record_is_written(scripted_lab, monkeypatch, stream):
    """Not a byte of a JSON answer; of a stream, the tokens may go ahead, but not its end (the finish reason,
    [DONE]) while the record is being written."""
    import select
    import socket
    import threading

    import orjson

    s = scripted_lab.session()
    writing, release = threading.Event(), threading.Event()
    append = scripted_lab.writer.append_call

    def held_append(call):  # the record's write, held until the test lets it go
        writing.set()
        release.wait(30)
        append(call)

    monkeypatch.setattr(scripted_lab.writer, "append_call", held_append)
    body = orjson.dumps({"messages": MSG, "stream": stream})
    with socket.create_connection(("127.0.0.1", scripted_lab.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + s.key.encode() + b"\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert writing.wait(30), "the call never reached the store"
        early = b""
        while select.select([sock], [], [], 1.0)[0]:
            chunk = sock.recv(65536)
            early += chunk
            if not chunk:
                break
        if stream:
            assert b'"finish_reason":"stop"' not in early and b"[DONE]" not in early, \
                "the stream ended before the call was recorded"
        else:
            assert not early, "response bytes left the proxy before the call was recorded"
        release.set()
        answer = early + sock.recv(65536)
        while stream and b"[DONE]" not in answer:
            answer += sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200") and scripted_lab.writer.num_calls == 1


def test_a_record_that_cannot_be_written_is_an_error_to_the_caller_not_an_answer(scripted_lab, monkeypatch):
    from polar_lab.errors import StoreError

    def failing_append(call):
        raise StoreError("disk full")

    monkeypatch.setattr(scripted_lab.writer, "append_call", failing_append)
    s = scripted_lab.session()
    r = _post(scripted_lab, "/v1/chat/completions", {"messages": MSG}, key=s.key)
    _assert_openai_error(r, 500)
    assert "disk full" in r.json()["error"]["message"] and "choices" not in r.text


def test_a_streamed_call_is_recorded_when_generated_even_if_its_reader_takes_nothing(scripted_lab):
    """The stream's ASGI response driven directly, with a `send` that never returns (a reader whose socket
    buffers are full): the call is still recorded once its generation ends, and the stream keeps its events."""
    import asyncio

    from polar_lab.proxy import streaming
    from polar_lab.proxy.apis.openai_chat import ChatCompletionRequest, ChatStream, build_response, to_canonical

    service, session = scripted_lab.service, scripted_lab.session()
    body = ChatCompletionRequest.model_validate({"messages": MSG, "stream": True})

    async def scenario():
        stream = await streaming.respond(
            service, session, to_canonical(body), {"messages": MSG}, body, api="openai.chat", inline=True,
            build=lambda call, req, b: build_response(call, req, service.renderer.tokenizer),
            writer=lambda p, b: ChatStream(p, b, "scripted", 0))
        stuck = asyncio.Event()

        async def send(message):
            if message["type"] == "http.response.body":
                await stuck.wait()  # never set: not one event is taken

        async def receive():
            await stuck.wait()
            return {"type": "http.disconnect"}

        serving = asyncio.create_task(stream({"type": "http"}, receive, send))
        for _ in range(200):
            if service.store.num_calls:
                break
            await asyncio.sleep(0.01)
        recorded, waiting = service.store.num_calls, b"".join(stream.queued)
        serving.cancel()
        return recorded, waiting

    recorded, waiting = scripted_lab.submit(scenario()).result(30)
    assert recorded == 1 and b"[DONE]" in waiting  # recorded, and its end waits for the reader
    (call,) = scripted_lab.call_records()
    assert call.finish_reason == "stop" and call.session_id == session.id
