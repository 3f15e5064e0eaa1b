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
    with pytest.raises(StoreError, match=f"run store {tmp_path / 'r'} is closed"):
        store.append_call(_call(0))


@pytest.mark.parametrize("name", ["../evil", "a/b", ".hidden", "", "x" * 200, "a..b"])
def test_run_names_cannot_escape_the_runs_folder(name):
    with pytest.raises(StoreError):
        check_run_name(name)


def _session_call(session_id, i, n_out, text="x"):
    call = _call(i)
    call.session_id, call.call_id, call.output_ids = session_id, f"{session_id}-{i}", list(range(n_out))
    call.output_logprobs, call.output_versions = [-1.0] * n_out, [0] * n_out
    call.request = {"messages": [{"role": "user", "content": text}]}
    return call


def test_each_sessions_calls_read_back_by_offset_and_the_counts_follow_every_append(tmp_path):
    store = RunStore(tmp_path / "r")
    assert (store.num_calls, store.num_output_tokens) == (0, 0)
    written = [_session_call("a", 0, 3, "é中文"), _session_call("b", 0, 2), _session_call("a", 1, 4, "ü"),
               _session_call("b", 1, 1, "ok")]  # multi-byte text: offsets are bytes, not characters
    for call in written:
        store.append_call(call)
    assert (store.num_calls, store.num_output_tokens) == (4, 10)
    assert store.read_calls(["a"]) == [written[0], written[2]]
    assert store.read_calls(["b", "a"]) == written  # in recording order
    assert store.read_calls(["nobody"]) == []
    store.close()
    reopened = RunStore(tmp_path / "r")  # a later Lab on the same folder: its offsets start after the old records
    late = _session_call("c", 0, 2, "ß")
    reopened.append_call(late)
    assert reopened.read_calls(["c"]) == [late] and reopened.num_calls == 1
    reopened.close()


def test_records_and_sessions_take_numpy_values(tmp_path):
    import numpy as np

    store = RunStore(tmp_path / "r")
    call = _call(0)
    call.output_logprobs, call.sampling = np.array([-0.25], dtype=np.float32), {"seed": np.int64(7)}
    store.append_call(call)
    session = Session(id="a", key="k", reward=1.0, reward_parts={"total": np.float64(0.5)})
    store.append_session(session, "closed")
    store.close()
    (back,) = load_calls(tmp_path / "r")
    assert back.output_logprobs == [-0.25] and back.sampling == {"seed": 7}
    assert load_sessions(tmp_path / "r").reward_parts.tolist() == [{"total": 0.5}]


def test_a_session_line_is_readable_at_once_and_says_what_happened_when(tmp_path):
    import json
    import time

    store = RunStore(tmp_path / "r")
    before = time.time()
    store.append_session(Session(id="a", key="k"), "opened")
    line = json.loads((tmp_path / "r" / "sessions.jsonl").read_text())  # before close: no buffering
    assert line["event"] == "opened" and before <= line["time"] <= time.time() and line["id"] == "a"
    store.close()


def test_reopening_a_whole_file_leaves_its_bytes_alone(tmp_path):
    store = RunStore(tmp_path / "r")
    store.append_call(_call(0))
    store.append_session(Session(id="a", key="k"), "opened")
    store.close()
    calls, sessions = ((tmp_path / "r" / name).read_bytes() for name in ("calls.jsonl", "sessions.jsonl"))
    RunStore(tmp_path / "r").close()
    assert (tmp_path / "r" / "calls.jsonl").read_bytes() == calls
    assert (tmp_path / "r" / "sessions.jsonl").read_bytes() == sessions


def test_a_nested_run_folder_is_created_and_config_is_written_for_people(tmp_path):
    store = RunStore(tmp_path / "runs" / "deep" / "r")
    store.write_json("config.json", {"a": 1})
    store.close()
    assert (tmp_path / "runs" / "deep" / "r" / "config.json").read_text() == '{\n  "a": 1\n}'


