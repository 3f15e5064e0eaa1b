"""A process SIGKILLed mid-run leaves a store from which every completed call loads.
Its engine is the child kernel's own: a kernel killed with its engine is the subject."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from polar_lab.store import load_calls
from tests.conftest import running

CHILD = Path(__file__).with_name("crash_child.py")


def test_sigkill_mid_run_loses_no_completed_call_and_the_run_folder_reopens(model_path, tokenizer, tmp_path, request):
    # a TMPDIR of its own, removed here: what the SIGKILLed kernel made in it (its proxy's socket) it cannot remove
    scratch = tempfile.mkdtemp(prefix="polar-lab-crash-")
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    env = {**os.environ, "TMPDIR": scratch}  # the session's forkserver is offered to it, as to a notebook kernel
    child = subprocess.Popen([sys.executable, str(CHILD), model_path, str(tmp_path), "killed"],
                             stdout=subprocess.PIPE, stderr=open(tmp_path / "child.err", "w"), text=True, env=env)
    answered, engine_pid = [], None
    try:
        deadline = time.monotonic() + 300
        for line in child.stdout:
            if line.startswith("READY"):
                engine_pid = int(line.split()[1])
            else:
                answered.append(line.strip())
            if len(answered) >= 40 or time.monotonic() > deadline:
                break
        os.kill(child.pid, signal.SIGKILL)  # mid-run: 8 workers have calls in flight
        answered += [line.strip() for line in child.stdout if line.strip()]
    finally:
        child.kill()
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL, (tmp_path / "child.err").read_text()[-3000:]  # not ended by itself
    assert len(answered) >= 40
    # the engine process notices its kernel is gone (the socket closes) and exits: no orphaned vLLM
    deadline = time.monotonic() + 30
    while running(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(engine_pid), "the engine process outlived its SIGKILLed kernel"
    recorded = [c.request_id for c in load_calls(tmp_path / "killed")]
    assert set(answered) <= set(recorded), "an answered call is missing from the store"
    assert len(recorded) == len(set(recorded)), "a call was recorded twice"

    # reopen the killed run's folder: a new Lab appends after the old records, and both load
    import openai

    from polar_lab import Lab
    from polar_lab.engine import ScriptedEngine

    engine = ScriptedEngine(tokenizer, ["after the crash"], model_path=model_path)
    with Lab(port=0, engine=engine, runs_dir=str(tmp_path), run_name="killed") as lab:
        s = lab.session()
        openai.OpenAI(base_url=s.openai_base_url, api_key=s.key).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}])
        reopened = load_calls(lab.run_dir)
        assert [c.request_id for c in reopened[:len(recorded)]] == recorded
        assert len(reopened) == len(recorded) + 1 and reopened[-1].session_id == s.id
        assert lab.trajectories(session_ids=[s.id])[0].call_ids == [reopened[-1].call_id]
