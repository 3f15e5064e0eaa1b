"""Run a script's `--vllm-check` mode in a child process and read back its `VLLM_RESULT {json}` line.

vLLM gets its own process so the parent's torch/threads stay untouched and nothing lingers after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from polar_lab.engine.process_env import torchvision_stand_in  # noqa: E402


def run_vllm_child(script: str, args: list[str], timeout: float = 600) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    torchvision_stand_in(env)  # vLLM's Qwen3.5 class imports torchvision (polar_lab/engine/shims says why)
    proc = subprocess.Popen([sys.executable, script, "--vllm-check", *args], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # only the child this function started
        proc.communicate()
        return {"ok": False, "error": "vLLM check timed out"}
    for line in stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return json.loads(line[len("VLLM_RESULT "):])
    return {"ok": False, "error": f"vLLM check exited {proc.returncode} without a result"}
