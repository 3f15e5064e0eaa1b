"""Token streaming on the real engine (issue 17): each official SDK's streaming API receives deltas while the engine
is still sampling, what it streamed is what the call recorded, and a client that disconnects mid-stream has its
request aborted in the engine and its partial call recorded once, marked "abort", while the Lab keeps serving.

The timing claim is relative (first delta before half the stream's time) on a 64-token generation that cannot end
early (ignore_eos forced by the session), so it holds on a slow machine as on a fast one; a proxy that waits for the
whole generation and then replays it sends its first delta after ~100% of the time."""

import time
from pathlib import Path

import httpx
import orjson
import pytest

from polar_lab import SamplingSpec
from tests.conftest import session_calls

TINY = "data/models/tiny-calc"
QWEN35 = Path("data/models/tiny-calc-qwen35")
N = 64  # tokens per streamed generation


@pytest.fixture(scope="module")
def lab(engines, tmp_path_factory):
    with engines.lab(TINY, runs_dir=str(tmp_path_factory.mktemp("runs")), run_name="streaming") as lab:
        # an engine's first request with logprobs pays a one-time setup (ENV.md: ~0.45 s cold), which would land in the
        # first test's time to first delta: paid here, so the timing tests measure streaming, not a cold engine
        lab.engine.submit(lab.tokenizer("warm up")["input_ids"], SamplingSpec(max_tokens=4)).result(timeout=300)
        yield lab


def fixed_length(lab, seed=3):
    return lab.session(sampling={"ignore_eos": True, "max_tokens": N, "seed": seed})


def timed(t0, events, text_of, at_first=lambda: None):
    """(seconds from t0 to the first non-empty delta, to the end, the deltas joined, what `at_first()` said when the
    first delta arrived)."""
    first, parts, seen = None, [], None
    for event in events:
        text = text_of(event)
        if text:
            if first is None:
                first, seen = time.perf_counter() - t0, at_first()
            parts.append(text)
    return first, time.perf_counter() - t0, "".join(parts), seen


def openai_chat(s, at_first=lambda: None):
    import openai

    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key, max_retries=0)
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model="tiny-calc", messages=[{"role": "user", "content": "What is 2+3?"}],
                                            stream=True)
    return timed(t0, stream, lambda c: c.choices[0].delta.content if c.choices else None, at_first)


def openai_responses(s, at_first=lambda: None):
    import openai

    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key, max_retries=0)
    t0 = time.perf_counter()
    stream = client.responses.create(model="tiny-calc", input="What is 2+3?", stream=True)
    return timed(t0, stream, lambda e: e.delta if e.type == "response.output_text.delta" else None, at_first)


def anthropic_messages(s, at_first=lambda: None):
    import anthropic

    client = anthropic.Anthropic(base_url=s.anthropic_base_url, api_key=s.key, max_retries=0)
    t0 = time.perf_counter()
    stream = client.messages.create(model="tiny-calc", max_tokens=N, stream=True,
                                    messages=[{"role": "user", "content": "What is 2+3?"}])
    return timed(t0, stream, lambda e: e.delta.text if e.type == "content_block_delta" and
                               e.delta.type == "text_delta" else None, at_first)


def google_genai(s, at_first=lambda: None):
    from google import genai
    from google.genai import types

    client = genai.Client(api_key=s.key, http_options=types.HttpOptions(base_url=s.google_base_url))
    t0 = time.perf_counter()
    stream = client.models.generate_content_stream(model="tiny-calc", contents="What is 2+3?")
    return timed(t0, stream, lambda c: "".join(p.text or "" for p in c.candidates[0].content.parts or []), at_first)


SDKS = {"openai.chat": openai_chat, "openai.responses": openai_responses, "anthropic": anthropic_messages,
        "google": google_genai}


