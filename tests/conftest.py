"""Shared fixtures. Integration fixtures boot the real vLLM engine once per test session and tear it down.

POLAR_LAB_TEST_MODEL overrides the model folder (default: the shipped data/models/tiny-calc).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = os.environ.get("POLAR_LAB_TEST_MODEL", str(ROOT / "data" / "models" / "tiny-calc"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@pytest.fixture(scope="session")
def lab(model_path, runs_dir):
    """One real Lab (vLLM + proxy) for the whole test session, on a fixed free port."""
    from polar_lab import Lab

    with Lab(model_path, port=free_port(), runs_dir=str(runs_dir), run_name="shared") as lab:
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
