"""Attribution for shared-client frameworks: one Lab-level key, each request naming its session (X-Session-ID, a
body field). Real HTTP and store over a scripted engine; tests/integration/test_nemo_gym.py runs it for real."""

import json

import httpx
import pytest

from polar_lab import Lab
from polar_lab.engine import ScriptedEngine
from polar_lab.errors import ConfigError
from tests.conftest import session_calls

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture
def shared_lab(request, model_path, tokenizer, tmp_path):
    options = {"shared_key": "auto", **getattr(request, "param", {})}
    engine = ScriptedEngine(tokenizer, ["Hello there."], model_path=model_path, model_name="scripted")
    with Lab(port=0, engine=engine, runs_dir=str(tmp_path), run_name="shared-key", **options) as lab:
        yield lab


def _chat(lab, headers=None, body=None, key=None, path="/v1/chat/completions"):
    headers = {"Authorization": f"Bearer {key or lab.shared_key}", **(headers or {})}
    return httpx.post(lab.url + path, json={"messages": MSG, "max_tokens": 4, **(body or {})}, headers=headers,
                      timeout=30)


def test_a_request_under_the_shared_key_lands_in_the_session_its_header_names(shared_lab):
    a, b = shared_lab.session(name="rollout-a"), shared_lab.session()
    b.shared = True  # its owner lets the shared key name it (by id): what GymAgent does for its runs
    assert _chat(shared_lab, {"X-Session-ID": "rollout-a"}).status_code == 200
    assert _chat(shared_lab, {"X-Session-ID": b.id}).status_code == 200
    assert _chat(shared_lab, {"X-Session-ID": b.id}).status_code == 200
    assert [len(session_calls(shared_lab, s)) for s in (a, b)] == [1, 2]
    assert _chat(shared_lab, key=a.key).status_code == 200  # the sessions' own keys still work beside it


def test_the_shared_key_cannot_name_a_session_that_did_not_opt_in(shared_lab):
    private = shared_lab.session()  # neither named nor shared: reachable only with its own key
    r = _chat(shared_lab, {"X-Session-ID": private.id})
    assert r.status_code == 401 and session_calls(shared_lab, private) == []
    with pytest.raises(ConfigError, match="exists already"):  # a name cannot take over another session's id
        shared_lab.session(name=private.id)


def test_a_closed_session_named_under_the_shared_key_is_409_and_gets_nothing(shared_lab):
    s = shared_lab.session(name="done")
    s.close(reward=1.0)
    r = _chat(shared_lab, {"X-Session-ID": "done"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_closed"
    assert session_calls(shared_lab, s) == []


def test_a_stored_response_is_found_only_through_its_own_session(shared_lab):
    a, b = shared_lab.session(name="a"), shared_lab.session(name="b")
    r = _chat(shared_lab, {"X-Session-ID": "a"}, {"input": "hi", "max_output_tokens": 4, "messages": None},
              path="/v1/responses")
    assert r.status_code == 200, r.text
    url = f"{shared_lab.url}/v1/responses/{r.json()['id']}"
    auth = {"Authorization": f"Bearer {shared_lab.shared_key}"}
    assert httpx.get(url, headers={**auth, "X-Session-ID": "a"}).status_code == 200
    assert httpx.get(url, headers={**auth, "X-Session-ID": "b"}).status_code == 404
    assert httpx.get(url, headers=auth).status_code == 400  # naming no session
    assert a.calls == 1 and b.calls == 0


def test_the_shared_key_without_a_session_name_is_400_that_says_what_is_missing(shared_lab):
    r = _chat(shared_lab)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "missing_session_id" and "X-Session-ID" in err["message"]
    assert shared_lab.writer.num_calls == 0


@pytest.mark.parametrize("path, headers, shape", [
    ("/v1/chat/completions", {}, "openai"),
    ("/v1/messages", {"anthropic-version": "2023-06-01"}, "anthropic"),
])
def test_an_unknown_session_name_is_401_in_the_apis_shape_and_creates_nothing(shared_lab, path, headers, shape):
    body = {"max_tokens": 4} if shape == "anthropic" else {}
    r = _chat(shared_lab, {"X-Session-ID": "nobody", **headers}, body, path=path)
    assert r.status_code == 401, r.text
    error = r.json()["error"]
    assert ("authentication_error" if shape == "anthropic" else "invalid_api_key") in json.dumps(error)
    assert "nobody" in error["message"]
    assert shared_lab.registry.all() == [] and shared_lab.writer.num_calls == 0


@pytest.mark.parametrize("shared_lab", [{"create_named_sessions": True}], indirect=True)
def test_with_creation_on_a_new_name_opens_one_session_that_its_later_calls_join(shared_lab):
    for _ in range(3):
        assert _chat(shared_lab, {"X-Session-ID": "conv-7"}).status_code == 200
    (session,) = shared_lab.registry.all()
    assert session.name == "conv-7" and session.info["auto"] and len(session_calls(shared_lab, session)) == 3


@pytest.mark.parametrize("shared_lab", [{"session_field": "metadata.session_id"}], indirect=True)
def test_a_configured_body_field_names_the_session_when_the_header_is_absent(shared_lab):
    s = shared_lab.session(name="by-body")
    assert _chat(shared_lab, body={"metadata": {"session_id": "by-body"}}).status_code == 200
    assert len(session_calls(shared_lab, s)) == 1
    r = _chat(shared_lab, body={"metadata": {"session_id": ["by-body"]}})
    assert r.status_code == 400 and "string" in r.json()["error"]["message"]
    r = _chat(shared_lab)
    assert r.status_code == 400 and "metadata.session_id" in r.json()["error"]["message"]


def test_a_session_header_never_moves_a_call_out_of_the_session_whose_key_it_carries(scripted_lab, shared_lab):
    for lab in (scripted_lab, shared_lab):  # without a shared key, and with one
        own, other = lab.session(name="own"), lab.session(name="other")
        assert _chat(lab, {"X-Session-ID": "other"}, key=own.key).status_code == 200
        assert len(session_calls(lab, own)) == 1 and session_calls(lab, other) == []
    assert scripted_lab.shared_key is None


def test_the_shared_key_is_not_written_to_the_run_folder(model_path, tokenizer, tmp_path):
    secret = "a-shared-secret-of-some-length"
    engine = ScriptedEngine(tokenizer, ["Hello."], model_path=model_path, model_name="scripted")
    with Lab(port=0, engine=engine, runs_dir=str(tmp_path), run_name="secret", shared_key=secret) as lab:
        lab.session(name="x")
        assert _chat(lab, {"X-Session-ID": "x"}).status_code == 200
    with pytest.raises(Exception):  # a Lab whose engine cannot start has written its config already
        Lab(str(tmp_path / "no-model"), port=0, runs_dir=str(tmp_path), run_name="failed", shared_key=secret)
    for run in ("secret", "failed"):
        written = "".join(p.read_text() for p in (tmp_path / run).rglob("*") if p.is_file())
        assert secret not in written and "(set)" in written


def test_session_names_are_unique_and_short_keys_refused(shared_lab):
    shared_lab.session(name="same")
    with pytest.raises(ConfigError, match="exists already"):
        shared_lab.session(name="same")
    with pytest.raises(ConfigError, match="at least 16"):
        Lab(port=0, engine=object(), shared_key="short")
