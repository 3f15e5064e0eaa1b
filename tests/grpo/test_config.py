"""GRPOConfig: TRL names, cross-field checks that quote the values, YAML sections that map 1:1."""

import pytest

from polar_lab.errors import ConfigError
from polar_lab.grpo import GRPOConfig
from polar_lab.grpo.run import load_train_config

BAD = [  # (fields, words the error must contain)
    ({"loss_type": "ppo"}, ["loss_type", "ppo"]),
    ({"scale_rewards": "rank"}, ["scale_rewards", "rank"]),
    ({"epsilon": 0.3, "epsilon_high": 0.2}, ["0.2", "0.3"]),  # clip-higher must not be lower
    ({"num_generations": 1}, ["num_generations", "1"]),  # no group baseline
    ({"async_mode": True, "max_staleness": 0}, ["max_staleness", "0"]),
    ({"vllm_importance_sampling_clip_max": 0.5}, ["vllm_importance_sampling_clip_max", "0.5"]),
    ({"vllm_importance_sampling_clip_min": 1.5}, ["vllm_importance_sampling_clip_min", "1.5"]),
    ({"vllm_importance_sampling_mode": "sequence"}, ["vllm_importance_sampling_mode", "sequence"]),
    ({"importance_sampling_level": "run"}, ["importance_sampling_level", "run"]),
    ({"loss_type": "cispo"}, ["cispo", "epsilon_high", "0.28"]),  # CISPO's cap must be set: 0.28 would cut every ratio
    ({"world_size": 2, "trainer_devices": ["cpu"]}, ["1", "2"]),
    ({"stale_groups": "keep"}, ["keep"]),
    ({"async_mode": True, "async_window_steps": 3, "max_staleness": 2}, ["async_window_steps", "3", "2"]),
    ({"max_reruns": -1}, ["max_reruns", "-1"]),
    ({"async_window_steps": 0}, ["async_window_steps", "0"]),
    ({"teacher_scorer": "server"}, ["teacher_scorer", "server"]),
    ({"sync_pause": "abort"}, ["sync_pause", "abort"]),  # drain or keep: an abort would lose what was sampled
    ({"teacher_scorer": "engine", "temperature": 0.7}, ["T=1", "0.7", "teacher_scorer='trainer'"]),  # vLLM's raw scores
]


@pytest.mark.parametrize("fields,words", BAD)
def test_bad_combinations_are_refused_with_both_values(fields, words):
    with pytest.raises(ConfigError) as err:
        GRPOConfig(**fields)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_defaults_follow_trl_where_trl_has_the_field():
    c = GRPOConfig()
    assert (c.loss_type, c.scale_rewards, c.beta, c.num_iterations, c.epsilon) == ("dapo", "group", 0.0, 1, 0.2)
    assert GRPOConfig(epsilon_high=None).epsilon_high == c.epsilon
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"  # older TRL spelled it as a bool


def test_yaml_sections_map_onto_the_dataclasses(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("engine: {model: some/folder}\nproxy: {port: 0}\ngrpo: {learning_rate: 0.01, max_steps: 3}\n")
    lab_config, grpo = load_train_config(path, max_steps=5)
    assert lab_config.engine.model == "some/folder" and lab_config.proxy.port == 0
    assert grpo.learning_rate == 0.01 and grpo.max_steps == 5  # the CLI flag overrides the file


def test_train_set_overrides_any_grpo_setting_and_null_lifts_the_files(tmp_path, monkeypatch, capsys):
    from polar_lab import cli

    path = tmp_path / "run.yaml"
    path.write_text("grpo: {overlong_buffer_len: 192, overlong_max_tokens: 384, learning_rate: 1e-2}\n")  # YAML 1.2
    seen = []
    monkeypatch.setattr("polar_lab.grpo.run.train_from_config", lambda lab, grpo: seen.append(grpo))
    monkeypatch.setattr("polar_lab.grpo.run.format_train_summary", lambda summary: "")
    assert cli.main(["train", str(path), "--set", "mask_truncated_completions=true",
                     "--set", "overlong_max_tokens=null", "--set", "overlong_buffer_len = 64",
                     "--max-steps", "3", "--set", "max_steps=4"]) == 0
    assert cli.main(["train", str(path), "--set", "learning_rate=3e-4", "--time-budget-s", "0", "--set",
                     "time_budget_s=60"]) == 0  # 3e-4 is text to PyYAML, a float to YAML 1.2 and here
    grpo = seen[0]
    assert grpo.mask_truncated_completions is True and grpo.overlong_max_tokens is None
    assert grpo.overlong_buffer_len == 64 and grpo.learning_rate == 0.01 and grpo.max_steps == 4  # --set comes last
    assert seen[1].learning_rate == 3e-4 and seen[1].time_budget_s == 60
    for bad, words in [("learning_rate", "takes KEY=VALUE"), ("learning_rat=0.1", "learning_rat"),
                       ("num_generations=1", "num_generations"), ("x=[1", "not a YAML value"),
                       ("max_steps=null", "max_steps must be a number, got None"),
                       ("learning_rate=fast", "learning_rate must be a number, got 'fast'")]:
        with pytest.raises(SystemExit) as exit_:
            cli.main(["train", str(path), "--set", bad])
        assert exit_.value.code == 2 and words in capsys.readouterr().err
    assert len(seen) == 2


@pytest.mark.parametrize("text,word", [("grpo: {learning_rat: 0.1}\n", "learning_rat"),
                                       ("trainer: {}\n", "trainer")])
def test_unknown_keys_are_errors_not_silent_no_ops(tmp_path, text, word):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=word):
        load_train_config(path)


def test_the_shipped_config_loads():
    _, grpo = load_train_config("configs/tiny_calc_grpo.yaml")
    assert grpo.harness == "calculator" and grpo.num_generations == 8


def test_a_config_file_with_the_earlier_tis_cap_still_loads_under_trls_names():
    with pytest.warns(DeprecationWarning, match="vllm_importance_sampling_clip_max"):
        capped = GRPOConfig.from_dict({"tis_cap": 3.0})
    assert capped.vllm_importance_sampling_clip_max == 3.0 and capped.tis_cap == 3.0
    with pytest.warns(DeprecationWarning):
        off = GRPOConfig.from_dict({"tis_cap": None})
    assert not off.vllm_importance_sampling_correction and off.tis_cap is None



def test_the_tis_cap_warning_names_the_line_that_loaded_the_file(tmp_path):
    from polar_lab.grpo.run import load_train_config

    (tmp_path / "old.yaml").write_text("grpo: {tis_cap: 3.0}\n")
    with pytest.warns(DeprecationWarning, match="tis_cap") as caught:
        load_train_config(tmp_path / "old.yaml")  # the loader, then from_dict: not polar_lab's own line
    # only its own warning is counted (see test_async_rollouts' second producer)
    assert [w.filename for w in caught if "tis_cap" in str(w.message)] == [__file__]
