"""Records that cost their new tokens (store/delta.py): a continuing call points at the earlier call of its session
instead of repeating its prompt ids and messages, and every reader gives back the whole record."""

import httpx
import orjson
import pytest

from polar_lab import Run
from polar_lab.store import RunStore, load_calls
from polar_lab.types import ModelCall
from tests.timing import returns

SYSTEM = {"role": "system", "content": "You are terse. " * 40}


def _conversation(lab, turns):
    """One session, `turns` calls, each sending the whole conversation so far plus a new user message."""
    s = lab.session()
    messages, sent = [SYSTEM], []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: " + "why? " * 20})
        body = {"messages": list(messages), "max_tokens": 8}
        r = httpx.post(s.openai_base_url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {s.key}"})
        assert r.status_code == 200
        sent.append(body)
        messages.append(r.json()["choices"][0]["message"])
    return s, sent


def test_a_continuing_call_stores_only_its_new_tokens_and_messages_and_readers_rebuild_it(scripted_lab):
    s, sent = _conversation(scripted_lab, 5)
    lines = [orjson.loads(line) for line in (scripted_lab.run_dir / "calls.jsonl").read_bytes().splitlines()]
    assert "prompt_ref" not in lines[0] and "request_ref" not in lines[0]
    for k in range(1, 5):  # each refers to the call before, and holds only what is new
        assert lines[k]["prompt_ref"]["call"] == lines[k - 1]["call_id"]
        assert lines[k]["request_ref"] == {"call": lines[k - 1]["call_id"], "items": 2 * k}
        assert len(lines[k]["request_tail"]["messages"]) == 2  # the answer echoed and the new question
        assert len(lines[k]["prompt_tail"]) < 100 < lines[k]["prompt_ref"]["tokens"]
        assert "prompt_ids" not in lines[k] and "request" not in lines[k]  # an older build refuses, not misreads
    truth = scripted_lab.engine.prompts  # what the engine was sent, token for token
    readers = {"load_calls": load_calls(scripted_lab.run_dir), "Run": Run(scripted_lab.run_dir).call_records(),
               "live Run, by session": scripted_lab.call_records([s.id])}
    for name, calls in readers.items():
        assert [c.prompt_ids for c in calls] == truth, name
        assert [c.request for c in calls] == sent, name


def test_n_choices_of_one_request_share_its_body(scripted_lab):
    s = scripted_lab.session()
    body = {"messages": [SYSTEM, {"role": "user", "content": "hi"}], "n": 3, "max_tokens": 4}
    httpx.post(s.openai_base_url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {s.key}"})
    lines = [orjson.loads(line) for line in (scripted_lab.run_dir / "calls.jsonl").read_bytes().splitlines()]
    assert [len((line.get("request") or line["request_tail"])["messages"]) for line in lines] == [2, 0, 0]
    assert [c.request for c in load_calls(scripted_lab.run_dir)] == [body] * 3


def _call(i, prompt, output, *, ref=None, session="s", request=None):
    render = {"mode": "continued", "from_call": ref[0], "reused_tokens": ref[1]} if ref else {"mode": "full"}
    return ModelCall(call_id=f"{session}-{i}", session_id=session, call_index=i, request_id=f"r{i}", choice_index=0,
                     api="openai.chat", model="m", prompt_ids=prompt, output_ids=output, output_logprobs=[-0.5] * len(output),
                     output_versions=[0] * len(output), policy_version=0, finish_reason="stop", stop_reason=None,
                     sampling={}, request=request or {}, response={}, render=render, parse={}, timings={})


def test_a_reference_is_only_to_a_call_this_store_wrote_in_that_session(tmp_path):
    first = RunStore(tmp_path / "r")
    first.append_call(_call(0, [1, 2], [3]))
    first.close()
    again = RunStore(tmp_path / "r")  # reopened (a crash, a second Lab on the folder): nothing before it is pointed at
    again.append_call(_call(1, [1, 2, 3, 4], [5], ref=("s-0", 3)))
    again.append_call(_call(2, [1, 2, 3, 4, 5, 6], [7], ref=("s-1", 5)))
    again.append_call(_call(3, [1, 2, 3, 4, 5, 6, 7, 8], [9], ref=("s-2", 6)))  # a render whose count is off: whole
    again.close()
    lines = [orjson.loads(line) for line in (tmp_path / "r" / "calls.jsonl").read_bytes().splitlines()]
    assert ["prompt_ref" in line for line in lines] == [False, False, True, False]
    assert [c.prompt_ids for c in load_calls(tmp_path / "r")] == [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6],
                                                                  [1, 2, 3, 4, 5, 6, 7, 8]]


def test_a_closed_sessions_calls_are_not_pointed_at(tmp_path):
    store = RunStore(tmp_path / "r")
    store.append_call(_call(0, [1, 2], [3]))
    store.forget("s")
    store.append_call(_call(1, [1, 2, 3, 4], [5], ref=("s-0", 3)))
    store.close()
    assert "prompt_ref" not in orjson.loads((tmp_path / "r" / "calls.jsonl").read_bytes().splitlines()[1])


def test_a_record_whose_reference_cannot_be_resolved_is_skipped_and_counted_like_a_torn_line(tmp_path):
    store = RunStore(tmp_path / "r")
    store.append_call(_call(0, [1, 2], [3], request={"messages": [{"role": "user", "content": "a"}]}))
    store.append_call(_call(1, [1, 2, 3, 4], [5], ref=("s-0", 3),
                            request={"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}))
    store.close()
    path = tmp_path / "r" / "calls.jsonl"
    path.write_bytes(path.read_bytes().splitlines(keepends=True)[1])  # the first line cut away by hand
    assert load_calls(tmp_path / "r") == []
    with pytest.warns(UserWarning, match="1 torn line"):
        assert Run(tmp_path / "r").call_records() == []


def _messages(*texts):
    return {"messages": [{"role": "user", "content": t} for t in texts]}


def test_the_compactor_points_only_at_requests_written_whole_in_sessions_it_still_holds():
    from polar_lab.store.delta import Compactor

    def compacted(compactor, call):
        return compactor.compact(call, {"prompt_ids": call.prompt_ids, "request": call.request})

    c = Compactor(sessions=2)
    c.written(_call(0, [1, 2], [3], request=_messages("a")))  # written whole: the default
    assert compacted(c, _call(1, [1, 2, 3], [4], request=_messages("a", "b")))["request_ref"] == {"call": "s-0",
                                                                                                   "items": 1}
    c.written(_call(1, [1, 2, 3], [4], request=_messages("a", "b")), whole_request=False)  # its request by reference
    assert "request_ref" not in compacted(c, _call(2, [1], [5], request=_messages("a", "b", "c")))
    for session in ("t", "u"):  # room for two sessions: "s" is still held after "t", gone after "u"
        returns(c.written, _call(0, [9], [9], session=session, request=_messages("x")))  # a loop fails here
        held = compacted(c, _call(2, [1, 2, 3, 4], [5], ref=("s-1", 4), request=_messages("a", "b", "c")))
        assert ("prompt_ref" in held) == (session == "t")
    c.forget("t")  # a closed session: nothing of it is pointed at
    assert compacted(c, _call(1, [9, 9, 1], [2], session="t", ref=("t-0", 2), request=_messages("x", "y"))) == {
        "prompt_ids": [9, 9, 1], "request": _messages("x", "y")}


def test_the_expander_skips_a_record_whose_one_reference_it_cannot_resolve_and_names_it():
    from polar_lab.store.delta import Expander

    e = Expander()
    assert e.expand({"call_id": "c1", "prompt_ref": {"call": "c0", "tokens": 1}, "prompt_tail": [2]}) is None
    assert e.expand({"call_id": "c2", "request_ref": {"call": "c0", "items": 1},
                     "request_tail": {"messages": []}}) is None
    assert e.unresolved == ["c1", "c2"]
    # a record without prompt or output ids (as old or failed ones are) can still be pointed at: as empty
    assert e.expand({"call_id": "c3", "request": _messages("a")})["request"] == _messages("a")
    pointing = {"call_id": "c4", "prompt_ref": {"call": "c3", "tokens": 0}, "prompt_tail": [7]}
    assert e.expand(pointing)["prompt_ids"] == [7]
