"""Program harnesses: real subprocesses against a session, with their own workdir, env, limits and deadline."""

import json
import os
import tempfile
import time

from polar_lab.tasks import load_tasks
from polar_lab.harness.command import Command
from polar_lab.rewards import final_answer
from tests.conftest import running, session_calls

CALC_CLI = Command(["{python}", "-m", "polar_lab.harness.calc_cli", "{question}"], name="calc_cli")


def test_a_cli_agent_runs_unmodified_and_every_call_is_recorded(lab):
    tasks = load_tasks("data/tasks/calc_test.jsonl", 2)
    groups = lab.rollout(tasks, CALC_CLI, num_generations=2, evaluator=final_answer, progress=False)
    for g in groups:
        for s in g.sessions:
            assert s.status == "closed" and s.reward in (0.0, 1.0), s.info.get("error")
            assert len(session_calls(lab, s)) >= 1
        assert len(g.trajectories) >= 2


def test_the_environment_is_built_from_scratch_in_a_private_workdir(lab, monkeypatch):
    monkeypatch.setenv("POLAR_TEST_SECRET", "kernel-only")
    probe = Command(["{python}", "-c", "import json, os; print(json.dumps([dict(os.environ), os.getcwd()]))"],
                    env={"EXTRA": "asked-for"}, name="probe")
    s = lab.session()
    env, cwd = json.loads(lab.run(probe(s, {}), timeout=60)["stdout"])
    # an allow-list, not a probe for one secret: everything in it is named here
    allowed = {"PATH", "LANG", "LC_ALL", "HF_HUB_OFFLINE", "TZ", "HOME", "TMPDIR", "EXTRA", *s.env(),
               "PWD", "SHLVL", "_"}  # the last three: what /bin/sh adds when it joins the pids cgroup
    assert set(env) <= allowed, set(env) - allowed
    assert env["HOME"] == env["TMPDIR"] == cwd and cwd.startswith(tempfile.gettempdir())
    assert env["OPENAI_BASE_URL"] == s.openai_base_url and env["EXTRA"] == "asked-for"


def test_a_memory_hog_is_contained_and_the_lab_keeps_serving(lab):
    hog = Command(["{python}", "-c", "b = bytearray(8 * 1024**3)"], memory_mb=1024, name="hog")
    (g,) = lab.rollout([{"id": "hog"}], hog, num_generations=1, progress=False)
    (s,) = g.sessions
    assert s.status == "error" and "MemoryError" in s.info["error"] and s.reward is None
    (g,) = lab.rollout(load_tasks("data/tasks/calc_test.jsonl", 1), CALC_CLI, num_generations=1, progress=False)
    assert g.sessions[0].status == "closed"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_deadline_kills_the_whole_process_group(lab, tmp_path):
    pids = tmp_path / "pids"
    sleeper = Command(["{python}", "-c", "import os, subprocess, time, sys;"
                       "child = subprocess.Popen(['sleep', '600']);"
                       f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}');"
                       "time.sleep(600)"], name="sleeper", sandbox="process")  # it writes outside its workdir
    (g,) = lab.rollout([{"id": "sleep"}], sleeper, num_generations=1, deadline_s=5, progress=False)
    assert g.sessions[0].status == "timeout"
    deadline = time.monotonic() + 10
    while any(_alive(int(p)) for p in pids.read_text().split()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(int(p)) for p in pids.read_text().split())


def test_a_process_flood_is_capped_even_for_root_and_cleaned_up(lab, tmp_path):
    """A harness that forks without end, at the "process" level (as root): the run's process limit holds (for
    root too, through a pids cgroup), the run is killed and marked for it, every process it made is gone
    after the run, and the Lab keeps serving."""
    pids = tmp_path / "pids"
    flood = Command(["{python}", "-c", "import subprocess, time\n"
                     f"out = open({str(pids)!r}, 'w')\n"
                     "for _ in range(200):\n"
                     "    try:\n"
                     "        out.write(f'{subprocess.Popen([\"sleep\", \"600\"], start_new_session=True).pid} ')\n"
                     "        out.flush()\n"
                     "    except OSError:\n"
                     "        break\n"
                     "time.sleep(60)\n"], processes=32, name="flood", sandbox="process")
    (g,) = lab.rollout([{"id": "flood"}], flood, num_generations=1, deadline_s=60, progress=False)
    (s,) = g.sessions
    assert s.status == "error" and s.info["limit"] == "processes", s.info
    made = [int(p) for p in pids.read_text().split()]
    assert 0 < len(made) < 32, f"{len(made)} processes started under a limit of 32"
    deadline = time.monotonic() + 10  # they left the process group (setsid); the cgroup still finds them
    while any(running(p) for p in made) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(p) for p in made)
    (g,) = lab.rollout(load_tasks("data/tasks/calc_test.jsonl", 1), CALC_CLI, num_generations=1, progress=False)
    assert g.sessions[0].status == "closed"


def test_every_sandboxed_run_removes_what_it_made_however_it_ends(engines, model_path, runs_dir, tmp_path,
                                                                   monkeypatch):
    """Isolated runs that exit, crash, pass a limit, hit their deadline, or are cut off by `Lab.close()` (and the Lab
    itself): the temp dir they all used holds nothing afterwards. A training run makes thousands of these."""
    import threading

    import torch._dynamo  # noqa: F401 - its import makes torch's machine-wide cache folder (torchinductor_<user>)

    engines.get(model_path)  # the suite's shared engine outlives this test: started before the count begins
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # every folder made from here on: in this one, counted
    py = ["{python}", "-c"]
    endings = [(Command([*py, "print(4)"], name="exits"), 60),
               (Command([*py, "import os; os.abort()"], name="crashes"), 60),
               (Command([*py, "while True: pass"], cpu_seconds=1, name="limit"), 60),
               (Command([*py, "import time; time.sleep(600)"], name="deadline"), 3)]
    lab = None
    try:
        with engines.lab(model_path, runs_dir=str(runs_dir), run_name="leftovers") as lab:
            for harness, deadline_s in endings:
                (g,) = lab.rollout([{"id": harness.name}], harness, num_generations=2, deadline_s=deadline_s,
                                   progress=False)
                assert all(s.info.get("sandbox", "isolated") == "isolated" for s in g.sessions)
            statuses = set(lab.sessions().status)
            assert {"closed", "error", "timeout"} <= statuses, statuses
            sleeper = Command([*py, "import time; time.sleep(600)"], name="cut-off")
            cut_off = threading.Thread(target=lambda: _quietly(lab.rollout, [{"id": "cut"}], sleeper,
                                                               num_generations=2, progress=False), daemon=True)
            cut_off.start()
            deadline = time.monotonic() + 60
            while len(list(temp.glob("polar-cut-off-*"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(list(temp.glob("polar-cut-off-*"))) == 2  # both running when the Lab closes
        cut_off.join(60)
        assert not cut_off.is_alive()
    finally:
        monkeypatch.undo()
    assert sorted(p.name for p in temp.iterdir()) == []


def _quietly(call, *args, **kwargs):
    try:
        call(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the Lab closed under it: what it left behind is the test's subject
        pass