@pytest.mark.parametrize("api", list(SDKS))
def test_each_sdk_receives_tokens_while_they_are_sampled_and_they_are_the_record(lab, api):
    """Ordered, not timed: when the client has its first text, the engine is still sampling the call (it runs it) and
    the call is not recorded yet (a call is recorded once its generation ends). A proxy that waits for the whole
    generation and replays it hands the first text over after both."""
    s = fixed_length(lab)
    first, total, streamed, (running, recorded) = SDKS[api](s, lambda: (lab.engine.running, len(session_calls(lab, s))))
    (call,) = session_calls(lab, s)
    assert len(call.output_ids) == N and call.finish_reason == "length"
    assert first is not None and running == 1 and recorded == 0, (running, recorded)
    # the record says when the proxy handed the first text over: after the request left, before the client had it
    assert 0 < call.timings["first_delta_s"] <= first
    assert call.parse["has_reasoning"] is False and call.parse["num_tool_calls"] == 0
    assert streamed == lab.tokenizer.decode(call.output_ids, skip_special_tokens=True)
    assert "stream_diverged" not in call.render


# Each SDK's usage of one call, streamed (where that API puts it in its events) and whole: (streamed, whole), as the
# SDK parsed them. Anthropic's is the `message_delta` event's (cumulative: frameworks read input tokens there).
def _chat_usage(s, **kw):
    import openai

    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key, max_retries=0)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    return chunks[-1].usage.model_dump(), client.chat.completions.create(**kw).usage.model_dump()


def _responses_usage(s, *, messages, **kw):
    import openai

    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key, max_retries=0)
    kw["input"] = messages[0]["content"]
    (done,) = [e for e in client.responses.create(stream=True, **kw)
               if e.type in ("response.completed", "response.incomplete")]  # incomplete: cut at max tokens
    return done.response.usage.model_dump(), client.responses.create(**kw).usage.model_dump()


def _anthropic_usage(s, **kw):
    import anthropic

    client = anthropic.Anthropic(base_url=s.anthropic_base_url, api_key=s.key, max_retries=0)
    events = list(client.messages.create(stream=True, max_tokens=N, **kw))
    (start,) = [e for e in events if e.type == "message_start"]
    (delta,) = [e for e in events if e.type == "message_delta"]
    assert start.message.usage.input_tokens == delta.usage.input_tokens  # known from the start, as Anthropic's
    return delta.usage.model_dump(), client.messages.create(max_tokens=N, **kw).usage.model_dump()


def _google_usage(s, *, messages, **kw):
    from google import genai
    from google.genai import types

    client = genai.Client(api_key=s.key, http_options=types.HttpOptions(base_url=s.google_base_url))
    chunks = list(client.models.generate_content_stream(model="tiny-calc", contents=messages[0]["content"]))
    whole = client.models.generate_content(model="tiny-calc", contents=messages[0]["content"])
    return chunks[-1].usage_metadata.model_dump(), whole.usage_metadata.model_dump()


USAGE = {"openai.chat": _chat_usage, "openai.responses": _responses_usage, "anthropic": _anthropic_usage,
         "google": _google_usage}
# fields about what this proxy does not have (server tools, tool-use prompts, regions, tiers of speed or traffic)
NOT_HERE = {"server_tool_use", "inference_geo", "speed", "tool_use_prompt_token_count",
            "tool_use_prompt_tokens_details", "traffic_type"}
CACHE = {"cached_tokens", "cached_content_token_count", "cache_tokens_details"}  # the engine's prefix-cache hits


def _flat(usage, prefix=""):
    """{dotted field: value} of a usage object, nested objects and lists of modality counts opened."""
    out = {}
    for key, value in usage.items():
        if key in NOT_HERE:
            continue
        if isinstance(value, dict):
            out.update(_flat(value, prefix + key + "."))
        elif isinstance(value, list):
            out.update(_flat({str(i): v for i, v in enumerate(value)}, prefix + key + "."))
        else:
            out[prefix + key] = value
    return out


def _by_name(flat):
    return {k.replace("_", "").lower(): v for k, v in flat.items()}