def test_a_folder_that_cannot_be_opened_is_a_store_error_naming_it(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError, match=f"cannot open run folder {tmp_path / 'file' / 'r'}"):
        RunStore(tmp_path / "file" / "r")


def test_fsync_is_off_by_default_and_on_when_asked(tmp_path, monkeypatch):
    import os

    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    store = RunStore(tmp_path / "a")
    store.append_call(_call(0))
    assert synced == []
    store.close()
    store = RunStore(tmp_path / "b", fsync=True)
    store.append_call(_call(0))
    store.append_session(Session(id="a", key="k"), "opened")
    assert len(synced) == 2
    store.close()


def test_jsonlines_reads_whole_new_lines_only_and_counts_torn_ones(tmp_path):
    from polar_lab.store.runstore import JsonLines

    path = tmp_path / "x.jsonl"
    lines = JsonLines(path)
    assert lines.read() == [] and (lines.torn, lines.tail) == (0, b"")  # no file yet
    path.write_bytes(b'{"a": 1}\n\n{"a": 2}\n{"a": 3')  # a blank line, then a line still being written
    assert lines.read() == [{"a": 1}, {"a": 2}] and lines.tail == b'{"a": 3'
    with open(path, "ab") as fh:
        fh.write(b'}\nnot json\n{"a": 4}\n{broken\n')
    assert lines.read() == [{"a": 3}, {"a": 4}] and lines.torn == 2 and lines.tail == b""
    assert lines.read() == []  # nothing new


def test_run_names_are_unique_and_sortable_by_time():
    import re

    from polar_lab.store.runstore import new_run_name

    names = [new_run_name() for _ in range(3)]
    assert all(re.fullmatch(r"run-\d{8}-\d{6}-\d{6}", n) and check_run_name(n) == n for n in names)
    assert len(set(names)) == 3


def test_bad_run_names_are_named_in_the_error():
    with pytest.raises(StoreError, match="bad run name '../x'"):
        check_run_name("../x")


def test_the_calls_frame_has_one_row_of_scalar_facts_and_token_lists_per_call():
    call = _session_call("a", 2, 3)
    call.choice_index, call.api, call.model, call.finish_reason, call.policy_version = 1, "x.api", "mm", "length", 4
    call.parse = {"num_tool_calls": 2, "errors": ["e"]}
    call.render = {"mode": "continued"}
    call.sampling = {"max_tokens": 3, "max_tokens_source": "default"}
    call.timings = {"total_s": 1.5, "engine_s": 1.0, "proxy_s": 0.5, "first_delta_s": 0.2, "received": 10.0}
    call.cached_tokens, call.replayed = 1, True
    (row,) = calls_frame([call]).to_dict("records")
    assert row == {"call_id": "a-2", "session_id": "a", "call_index": 2, "choice_index": 1, "api": "x.api",
                   "model": "mm", "prompt_tokens": 2, "completion_tokens": 3, "finish_reason": "length",
                   "max_tokens": 3, "max_tokens_source": "default", "policy_version": 4, "replica": 0,
                   "cached_tokens": 1, "replayed": True, "tool_calls": 2, "tool_parse_errors": 1, "render_mode": "continued",
                   "total_s": 1.5, "engine_s": 1.0, "proxy_s": 0.5, "first_delta_s": 0.2, "received": 10.0,
                   "prompt_ids": [1, 2],
                   "output_ids": [0, 1, 2], "output_logprobs": [-1.0, -1.0, -1.0]}
    bare = _call(0)
    bare.parse, bare.render, bare.timings = {}, {}, {}
    (row,) = calls_frame([bare]).to_dict("records")
    assert (row["tool_calls"], row["tool_parse_errors"], row["render_mode"], row["total_s"], row["first_delta_s"]) == \
        (0, 0, None, None, None)  # a call that was not streamed has no first delta
