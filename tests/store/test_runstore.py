"""The run store: append-only, readable after a crash, safe run names."""

import pytest

from polar_lab.errors import StoreError
from polar_lab.store import RunStore, calls_frame, load_calls, load_sessions
from polar_lab.store.runstore import check_run_name
from polar_lab.types import ModelCall, Session


def _call(i):
    return ModelCall(call_id=f"s-{i}", session_id="s", call_index=i, request_id=f"r{i}", choice_index=0,
                     api="openai.chat", model="m", prompt_ids=[1, 2], output_ids=[3], output_logprobs=[-0.5],
                     output_versions=[0], policy_version=0, finish_reason="stop", stop_reason=None, sampling={},
                     request={}, response={}, render={"mode": "full"}, parse={}, timings={"total_s": 0.1})


def test_records_round_trip_in_order(tmp_path):
    store = RunStore(tmp_path / "r")
    for i in range(5):
        store.append_call(_call(i))
    store.close()
    assert load_calls(tmp_path / "r") == [_call(i) for i in range(5)]
    assert calls_frame(load_calls(tmp_path / "r")).completion_tokens.tolist() == [1] * 5


def test_a_torn_last_line_is_skipped_and_everything_before_it_loads(tmp_path):
    store = RunStore(tmp_path / "r")
    for i in range(3):
        store.append_call(_call(i))
    store.close()
    with open(tmp_path / "r" / "calls.jsonl", "ab") as fh:
        fh.write(b'{"call_id": "s-3", "sess')  # a write cut short by a machine crash
    assert [c.call_id for c in load_calls(tmp_path / "r")] == ["s-0", "s-1", "s-2"]


def test_reopening_after_a_torn_line_keeps_new_records_whole(tmp_path):
    store = RunStore(tmp_path / "r")
    store.append_call(_call(0))
    store.close()
    with open(tmp_path / "r" / "calls.jsonl", "ab") as fh:
        fh.write(b'{"call_id": "s-1", "sess')  # a machine crash cut this write
    reopened = RunStore(tmp_path / "r")
    reopened.append_call(_call(2))
    assert [c.call_id for c in reopened.read_calls(["s"])] == ["s-2"]  # offsets count the repaired line
    reopened.close()
    assert [c.call_id for c in load_calls(tmp_path / "r")] == ["s-0", "s-2"]


def test_sessions_keep_their_latest_state_and_never_their_key(tmp_path):
    store = RunStore(tmp_path / "r")
    s = Session(id="a", key="pl-secret")
    store.append_session(s, "opened")
    s.status, s.reward = "closed", 1.0
    store.append_session(s, "closed")
    store.close()
    frame = load_sessions(tmp_path / "r")
    assert frame.reward.tolist() == [1.0]
    assert "pl-secret" not in (tmp_path / "r" / "sessions.jsonl").read_text()


def test_writing_after_close_is_an_error_not_a_silent_loss(tmp_path):
    store = RunStore(tmp_path / "r")
    store.close()
    with pytest.raises(StoreError):
        store.append_call(_call(0))


@pytest.mark.parametrize("name", ["../evil", "a/b", ".hidden", "", "x" * 200, "a..b"])
def test_run_names_cannot_escape_the_runs_folder(name):
    with pytest.raises(StoreError):
        check_run_name(name)
