"""Config validation: bad values and unknown keys fail loudly, quoting what was given."""

import pytest

from polar_lab.config import EngineConfig, LabConfig, ProxyConfig
from polar_lab.errors import ConfigError
from polar_lab.config import make_config


@pytest.mark.parametrize("make, needle", [
    (lambda: EngineConfig(kv_cache_gib=0), "kv_cache_gib"),            # no KV cache
    (lambda: EngineConfig(gpu_memory_utilization=1.5), "1.5"),         # more than the GPU
    (lambda: ProxyConfig(port=70000), "70000"),                        # not a TCP port
    (lambda: ProxyConfig(default_max_tokens=0), "default_max_tokens"),  # nothing to generate
    (lambda: EngineConfig(weights_transport="rdma"), "'rdma'"),       # memory, file, or one of vLLM's
    (lambda: EngineConfig(weights_transport="nccl", replicas=2), "replicas=2"),  # one engine takes a transfer
])
def test_bad_values_are_rejected_with_the_value(make, needle):
    with pytest.raises(ConfigError, match=needle):
        make()


def test_unknown_yaml_keys_are_an_error_not_a_silent_noop():
    with pytest.raises(ConfigError, match="tempurature"):
        LabConfig.from_dict({"engine": {"tempurature": 1.0}})
    with pytest.raises(ConfigError, match="enigne"):
        LabConfig.from_dict({"enigne": {}})


def test_flat_lab_keywords_land_in_their_section():
    cfg = make_config("m", None, {"port": 0, "run_name": "r", "max_model_len": 4096})
    assert (cfg.engine.model, cfg.proxy.port, cfg.store.run_name, cfg.engine.max_model_len) == ("m", 0, "r", 4096)
    with pytest.raises(TypeError, match="prot"):
        make_config("m", None, {"prot": 1})


def test_chunked_prefill_is_on_unless_turned_off_and_a_config_json_of_earlier_versions_keeps_the_default():
    from polar_lab.engine.worker import _prefill_args

    assert EngineConfig().chunked_prefill is True and _prefill_args(EngineConfig()) == {}
    assert LabConfig.from_dict({"engine": {"chunked_prefill": None}}).engine.chunked_prefill is True  # null meant default
    off = _prefill_args(EngineConfig(chunked_prefill=False, max_model_len=4096))
    assert off == {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096}  # a whole context per step


def test_round_trip_through_dict():
    cfg = LabConfig.from_dict({"engine": {"model": "x"}, "proxy": {"port": 1234}})
    assert LabConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("make, needle", [
    (lambda: EngineConfig(standby_weights=True, max_lora_rank=16), "max_lora_rank=16"),  # vLLM wraps LoRA layers
    (lambda: EngineConfig(standby_weights=True, tensor_parallel_size=2), "tensor_parallel_size=2"),  # one worker swaps
    (lambda: EngineConfig(standby_weights=True, enforce_eager=False), "enforce_eager=False"),  # graphs hold tensors
])
def test_a_standby_copy_the_engine_cannot_swap_is_refused(make, needle):
    with pytest.raises(ConfigError, match=needle):
        make()


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_standby_share_outside_zero_to_one_is_refused(share):
    with pytest.raises(ConfigError, match=f"standby_share must be in \\(0, 1\\], got {share}"):
        EngineConfig(standby_share=share)


@pytest.mark.parametrize("config, cuda, enabled", [
    (EngineConfig(), False, True),                               # the default: a local CPU engine keeps one
    (EngineConfig(), True, False),                               # GPU memory is the scarce thing: off unless asked
    (EngineConfig(cluster="ray"), False, False),                 # a Ray replica may get its weights only at the load
    (EngineConfig(max_lora_rank=16), False, False),              # LoRA: the adapter sync is small anyway
    (EngineConfig(enforce_eager=False), False, False),           # compiled graphs would keep the old tensors
    (EngineConfig(standby_weights=False), False, False),         # asked off
    (EngineConfig(standby_weights=True), True, True),            # asked on, GPU too (unverified there: the docstring)
])
def test_the_standby_copy_is_on_by_default_only_for_a_local_cpu_engine(config, cuda, enabled):
    assert config.standby_enabled(cuda) is enabled
