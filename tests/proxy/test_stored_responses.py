"""The Responses API's stored responses (apis/openai_responses.StoredResponses) without a server: what is kept,
for whom, and within which bounds."""

from types import SimpleNamespace

import pytest

from polar_lab.errors import RequestError
from polar_lab.proxy.apis.openai_responses import API, ResponsesRequest, StoredResponses


def _call(session, finish="stop"):
    return SimpleNamespace(api=API, render={}, choices=[SimpleNamespace(finish_reason=finish)], session=session)


def _keep(store, session, rid, text, previous=None, **call):
    request = {"input": text, **({"previous_response_id": previous} if previous else {})}
    response = {"id": rid, "status": "completed", "output": [{"type": "message", "role": "assistant",
                                                               "content": [{"type": "output_text", "text": "ok"}]}]}
    store.keep(_call(session, **call), request, response)


def test_a_session_keeps_what_fits_its_byte_bound_oldest_dropped_first():
    s = SimpleNamespace(id="s1", closed_at=None)
    store = StoredResponses(session_bytes=250)
    for i in range(6):
        _keep(store, s, f"resp_{i}", "x" * 60)  # ~105 bytes of input each: two fit
    assert store.kept("s1") == 2
    with pytest.raises(RequestError):
        store.get(s, "resp_0")
    assert store.get(s, "resp_5")["input"][0]["content"] == "x" * 60


def test_aborted_and_late_calls_are_not_kept_and_a_chain_expands_in_order():
    s = SimpleNamespace(id="s1", closed_at=None)
    store = StoredResponses()
    _keep(store, s, "resp_a", "first")
    _keep(store, s, "resp_b", "second", previous="resp_a")
    _keep(store, s, "resp_cut", "cut", finish="abort")
    _keep(store, SimpleNamespace(id="s2", closed_at=1.0), "resp_late", "late")
    assert (store.kept("s1"), store.kept("s2")) == (2, 0)
    body = store.expand(s, ResponsesRequest(input="third", previous_response_id="resp_b"))
    texts = [item.get("content") if isinstance(item.get("content"), str) else item["content"][0]["text"]
             for item in body.input]
    assert texts == ["first", "ok", "second", "ok", "third"]
    store.drop(s)
    assert store.kept("s1") == 0
