"""A hostile harness program, run through `lab.rollout` at the default ("isolated") level, cannot touch the Lab.

Each attempt is checked from outside (file hashes, live pids, what a listener received), and the safe ones
again at the "process" level as a negative control: there they succeed, so the check can see a breach.
"""

import json
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from polar_lab import sandbox
from polar_lab.harness.command import Command
from polar_lab.rewards.code import repo_tests
from polar_lab.sandbox import isolation
from polar_lab.sandbox.cgroup import Cgroup
from polar_lab.tasks import load_tasks
from tests.conftest import processes_of, running, session_calls

ROOT = Path(__file__).resolve().parents[2]

# The hostile program: each attempt named in attempts.json, reported on its own line as it happens.
HOSTILE = r'''
import json, os, signal, socket, sys
task = json.load(open("attempts.json"))

def call():  # the way it is meant to reach the world: the proxy, at the session's usual address
    import openai
    client = openai.OpenAI(max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="tiny-calc", max_tokens=4,
                                           messages=[{"role": "user", "content": "2+2"}])
    return reply.choices[0].finish_reason

def kill_visible():  # every process /proc shows, but itself and its parent
    killed = []
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
        if pid not in (os.getpid(), os.getppid()):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
    return killed

ATTEMPTS = {
    "model_call": call,
    "read_calls": lambda: open(task["calls"]).read(),
    "append_calls": lambda: open(task["calls"], "a").write("HACKED\n"),
    "read_other_workdir": lambda: open(task["other"]).read(),
    "write_project": lambda: open(task["project_file"], "w").write("HACKED"),
    "write_weights": lambda: open(os.path.join(task["weights_dir"], "HACKED"), "w").write("HACKED"),
    "write_shm": lambda: open("/dev/shm/" + task["shm_name"], "w").write("HACKED"),
    "kill_kernel": lambda: os.kill(task["kernel_pid"], signal.SIGKILL),
    "kill_engine": lambda: os.kill(task["engine_pid"], signal.SIGKILL),
    "kill_visible": kill_visible,
    "connect_listener": lambda: socket.create_connection(("127.0.0.1", task["listener_port"]), timeout=2).close(),
}
for name in task["attempts"]:
    try:
        print(name, "done", str(ATTEMPTS[name]()).strip()[:100].replace("\n", " "), flush=True)
    except Exception as exc:
        print(name, "refused", type(exc).__name__, flush=True)
'''


