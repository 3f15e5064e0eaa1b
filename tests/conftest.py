"""Shared fixtures. Integration fixtures boot the real vLLM engine once per test session and tear it down.

POLAR_LAB_TEST_MODEL overrides the model folder (default: the shipped data/models/tiny-calc).
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import pytest

# Before torch loads libgomp, which reads it once: the suite runs two workers on two cores, and each starts processes
# with OpenMP pools of their own (engines, trainer ranks, kernels). With libgomp's default policy a thread that waits
# spins, and two pools that spin on the same cores starve each other: two 2-thread training processes side by side
# took 26-75 s each instead of ~10 s (alone: 5.3-5.6 s spinning, 5.5-6.5 s passive). `benchmarks/omp_contention.py`.
# Every process the run starts inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

# tests.suite_report: counts the engines the run started (summary at the end), fails a CI-required skip in CI;
# pytester: tests of that plugin run an inner pytest
pytest_plugins = ["tests.suite_report", "pytester"]

ROOT = Path(__file__).resolve().parents[1]
MODEL = os.environ.get("POLAR_LAB_TEST_MODEL", str(ROOT / "data" / "models" / "tiny-calc"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `make test` runs two pytest-xdist workers (gw0, gw1), each a whole test module at a time (--dist loadfile, with the
# heavy modules as one unit: below): module fixtures stay whole, and each worker has its own engines and forkserver. What would mix them up is kept apart: each
# worker's isolated runs take their sandbox uids from a pool of its own, so a test that looks for processes of its
# pool's uids from outside sees only its own (the uids are also locked machine-wide: polar_lab/sandbox/isolation.py).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw"):
    os.environ.setdefault("POLAR_LAB_SANDBOX_UID", str(61000 + 2048 * int(_WORKER[2:])))

# The modules that hold several GiB at once (SmolLM2 in the test process and its engine, a Ray cluster with engine
# actors, trainer ranks, JupyterLab with Chromium, the recipe's ranks and agent): one worker runs them one after
# another, so two never meet (two did: the machine ran out of its 24 GiB). Every other module is a group of its own.
HEAVY = ("tests/integration/test_smollm2.py", "tests/integration/test_replicas.py", "tests/grpo/test_fsdp.py",
         "tests/grpo/test_distributed.py", "tests/grpo/test_lora.py", "tests/grpo/test_cuda_check.py",
         "tests/grpo/test_recipe.py", "tests/integration/test_dashboard_browser.py",
         "notebooks/06_async_and_multigpu.ipynb")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test`'s scheduling (`pytest -n 2 --dist loadfile`): xdist's loadfile — a module runs whole on one worker,
    its fixtures set up once, a notebook's cells in one kernel — except that the HEAVY modules are one unit of work.
    (xdist's `loadgroup` marks would say the same, but pytest 9 ignores the node ids xdist 3.8 rewrites for them.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SuiteScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "heavy" if module in HEAVY else module

    return SuiteScheduling(config, log)


def running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a reparented child may never be reaped here)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def processes_of(uids) -> list[int]:
    """Live (not zombie) processes whose real uid is `uids` (an int or a collection of them)."""
    uids = {uids} if isinstance(uids, int) else set(uids)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
        except OSError:
            continue
        if int(fields["Uid"].split()[0]) in uids and not fields["State"].strip().startswith("Z"):
            found.append(int(entry))
    return found


def browser() -> str | None:
    """Why the dashboard's browser test (tests/integration/test_dashboard_browser.py) cannot run here, or None."""
    import importlib.util
    import shutil

    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        return "no chromium binary (Debian: apt-get install chromium; make browser)"
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed (pip install -e '.[dev]')"
    return None


AGENT_BINARIES = {"codex": "codex", "claude_code": "claude", "qwen_code": "qwen", "pi": "pi"}  # preset → npm binary


