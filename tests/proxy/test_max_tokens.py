"""Where a call's max_tokens came from — the request, the Lab's default, the context's room, or the session's cap —
is in the record (`lab.calls().max_tokens_source`), in a header on every answer (streamed too), and an answer cut at
the default is said once to the researcher. Scripted engine: the proxy's own bookkeeping is under test."""

import logging

import httpx
import pytest

LONG = " ".join(["word"] * 40)  # the scripted reply: longer than the small default below


@pytest.fixture
def lab(model_path, tokenizer, tmp_path):
    from polar_lab import Lab
    from polar_lab.engine import ScriptedEngine

    engine = ScriptedEngine(tokenizer, [LONG], model_path=model_path, max_model_len=512)
    with Lab(port=0, engine=engine, runs_dir=str(tmp_path), run_name="max-tokens", default_max_tokens=8) as lab:
        yield lab


def _chat(session, **body) -> httpx.Response:
    return httpx.post(f"{session.openai_base_url}/chat/completions", headers={"Authorization": f"Bearer {session.key}"},
                      json={"messages": [{"role": "user", "content": "Talk."}], **body}, timeout=30)


@pytest.mark.parametrize("body, sampling, max_tokens, source", [
    ({}, None, 8, "default"),  # no cap asked: the Lab's default_max_tokens
    ({"max_tokens": 5}, None, 5, "request"),
    ({"max_tokens": 32000}, None, None, "clipped"),  # more than the context holds: the room left
    ({"max_tokens": 20}, {"max_tokens": 3}, 3, "session"),  # a rollout's forced cap
])
def test_the_max_tokens_source_is_recorded_and_sent_in_a_header(lab, body, sampling, max_tokens, source):
    s = lab.session(sampling=sampling)
    r = _chat(s, **body)
    assert r.status_code == 200
    row = lab.calls().set_index("session_id").loc[s.id]
    assert row.max_tokens_source == source
    assert max_tokens is None or row.max_tokens == max_tokens
    assert r.headers["polar-lab-max-tokens"] == f"{row.max_tokens}; source={source}"
    if source == "clipped":
        assert row.max_tokens == 512 - row.prompt_tokens


def test_a_streamed_answer_carries_the_header_too(lab):
    s = lab.session()
    with httpx.stream("POST", f"{s.openai_base_url}/chat/completions", headers={"Authorization": f"Bearer {s.key}"},
                      json={"messages": [{"role": "user", "content": "Talk."}], "stream": True}, timeout=30) as r:
        r.read()
    assert r.headers["polar-lab-max-tokens"] == "8; source=default"


def test_an_answer_cut_at_the_default_is_said_once_per_lab(lab, caplog):
    with caplog.at_level(logging.WARNING, logger="polar_lab.proxy.service"):
        assert _chat(lab.session(), max_tokens=4).json()["choices"][0]["finish_reason"] == "length"  # asked: silent
        assert not caplog.records
        for _ in range(3):
            assert _chat(lab.session()).json()["choices"][0]["finish_reason"] == "length"
    (said,) = caplog.records
    assert "default max_tokens (8)" in said.getMessage() and "default_max_tokens=N" in said.getMessage()
