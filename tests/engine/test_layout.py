"""GPU layouts of one node (engine GPUs, tensor parallelism, trainer ranks), checked before anything starts.
The functions take the number of visible GPUs, so the layouts of 1–8 GPU machines are tested here on a CPU."""

import psutil
import pytest
from transformers import AutoConfig

from polar_lab import Lab
from polar_lab.config import EngineConfig, LabConfig
from polar_lab.engine.layout import check_heads, engine_gpus, replica_gpus, trainer_gpus
from polar_lab.errors import ConfigError
from polar_lab.grpo import GRPOConfig
from polar_lab.grpo.trainer import check_run


@pytest.mark.parametrize("visible,tp,ranks,colocate,expected", [
    (1, 1, 1, False, ([0], ["cuda:0"])),  # one GPU: both on it
    (2, 1, 1, False, ([0], ["cuda:1"])),
    (4, 1, 3, False, ([0], ["cuda:1", "cuda:2", "cuda:3"])),
    (4, 2, 2, False, ([0, 1], ["cuda:2", "cuda:3"])),
    (8, 2, 6, False, ([0, 1], [f"cuda:{g}" for g in range(2, 8)])),
    (8, 4, 4, False, ([0, 1, 2, 3], ["cuda:4", "cuda:5", "cuda:6", "cuda:7"])),
])
def test_the_default_layouts_of_one_to_eight_gpus(visible, tp, ranks, colocate, expected):
    engine = engine_gpus(EngineConfig(tensor_parallel_size=tp), visible)
    assert (engine, trainer_gpus(None, ranks, engine, visible, colocate=colocate)) == expected


def test_layouts_that_cannot_run_are_clear_errors():
    with pytest.raises(ConfigError, match="overlap the engine's GPUs"):
        trainer_gpus(["cuda:0", "cuda:1"], 2, [0], 4, colocate=False)
    assert trainer_gpus(["cuda:0"], 1, [0], 1, colocate=True) == ["cuda:0"]
    assert trainer_gpus(None, 1, [0], 1, colocate=False) == ["cuda:0"]  # one GPU: sharing is the only layout
    with pytest.raises(ConfigError, match="too few GPUs.*only 0 of 2 are free.*colocate=True"):
        trainer_gpus(None, 1, [0, 1], 2, colocate=False)
    with pytest.raises(ConfigError, match="too few GPUs: the engine needs GPUs \\[0, 1, 2, 3\\]"):
        engine_gpus(EngineConfig(tensor_parallel_size=4), 2)
    with pytest.raises(ConfigError, match="must be tensor_parallel_size=2 GPUs"):
        engine_gpus(EngineConfig(tensor_parallel_size=2, gpus=[3]), 8)
    with pytest.raises(ConfigError, match="must be tensor_parallel_size=2 GPUs for each of replicas=2 \\(4 in all\\)"):
        engine_gpus(EngineConfig(tensor_parallel_size=2, replicas=2, gpus=[0, 1]), 8)
    with pytest.raises(ConfigError, match="too few GPUs: the engine needs GPUs \\[0, 1, 2, 3\\]"):
        engine_gpus(EngineConfig(tensor_parallel_size=2, replicas=2), 2)  # local replicas take GPUs of their own
    assert replica_gpus(EngineConfig(replicas=3), 4) == [[0], [1], [2]]
    assert replica_gpus(EngineConfig(replicas=2), 0) == [None, None]  # CPU engines
    assert engine_gpus(EngineConfig(replicas=8, cluster="ray"), 1) == []  # Ray gives replicas their GPUs
    with pytest.raises(ConfigError, match="not one of the 2 visible GPUs"):
        trainer_gpus(["cuda:5"], 1, [0], 2, colocate=False)
    with pytest.raises(ConfigError, match="name a GPU twice"):
        trainer_gpus(["cuda:1", "cuda:1"], 2, [0], 4, colocate=False)
    with pytest.raises(ConfigError, match="no GPU is visible"):
        engine_gpus(EngineConfig(tensor_parallel_size=2), 0)
    with pytest.raises(ConfigError, match="2 trainer ranks need 2 GPUs \\(NCCL runs one rank per GPU\\)"):
        trainer_gpus(None, 2, [0], 1, colocate=True)
    assert trainer_gpus(["cuda:0"], 1, [0], 1, colocate=False) == ["cuda:0"]  # one GPU: shared, as by default


def test_tensor_parallelism_must_split_the_heads(model_path):
    config = AutoConfig.from_pretrained(model_path)  # 4 attention heads, 2 key/value heads
    check_heads(config, 2)
    check_heads(config, 4)  # each key/value head replicated on 2 GPUs
    with pytest.raises(ConfigError, match="does not divide the model's 4 attention heads; use one of \\[1, 2, 4\\]"):
        check_heads(config, 3)


def test_a_lab_or_a_run_with_an_impossible_layout_starts_nothing(model_path, tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ConfigError, match="no GPU is visible"):  # this machine has none
        Lab(model_path, tensor_parallel_size=2, runs_dir=str(tmp_path))
    lab_config = LabConfig.from_dict({"engine": {"model": model_path}})
    with pytest.raises(ConfigError, match="trainer_devices .* name GPUs, but no GPU is visible"):
        check_run(lab_config, GRPOConfig(device="cuda", trainer_devices=["cuda:1"]))
    with pytest.raises(ConfigError, match="Target modules"):
        check_run(lab_config, GRPOConfig(peft_config={"r": 8, "target_modules": ["c_attn"]}, lora_sync="merged"))
    transfer = LabConfig.from_dict({"engine": {"model": model_path, "weights_transport": "gloo"}})
    with pytest.raises(ConfigError, match="use weights_transport='memory'"):  # vLLM's API takes one process's tensors
        check_run(transfer, GRPOConfig(world_size=2, strategy="fsdp"))
    check_run(transfer, GRPOConfig())  # one rank in the Lab's process: the transfer's own case
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before  # no engine, no rank started