@pytest.mark.parametrize("api", list(USAGE))
def test_streamed_usage_fills_every_field_as_the_whole_call_does(lab, api):
    """The usage a streamed call reports in its events has every field its API defines, equal to the same call's
    non-streamed figures (its recorded body) and to a non-streamed twin's; only the prefix-cache hits may differ
    between the twins (the second finds the first's prompt cached)."""
    s = fixed_length(lab, seed=13)
    streamed, whole = USAGE[api](s, model="tiny-calc", messages=[{"role": "user", "content": "What is 2+3?"}])
    first, second = session_calls(lab, s)
    recorded = first.response.get("usage") or first.response.get("usageMetadata")
    missing = [k for k, v in _flat(streamed).items() if v is None]
    assert not missing, f"streamed usage leaves {missing} empty"
    got, kept = _by_name(_flat(streamed)), _by_name(_flat(recorded))  # the SDK's names against the wire's
    assert got == {k: kept.get(k) for k in got}
    differ = {k for k, v in _flat(streamed).items() if _flat(whole).get(k) != v}
    assert all(k.split(".")[-1] in CACHE or k.split(".")[0] in CACHE for k in differ), differ
    prompt = len(first.prompt_ids)
    assert prompt == len(second.prompt_ids) and len(first.output_ids) == len(second.output_ids) == N
    assert prompt in _flat(streamed).values() and N in _flat(streamed).values()


def test_a_client_that_disconnects_mid_stream_aborts_its_request_and_its_partial_call_is_recorded_once(lab):
    s = lab.session(sampling={"ignore_eos": True, "seed": 5})
    max_tokens = lab.engine.max_model_len - 64  # minutes of work if nothing stops it
    body = {"messages": [{"role": "user", "content": "Count."}], "stream": True, "max_tokens": max_tokens}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", s.openai_base_url + "/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {s.key}"}) as r:
            assert r.status_code == 200
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 20:
                    break
            assert lab.engine.running == 1
        t_close = time.perf_counter()  # leaving the block closed the connection
    while lab.engine.running and time.perf_counter() - t_close < 30:
        time.sleep(0.02)
    stopped_after = time.perf_counter() - t_close
    assert lab.engine.running == 0, f"the engine still sampled {stopped_after:.0f} s after the client left"
    deadline = time.monotonic() + 10
    while not session_calls(lab, s) and time.monotonic() < deadline:
        time.sleep(0.05)
    (call,) = session_calls(lab, s)
    assert call.finish_reason == "abort" and call.render.get("stream_aborted") is True
    # sampled on for a few steps after the close at most, not to max_tokens (tens of thousands of tokens away)
    assert 20 <= len(call.output_ids) < max_tokens // 4 and len(call.output_logprobs) == len(call.output_ids)
    on_disk = [orjson.loads(line) for line in (Path(lab.run_dir) / "calls.jsonl").read_bytes().splitlines()]
    assert sum(c["session_id"] == s.id for c in on_disk) == 1
    # the Lab keeps serving, and the next call of that session starts from its prompt, not from the cut turn
    r = httpx.post(s.openai_base_url + "/chat/completions", headers={"Authorization": f"Bearer {s.key}"},
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and lab.engine.running == 0


def _open_stream(s, body, *, rcvbuf=None):
    """A raw HTTP/1.1 streamed request on a socket the test controls (it can read nothing at all)."""
    import socket

    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # a reader with almost no room
    host, port = s.openai_base_url.split("//")[1].split("/")[0].split(":")
    sock.connect((host, int(port)))
    data = orjson.dumps(body)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + s.key.encode() + b"\r\nContent-Length: " + str(len(data)).encode()
                 + b"\r\n\r\n" + data)
    return sock


def test_a_reader_that_reads_nothing_holds_up_no_one_and_gets_every_event_later(lab):
    """On the real engine: the call is recorded, another session is served meanwhile as usual, and the events are
    all there when the reader finally reads. (The socket buffers absorb this stream; a reader whose buffers are
    full is driven directly in tests/proxy/test_http_errors.py.)"""
    s = lab.session(sampling={"ignore_eos": True, "seed": 9})
    sock = _open_stream(s, {"messages": [{"role": "user", "content": "Count."}], "stream": True, "max_tokens": 300},
                        rcvbuf=4096)
    try:
        other = lab.session()
        deadline = time.monotonic() + 120
        while not session_calls(lab, s) and time.monotonic() < deadline:
            r = httpx.post(other.openai_base_url + "/chat/completions", headers={"Authorization": f"Bearer {other.key}"},
                           json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}, timeout=30)
            assert r.status_code == 200
        (call,) = session_calls(lab, s)  # recorded while its reader has read nothing
        assert call.finish_reason == "length" and len(call.output_ids) == 300
        assert len(session_calls(lab, other)) >= 1
        sock.settimeout(30)
        received = b""
        while b"[DONE]" not in received:
            chunk = sock.recv(1 << 16)
            assert chunk, "the stream ended before its last event"
            received += chunk
    finally:
        sock.close()
    streamed = "".join(orjson.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in received.split(b"\n") if line.startswith(b"data: {") and b'"choices":[{' in line)
    assert streamed == (call.response["choices"][0]["message"]["content"] or "")