def agent_installed(name: str) -> bool:
    """An npm agent (its binary's name, or a preset's: AGENT_BINARIES) is installed (`make agents`); else its tests
    skip — a skip that CI fails where they are `ci_required`."""
    from polar_lab.harness.presets import agents_bin

    try:
        return Path(agents_bin(AGENT_BINARIES.get(name, name))).exists()
    except FileNotFoundError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_jupyter(url: str, auth: dict[str, str], server, seconds: float = 60.0) -> None:
    """Wait until the Jupyter server `server` (a Popen) answers `url`/api/status; the test fails if it exits first or
    does not answer within `seconds`."""
    import time

    import httpx

    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(f"{url}/api/status", headers=auth, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if server.poll() is not None:
            pytest.fail(f"the Jupyter server exited with code {server.returncode}")
        if time.monotonic() > deadline:
            pytest.fail(f"the Jupyter server did not answer in {seconds:.0f} s")
        time.sleep(0.25)


@pytest.fixture(scope="session")
def model_path() -> str:
    if not (Path(MODEL) / "config.json").exists():
        pytest.fail(f"model folder {MODEL} is missing: run `python scripts/build_tiny_model.py`")
    return MODEL


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


class SharedEngines:
    """The suite's real engines: one per (model folder, engine settings), started at first use (forked from the
    forkserver: engine/forkserver.py) and stopped when the session ends. A module that needs a Lab over one gets a Lab
    of its own (`lab(...)`): its own proxy, sessions and run folder, the engine shared. A Lab that changed the served
    weights leaves the engine to be put back on the model folder's weights before its next use (its policy version
    keeps counting). Memory is what bounds a 2-core, 24 GiB machine running two workers: these engines keep a KV cache
    sized to their model (a few full contexts, not the default GiB), and at most MAX_ALIVE of them live at once — an
    engine no Lab is using is stopped to make room, and forked again (~1-2 s) if a later module wants it."""

    MAX_ALIVE = 2

    def __init__(self):
        self._engines: dict[tuple, object] = {}  # in order of last use
        self._users: dict[tuple, int] = {}  # open Labs over each engine
        self._changed: set[tuple] = set()  # engines whose weights a Lab changed: put back at their next use
        self._shipped: dict[str, dict[str, torch.Tensor]] = {}

    def get(self, model: str, **settings):
        """The shared engine for `model` with these EngineConfig settings, started now if it is not running."""
        from polar_lab.config import EngineConfig
        from polar_lab.engine import VLLMEngine

        key = (str(model), tuple(sorted(settings.items())))
        if key in self._engines:
            self._engines[key] = self._engines.pop(key)  # the most recently used last
            if key in self._changed:
                self._engines[key].load_weights(self.shipped(str(model)))
                self._changed.discard(key)
            return self._engines[key]
        self._make_room()
        config = EngineConfig(model=str(model), **{"kv_cache_gib": kv_for(str(model)), **settings})
        self._engines[key] = VLLMEngine(config).start()
        self._changed.discard(key)
        return self._engines[key]

    def _make_room(self) -> None:
        for key in [k for k in self._engines if not self._users.get(k)]:  # idle ones, least recently used first
            if len(self._engines) < self.MAX_ALIVE:
                return
            self._engines.pop(key).close()

    @contextlib.contextmanager
    def lab(self, model: str, *, engine_settings: dict | None = None, **options):
        """A Lab of its own over the shared engine (options: Lab keywords; port 0 unless given)."""
        from polar_lab import Lab

        settings = engine_settings or {}
        key = (str(model), tuple(sorted(settings.items())))
        engine = self.get(model, **settings)
        version = engine.policy_version
        self._users[key] = self._users.get(key, 0) + 1
        try:
            with Lab(str(model), engine=engine, **{"port": 0, **settings, **options}) as lab:
                yield lab
        finally:
            self._users[key] -= 1
            if engine.policy_version != version:
                self._changed.add(key)

    def shipped(self, model: str) -> dict[str, torch.Tensor]:
        """The model folder's weights as the engine takes them (`lm_head.weight` included: ENV.md gotcha 2)."""
        if model not in self._shipped:
            from transformers import AutoModelForCausalLM

            state = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
            self._shipped[model] = {k: v.clone() for k, v in state.items()}
        return self._shipped[model]

    def close(self) -> None:
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()


def kv_for(model: str) -> float:
    """A KV cache for two full contexts of `model` in fp32, in quarter GiB (tiny models: 0.25 GiB; SmolLM2: 0.75)."""
    import json
    import math

    c = json.loads((Path(model) / "config.json").read_text())
    c = c.get("text_config", c)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * 4
    return max(0.25, math.ceil(2 * per_token * c["max_position_embeddings"] / 2**30 * 4) / 4)


@pytest.fixture(scope="session")
def engines():
    pool = SharedEngines()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def lab(model_path, runs_dir, engines):
    """One real Lab (vLLM + proxy) for the whole test session, on a fixed free port, over the shared tiny-calc engine."""
    with engines.lab(model_path, port=free_port(), runs_dir=str(runs_dir), run_name="shared") as lab:
        yield lab
    assert lab.closed


@pytest.fixture
def scripted_lab(model_path, tokenizer, tmp_path):
    """A Lab whose engine is scripted: real HTTP and store, no vLLM. For tests of the HTTP layer only."""
    from polar_lab import Lab
    from polar_lab.engine import ScriptedEngine

    engine = ScriptedEngine(tokenizer, ["Hello there."], model_path=model_path, model_name="scripted")
    with Lab(port=0, engine=engine, runs_dir=str(tmp_path), run_name="scripted") as lab:
        yield lab


@pytest.fixture(scope="session")
def shipped_weights(model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return {k: v.clone() for k, v in model.state_dict().items()}  # lm_head.weight included


@pytest.fixture
def restore_weights(lab, shipped_weights):
    """Yield; then load the shipped weights back into the live engine for the tests that follow."""
    yield
    lab.sync_weights(shipped_weights)


def session_calls(lab, session):
    """The recorded calls of one session, in the order they were recorded."""
    return [c for c in lab.call_records() if c.session_id == session.id]
