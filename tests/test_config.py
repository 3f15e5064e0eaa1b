"""Config validation: bad values and unknown keys fail loudly, quoting what was given."""

import pytest

from polar_lab.config import EngineConfig, LabConfig, ProxyConfig
from polar_lab.errors import ConfigError
from polar_lab.lab import _make_config


@pytest.mark.parametrize("make, needle", [
    (lambda: EngineConfig(kv_cache_gib=0), "kv_cache_gib"),            # no KV cache
    (lambda: EngineConfig(gpu_memory_utilization=1.5), "1.5"),         # more than the GPU
    (lambda: ProxyConfig(port=70000), "70000"),                        # not a TCP port
    (lambda: ProxyConfig(default_max_tokens=0), "default_max_tokens"),  # nothing to generate
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
    cfg = _make_config("m", None, {"port": 0, "run_name": "r", "max_model_len": 4096})
    assert (cfg.engine.model, cfg.proxy.port, cfg.store.run_name, cfg.engine.max_model_len) == ("m", 0, "r", 4096)
    with pytest.raises(TypeError, match="prot"):
        _make_config("m", None, {"prot": 1})


def test_round_trip_through_dict():
    cfg = LabConfig.from_dict({"engine": {"model": "x"}, "proxy": {"port": 1234}})
    assert LabConfig.from_dict(cfg.to_dict()) == cfg