@pytest.mark.parametrize("pause", ["drain", "keep"])
def test_a_sync_during_a_stream_drains_it_or_holds_it_and_it_goes_on_with_new_weights(lab, shipped_weights, pause):
    """drain: streams drain like any call — the sync loads only after the streamed generation ended, so every one of
    its tokens is the old version's. keep (vLLM's pause_generation(mode="keep")): no drain — the sync loads while the
    stream is under way, the engine holds the call between two steps, and its later tokens are the new version's.
    Each mode is the other's control."""
    import threading

    s = lab.session(sampling={"ignore_eos": True, "seed": 11})
    version, tokens = lab.engine.policy_version, {"drain": 400, "keep": 1500}[pause]
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", s.openai_base_url + "/chat/completions", json={
                "messages": [{"role": "user", "content": "Count."}], "stream": True, "max_tokens": tokens},
                headers={"Authorization": f"Bearer {s.key}"}) as r:
            lines = r.iter_lines()
            next(lines)  # the stream is under way
            synced = {}
            sync = threading.Thread(target=lambda: synced.update(
                result=lab.sync_weights(shipped_weights, pause=pause)))
            sync.start()
            for _ in lines:
                pass
    sync.join(120)
    (call,) = session_calls(lab, s)
    versions = call.output_versions
    assert synced["result"].policy_version == version + 1 and len(versions) == tokens
    if pause == "drain":
        assert synced["result"].undrained == 0 and set(versions) == {version}
    else:
        assert versions[0] == version and versions[-1] == version + 1 and versions == sorted(versions)


@pytest.fixture(scope="module")
def qwen35(engines, tmp_path_factory):
    if not (QWEN35 / "model.safetensors").exists():
        pytest.skip("run `python scripts/build_tiny_model.py --family qwen35`")
    with engines.lab(QWEN35, runs_dir=str(tmp_path_factory.mktemp("runs")), run_name="qwen35") as lab:
        yield lab


def test_thoughts_and_tool_calls_stream_through_vllms_parsers_as_the_record_reads_them(qwen35):
    """Qwen3.5's template opens a thought and its calls are XML (vLLM's qwen3_coder parser): the thought streams
    as reasoning within the first half of the stream's time, and the streamed calls are the recorded calls, ids
    included."""
    import openai

    from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT

    seen = 0
    for seed in range(6):
        s = qwen35.session(sampling={"seed": seed, "max_tokens": 128})
        client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key, max_retries=0)
        stream = client.chat.completions.create(
            model="m", stream=True, tools=[CALC_TOOL],
            messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What is 12*7+5?"}])
        reasoning, content, calls, first_thought = "", "", {}, None
        t0 = time.perf_counter()
        for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is None:
                continue
            if (delta.model_extra or {}).get("reasoning_content"):
                reasoning += delta.model_extra["reasoning_content"]
                first_thought = first_thought if first_thought is not None else time.perf_counter() - t0
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                calls[tc.index] = (tc.id, tc.function.name, tc.function.arguments)
        (call,) = session_calls(qwen35, s)
        message = call.response["choices"][0]["message"]
        assert reasoning == (message.get("reasoning_content") or "")
        assert content == (message.get("content") or "")
        assert [calls[k] for k in sorted(calls)] == [(tc["id"], tc["function"]["name"], tc["function"]["arguments"])
                                                     for tc in message.get("tool_calls") or []]
        assert "stream_diverged" not in call.render
        total = time.perf_counter() - t0
        seen += bool(calls) and first_thought is not None and first_thought < 0.5 * total
    assert seen >= 3, "too few generations whose thought streamed in the first half and that then called"
