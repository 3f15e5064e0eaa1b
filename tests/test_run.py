"""`polar_lab.Run`: a run folder read back without an engine gives what the Lab that recorded it gave."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import warnings

import orjson
import pytest

from polar_lab import Run
from polar_lab.errors import StoreError
from polar_lab.harness import calculator_agent
from polar_lab.tasks import load_tasks
from tests.conftest import ROOT

# A child process that opens the run folder and prints its trajectories; it must not import vLLM (or start
# anything): a finished run is analysed anywhere.
CHILD = """
import json, sys, dataclasses
from polar_lab import Run
run = Run(sys.argv[1])
out = {b: [dataclasses.asdict(t) for t in run.trajectories(b)] for b in ("prefix_merging", "per_request")}
out["vllm_imported"] = any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)
out["engine_imported"] = "polar_lab.engine.vllm_engine" in sys.modules
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def finished(model_path, engines, tmp_path_factory):
    """A real run, closed: a rollout of calculator agents with rewards, and what the Lab built from it."""
    with engines.lab(model_path, runs_dir=str(tmp_path_factory.mktemp("runs")), run_name="finished") as lab:
        lab.rollout(load_tasks("data/tasks/calc_train.jsonl")[:2], calculator_agent, num_generations=4,
                    evaluator="final_answer", sampling={"temperature": 1.0}, progress=False)
        built = {b: [dataclasses.asdict(t) for t in lab.trajectories(b)] for b in ("prefix_merging", "per_request")}
        folder = lab.run_dir
    assert lab.closed
    return folder, built


def test_a_closed_run_opens_in_a_fresh_process_without_vllm(finished):
    folder, built = finished
    child = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True, cwd=ROOT,
                           timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    seen = json.loads(child.stdout.strip().splitlines()[-1])
    assert not seen.pop("vllm_imported") and not seen.pop("engine_imported")
    assert seen == json.loads(json.dumps(built))  # ids, masks, logprobs, versions, rewards, temperatures, supports
    rewards = [t["reward"] for t in built["prefix_merging"]]
    assert len(built["prefix_merging"]) >= 8 and any(r is not None for r in rewards)


def test_a_torn_last_line_is_skipped_and_reported(finished, tmp_path):
    folder, built = finished
    copy = tmp_path / "torn"
    shutil.copytree(folder, copy)
    whole = Run(copy).call_records()
    with open(copy / "calls.jsonl", "ab") as fh:
        fh.write(b'{"call_id": "cut-short", "session_id": "s", "prompt_ids": [1, 2')  # a write a crash cut
    run = Run(copy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(run.calls()) == len(whole)  # through calls() → call_records(): the warning names this line
        assert run.call_records() == whole
    assert run.torn_lines == {"calls.jsonl": 1, "sessions.jsonl": 0}
    assert [w.filename for w in caught if "torn line" in str(w.message)] == [__file__]  # not run.py's
    assert [dataclasses.asdict(t) for t in run.trajectories()] == built["prefix_merging"]


def test_a_folder_from_another_build_fails_clearly_or_is_read(finished, tmp_path):
    folder, _ = finished
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    # sessions written before reward_parts was a field kept it in info: read into the field
    lines = [orjson.loads(line) for line in (old / "sessions.jsonl").read_bytes().splitlines()]
    for record in lines:
        record.setdefault("info", {})["reward_parts"] = record.pop("reward_parts")
    (old / "sessions.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in lines))
    closed = [s for s in Run(old).session_records() if s.status == "closed"]
    assert closed and all(s.reward_parts.get("total") == s.reward for s in closed)
    # calls missing a field this build needs: a clear error, not a KeyError deep in a builder
    calls = [orjson.loads(line) for line in (old / "calls.jsonl").read_bytes().splitlines()]
    for record in calls:
        del record["output_versions"]
    (old / "calls.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in calls))
    with pytest.raises(StoreError, match="different polar_lab build.*output_versions"):
        Run(old).trajectories()


def test_what_is_not_a_run_folder_is_a_clear_error(tmp_path):
    with pytest.raises(StoreError, match="no run folder"):
        Run(tmp_path / "missing")
    with pytest.raises(StoreError, match="not a polar_lab run folder"):
        Run(tmp_path)
    with pytest.raises(StoreError, match="no run folders"):
        Run.latest(tmp_path)


def test_latest_and_what_viz_draws_from_a_run(finished):
    import matplotlib

    matplotlib.use("Agg")
    from polar_lab.viz import alignment_html, plot_rewards

    folder, built = finished
    run = Run.latest(folder.parent)
    assert run.path == folder
    rewards = run.rewards()
    assert len(rewards) == 8 and set(rewards["group"]) == {0, 1}
    assert plot_rewards(run) is not None
    traj = run.trajectories()[0]
    html = alignment_html(traj, run.tokenizer, breaks=run.chain_breaks(session_ids=[traj.session_id]))
    assert html.count('class="tok') == len(traj.token_ids)
    with pytest.raises(StoreError, match="no trainer metrics"):
        run.metrics()
