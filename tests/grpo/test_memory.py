"""The memory plan reads a hybrid model's config right: Qwen3.5-4B's published shape (configs/qwen3.5-4b), where only
8 of 32 layers hold a KV cache and the other 24 hold a fixed DeltaNet state per sequence, and where LoRA adapters
land on different projections per layer type. Config-only: empty (meta) models, no weights, no engine."""

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from polar_lab.grpo.memory import ModelShape, plan

ROOT = Path(__file__).resolve().parents[2]
QWEN35_4B = ROOT / "configs/qwen3.5-4b"


@pytest.fixture(scope="module")
def shape() -> ModelShape:
    return ModelShape.from_config(AutoConfig.from_pretrained(QWEN35_4B))


def test_the_4b_config_is_qwen35s_hybrid(shape):
    assert (shape.layers, shape.linear_layers, shape.attention_layers) == (32, 24, 8)
    assert 4.1e9 < shape.params < 4.3e9  # the text model of the published "4B" (its vision tower left out)
    assert shape.output_gate and shape.conv_channels == 2 * 16 * 128 + 32 * 128


def test_only_the_attention_layers_hold_a_kv_cache_and_the_deltanet_layers_a_fixed_state(shape):
    engine = plan(shape, context=65536, sequences=16, engine_dtype_bytes=2)["engine"]
    assert engine["kv_cache"] == 2 * 8 * 4 * 256 * 2 * 65536 * 16  # K and V, 8 layers, 4 kv heads of 256, bf16
    recurrent, conv = 32 * 128 * 128 * 4, 3 * (2 * 16 * 128 + 32 * 128) * 2  # fp32 state; bf16 window of 3
    assert engine["linear_states"] == 24 * (recurrent + conv) * 16
    # the state does not grow with the context: a twice longer context doubles only the KV cache
    longer = plan(shape, context=131072, sequences=16, engine_dtype_bytes=2)["engine"]
    assert longer["linear_states"] == engine["linear_states"] and longer["kv_cache"] == 2 * engine["kv_cache"]


def test_a_model_without_linear_layers_is_planned_as_before():
    config = AutoConfig.from_pretrained(ROOT / "data/models/tiny-calc")
    tiny = ModelShape.from_config(config)
    engine = plan(tiny, context=4096, sequences=2, engine_dtype_bytes=4)["engine"]
    assert tiny.linear_layers == 0 and "linear_states" not in engine
    assert engine["kv_cache"] == 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4 \
        * 4096 * 2


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["in_proj_qkv", "in_proj_z", "out_proj"],
                                     ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_a",
                                      "in_proj_b", "out_proj", "gate_proj", "up_proj", "down_proj"]])
def test_lora_parameters_match_what_peft_builds_on_each_layer_type(shape, targets):
    from peft import LoraConfig, get_peft_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(QWEN35_4B))
    model = get_peft_model(model, LoraConfig(r=16, target_modules=targets))
    built = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    assert shape.lora_params(16, targets) == built
