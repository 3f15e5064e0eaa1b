"""The accelerator check scripts stay runnable: CI runs check_cuda_trainer.py's CPU form and sees check_gpu.py refuse;
a GPU machine runs both (docs/scale.md reads check_gpu.py's table)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_cuda_trainer.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_the_check_passes_on_cpu_with_two_gloo_ranks_in_bf16():
    """bf16, the GPU's dtype, whose tolerances the script sets apart; the same checks in fp32 are the trainer's own
    tests (tests/grpo/test_fsdp.py, test_distributed.py, test_lora.py: the same code at fp32 tolerances)."""
    done = _run("--device", "cpu", "--dtype", "bfloat16", "--world-size", "2")
    assert done.returncode == 0 and "ALL PASSED" in done.stdout, done.stdout + done.stderr[-2000:]
    assert done.stdout.count("PASS ") == 7  # DDP and FSDP ranks, checkpointing and LoRA included


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_the_check_passes_on_cuda_in_bf16():
    ranks = "2" if torch.cuda.device_count() >= 2 else "1"
    done = _run("--device", "cuda", "--dtype", "bfloat16", "--world-size", ranks)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the check runs instead of refusing")
def test_the_gpu_check_refuses_in_one_line_on_a_machine_without_cuda():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_gpu.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2 and done.stdout.startswith("refused: no CUDA device") and done.stdout.count("\n") == 1