class Listener:
    """A loopback listener the harness must not reach; counts the connections it accepts."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port, self.accepted, self._stop = self.sock.getsockname()[1], 0, False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self):
        self._stop = True
        self._thread.join()
        self.sock.close()


def _run_hostile(lab, attempts, fields, level=None):
    """Run the hostile program once through lab.rollout; its report {attempt: "done ..." | "refused ..."}."""
    results = []

    def keep(task, result):  # an evaluator that keeps the harness's result for the checks
        results.append(result)
        return {"total": 0.0}

    program = Command(["{python}", "hostile.py"], name="hostile", sandbox=level,
                      files={"hostile.py": HOSTILE, "attempts.json": json.dumps({"attempts": attempts, **fields})})
    (g,) = lab.rollout([{"id": "hostile"}], program, num_generations=1, evaluator=keep, deadline_s=120,
                       progress=False)
    (s,) = g.sessions
    assert s.status == "closed", s.info
    lines = [line.split(" ", 1) for line in results[0]["stdout"].splitlines()]
    return {name: outcome for name, outcome in lines}, s, results[0]


@pytest.fixture(scope="module")
def lab(model_path, tmp_path_factory):
    """A Lab that owns its engine (a private engine, forked in ~1-2 s: the folder of kept weights in /dev/shm, which
    only a Lab that owns its engine keeps, is one of the hostile program's targets)."""
    from polar_lab import Lab

    with Lab(model_path, port=0, runs_dir=str(tmp_path_factory.mktemp("runs")), run_name="hostile") as lab:
        yield lab


@pytest.fixture
def targets(lab, tmp_path):
    """What the hostile program aims at, each a thing the test can check from outside."""
    with sandbox.workdir(prefix="polar-other-") as other:
        Path(other, "secret.txt").write_text("another session's secret")
        isolation.prepare_workdir(other)  # owned by the sandbox user, as a real session's workdir is
        project_file = ROOT / f"HACKED-{uuid.uuid4().hex[:8]}"
        listener = Listener()
        fields = {"calls": str(lab.run_dir / "calls.jsonl"), "other": f"{other}/secret.txt",
                  "project_file": str(project_file), "weights_dir": str(lab.weights.path),
                  "shm_name": f"polar-hacked-{uuid.uuid4().hex[:8]}", "kernel_pid": os.getpid(),
                  "engine_pid": lab.engine.pid, "listener_port": listener.port}
        yield fields, listener
        listener.close()
        project_file.unlink(missing_ok=True)
        Path("/dev/shm", fields["shm_name"]).unlink(missing_ok=True)


def test_an_isolated_harness_reaches_the_proxy_and_nothing_of_the_lab(lab, targets):
    fields, listener = targets
    calls, weights = lab.run_dir / "calls.jsonl", Path(fields["weights_dir"])
    before = {"calls": calls.read_bytes(), "weights": sorted(os.listdir(weights))}
    engine_pid = lab.engine.pid
    attempts = ["model_call", "read_calls", "append_calls", "read_other_workdir", "write_project",
                "write_weights", "write_shm", "kill_kernel", "kill_engine", "kill_visible", "connect_listener"]
    report, session, result = _run_hostile(lab, attempts, fields)

    assert result["sandbox"] == "isolated" and lab.sandbox_level == "isolated"
    assert report["model_call"].startswith("done"), report  # the proxy is reachable: one call recorded
    assert len(session_calls(lab, session)) == 1
    for name in ("read_calls", "append_calls", "read_other_workdir", "write_project", "write_weights",
                 "kill_kernel", "kill_engine", "connect_listener"):
        assert report[name].startswith("refused"), (name, report[name])
    assert report["write_shm"] == "done 6", report  # into its own /dev/shm, which no one else sees
    assert report["kill_visible"] == "done []", report  # it sees only bwrap (root's), itself and its launcher
    # ... and from outside:
    after = calls.read_bytes()  # what was there, then only the records of its own call
    assert after.startswith(before["calls"]) and b"HACKED" not in after
    assert {json.loads(line)["session_id"] for line in after[len(before["calls"]):].splitlines()} == {session.id}
    assert sorted(os.listdir(weights)) == before["weights"]
    assert not Path(fields["project_file"]).exists()
    # the name it wrote is not in the host's /dev/shm (other processes of the suite come and go there, so the
    # check is on that name, not on the whole listing)
    assert not Path("/dev/shm", fields["shm_name"]).exists()
    assert running(engine_pid) and lab.engine.pid == engine_pid
    assert report["connect_listener"].startswith("refused") and listener.accepted == 0
    (g,) = lab.rollout(load_tasks("data/tasks/calc_test.jsonl", 1), CALC_CLI, num_generations=1, progress=False)
    assert g.sessions[0].status == "closed"  # the Lab serves on


def test_the_same_attempts_succeed_at_the_process_level(lab, targets):
    """The negative control, with the attempts that do no harm when they succeed: the checks above can fail."""
    fields, listener = targets
    fields = {**fields, "calls": str(Path(fields["other"]).with_name("calls-copy.jsonl"))}
    Path(fields["calls"]).write_text("a call record\n")
    report, _, result = _run_hostile(lab, ["read_calls", "read_other_workdir", "write_project", "write_shm",
                                           "connect_listener"], fields, level="process")
    assert result["sandbox"] == "process"
    assert report["read_calls"] == "done a call record", report
    assert report["read_other_workdir"] == "done another session's secret"
    assert Path(fields["project_file"]).read_text() == "HACKED"
    assert Path("/dev/shm", fields["shm_name"]).read_text() == "HACKED"
    assert listener.accepted == 1


CALC_CLI = Command(["{python}", "-m", "polar_lab.harness.calc_cli", "{question}"], name="calc_cli")


def _limited(lab, code, **options):
    program = Command(["{python}", "-c", code], **{"name": "limited", **options})
    t0 = time.monotonic()
    (g,) = lab.rollout([{"id": "limited"}], program, num_generations=1, deadline_s=60, progress=False)
    (s,) = g.sessions
    return s, time.monotonic() - t0


def test_a_disk_filler_is_killed_at_its_quota(lab):
    """Writing ~50 MiB/s without end: killed while it runs, within one disk check (1 s) of the workdir
    passing 20 MiB — not at its 512 MiB file-size limit, nor at its deadline. The workdir is kept to be
    measured from outside."""
    name = f"filler-{uuid.uuid4().hex[:8]}"
    s, took = _limited(lab, "import time\nwith open('fill', 'wb') as f:\n    while True:\n"
                            "        f.write(b'x' * 2**20); f.flush(); time.sleep(0.02)\n",
                       disk_mb=20, keep_workdir=True, name=name)
    (workdir,) = Path(tempfile.gettempdir()).glob(f"polar-{name}-*")
    try:
        assert s.status == "error" and s.info["limit"] == "disk", s.info
        written = (workdir / "fill").stat().st_size / 2**20
        assert 20 < written < 100, f"{written:.0f} MiB written under a 20 MiB quota"  # one check's worth over
        assert took < 30
    finally:
        shutil.rmtree(workdir)


def test_a_fork_bomb_is_killed_at_its_process_limit_and_leaves_nothing(lab):
    uids = isolation.pool()
    s, _ = _limited(lab, "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                         "        time.sleep(0.01)\n", processes=16)
    assert s.status == "error" and s.info["limit"] == "processes", s.info
    assert processes_of(uids) == []  # every fork is gone, seen from outside


@pytest.mark.parametrize("code", [
    "while True:\n    pass\n",  # SIGXCPU at the soft limit
    "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n",  # SIGKILL at the hard one
])
def test_a_cpu_burner_is_killed_at_its_cpu_limit(lab, code):
    s, took = _limited(lab, code, cpu_seconds=1)
    assert s.status == "error" and s.info["limit"] == "cpu", s.info
    assert took < 30


@pytest.mark.ci_required  # CI's machine, like this one, gives sandboxes a memory cgroup
def test_processes_that_share_out_memory_are_killed_at_the_runs_memory_limit(lab):
    """Four children of 150 MB each stay under the 256 MB address-space limit one by one; together they
    pass the run's memory cgroup, and the kernel's verdict ends the whole run."""
    probe = Cgroup.create(max_pids=None, memory_mb=64)
    usable = probe is not None and "memory" in probe.paths
    if probe is not None:
        probe.close()
    if not usable:
        pytest.skip("this machine gives no memory cgroup to a sandbox")
    code = ("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n"
            "        block = bytearray(150 * 2**20)\n        time.sleep(60)\ntime.sleep(60)\n")
    s, took = _limited(lab, code, memory_mb=256)
    assert s.status == "error" and s.info["limit"] == "memory", s.info
    assert took < 45


# ---- evaluation in a fresh sandbox: a code agent that edits the tests gets nothing for it ---------------------
REPO_TASK = load_tasks("data/tasks/repo_fix.jsonl", 1)[0]  # calc.py's add() subtracts; test_calc.py says so
EDITS = {  # what each program writes into its repository
    "fix": {"calc.py": "def add(a, b):\n    return a + b\n"},
    "edit_tests": {"test_calc.py": "def test_add():\n    assert True\n"},
    "conftest": {"conftest.py": "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
                                "def pytest_runtest_makereport(item, call):\n    outcome = yield\n"
                                "    outcome.get_result().outcome = 'passed'\n"},
    "exit_early": {"calc.py": "import os\nos._exit(0)\n"},
    "delete_tests": {},
    "shadow_pytest": {"pytest.py": "open('../report.xml', 'w').write('<testsuite tests=\"1\" failures=\"0\" "
                                   "errors=\"0\" skipped=\"0\"/>')\nraise SystemExit(0)\n"},
    "pytest_exit": {"calc.py": "import pytest\n\n\ndef add(a, b):\n    pytest.exit('done', returncode=0)\n"},
    "pytest_ini": {".pytest.ini": "[pytest]\naddopts = -p passall\n",
                   "passall.py": "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
                                 "def pytest_runtest_makereport(item, call):\n    outcome = yield\n"
                                 "    outcome.get_result().outcome = 'passed'\n"},
}
AGENT = r'''
import json, os, sys
import openai
client = openai.OpenAI(max_retries=0, timeout=60)
client.chat.completions.create(model="tiny-calc", max_tokens=4, messages=[{"role": "user", "content": "fix it"}])
mode = sys.argv[1]
for path, text in json.load(open(os.path.join(os.environ["HOME"], "edits.json")))[mode].items():
    open(path, "w").write(text)
if mode == "delete_tests":
    os.remove("test_calc.py")
'''


def _repo_reward(lab, *modes):
    program = Command(["{python}", "{workdir}/agent.py", *modes], workspace="files", name="repo-agent",
                      files={"agent.py": AGENT, "edits.json": json.dumps(EDITS)})
    if len(modes) > 1:  # several edits in one run
        program.argv = ["/bin/sh", "-c", " && ".join(f"{{python}} {{workdir}}/agent.py {m}" for m in modes)]
    (g,) = lab.rollout([REPO_TASK], program, num_generations=1, evaluator="repo_tests", progress=False)
    (s,) = g.sessions
    assert s.status == "closed", s.info
    return s.reward, s.reward_parts


@pytest.mark.parametrize("modes, reward", [
    (("fix",), 1.0),  # a correct fix passes the task's own tests
    (("edit_tests",), 0.0),  # its edit of the tests is dropped; the task's tests fail on the bug
    (("conftest",), 0.0),  # a conftest.py that turns failures into passes is not taken
    (("delete_tests",), 0.0),  # the tests are re-copied from the task
    (("exit_early",), 0.0),  # exiting 0 at import: pytest's report has no passing test
    (("shadow_pytest",), 0.0),  # a pytest.py that writes a clean report: not taken, and pytest runs with -P
    (("pytest_exit",), 0.0),  # ends pytest at 0 before the test finishes: its report has fewer tests than the task's
    (("pytest_ini",), 0.0),  # a .pytest.ini loading a plugin that passes everything: only the evaluator's ini
    (("fix", "edit_tests"), 1.0),  # the fix still counts; the test edit does not
])
def test_the_evaluator_scores_pristine_tests_against_the_harness_changes(lab, modes, reward):
    got, parts = _repo_reward(lab, *modes)
    assert got == reward, parts


def test_the_test_edit_would_pay_if_the_evaluator_took_the_workdir_as_left(lab):
    """The negative control: the same changes applied wholesale (tests included) pass — the cheat is real."""
    from polar_lab.rewards.code import run_repo_tests

    files = {**REPO_TASK["files"], **EDITS["edit_tests"]}
    assert run_repo_tests(files, ["test_calc.py"])[0]
    assert not run_repo_tests(REPO_TASK["files"], ["test_calc.py"])[0]


def test_every_shipped_repo_task_fails_as_given_and_passes_with_its_reference_fix():
    """data/tasks/repo_fix.jsonl: each task's bug is real (its tests fail) and fixable (its `reference_fix` passes)."""
    for task in load_tasks("data/tasks/repo_fix.jsonl"):
        assert repo_tests(task, {"changes": {}})["total"] == 0.0, task["id"]
        assert repo_tests(task, {"changes": task["reference_fix"]})["total"] == 1.0, task["id"]
