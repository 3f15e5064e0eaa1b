"""Which GPUs the engine and the trainer ranks use on one node, checked before any process starts.

    engine GPUs   EngineConfig.gpus (default: the first `tensor_parallel_size` GPUs), tensor-parallel inside
    trainer GPUs  GRPOConfig.trainer_devices (default: the GPUs after the engine's), one per rank
    colocate      GRPOConfig.colocate=True lets trainer ranks share the engine's GPUs (on a 1-GPU machine they
                  always do; lower the engine's gpu_memory_utilization so both fit)

The layouts for 1, 2, 4 and 8 GPUs are in docs/scale.md. On a machine without GPUs the engine runs on the CPU
in one process (tensor_parallel_size 1) and trainer ranks are CPU processes.
"""

from __future__ import annotations

from collections.abc import Sequence

from polar_lab.config import EngineConfig
from polar_lab.errors import ConfigError


def visible_gpus() -> int:
    """GPUs torch can see (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def engine_gpus(config: EngineConfig, visible: int) -> list[int]:
    """The engine's GPU indices on this node (every local replica's, `replica_gpus`); a ConfigError for a
    layout that cannot run. Replicas on Ray (cluster="ray") take GPUs Ray gives them: none here."""
    if config.cluster == "ray":
        return []
    tp = config.tensor_parallel_size * config.replicas
    if visible == 0:
        if config.gpus or config.tensor_parallel_size > 1:
            raise ConfigError(f"the engine is set to GPUs {config.gpus} with tensor_parallel_size="
                              f"{config.tensor_parallel_size}, but no GPU is visible: on the CPU the engine is one "
                              f"process (tensor_parallel_size=1, gpus=None)")
        return []
    gpus = list(config.gpus) if config.gpus is not None else list(range(tp))
    if len(gpus) != tp:
        each = f" for each of replicas={config.replicas} ({tp} in all)" if config.replicas > 1 else ""
        raise ConfigError(f"the engine's gpus {gpus} must be tensor_parallel_size={config.tensor_parallel_size} "
                          f"GPUs{each}, one per shard")
    if len(set(gpus)) != len(gpus):
        raise ConfigError(f"the engine's gpus {gpus} name a GPU twice")
    missing = [g for g in gpus if not 0 <= g < visible]
    if missing:
        raise ConfigError(f"too few GPUs: the engine needs GPUs {gpus} (tensor_parallel_size={tp}) but {visible} "
                          f"are visible (0..{visible - 1})")
    return gpus


def replica_gpus(config: EngineConfig, visible: int) -> list[list[int] | None]:
    """Each local replica's GPUs: consecutive `tensor_parallel_size`-sized slices of `engine_gpus` (None on the CPU).

    >>> replica_gpus(EngineConfig(replicas=2, tensor_parallel_size=2), visible=8)
    [[0, 1], [2, 3]]
    """
    gpus, tp = engine_gpus(config, visible), config.tensor_parallel_size
    if not gpus:
        return [None] * config.replicas
    return [gpus[i * tp:(i + 1) * tp] for i in range(config.replicas)]


def check_heads(model_config, tp: int) -> None:
    """Tensor parallelism splits attention heads across GPUs: the query heads must divide evenly, and the
    key/value heads either divide evenly or are replicated (tp a multiple of them), as vLLM requires."""
    if tp == 1:
        return
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ConfigError(f"tensor_parallel_size={tp} does not divide the model's {heads} attention heads; use "
                          f"one of {[d for d in range(1, heads + 1) if heads % d == 0 and d <= 8]}")
    if kv % tp and tp % kv:
        raise ConfigError(f"tensor_parallel_size={tp} neither divides the model's {kv} key/value heads nor is a "
                          f"multiple of them")


def trainer_gpus(devices: Sequence[str] | None, world_size: int, engine: Sequence[int], visible: int, *,
                 colocate: bool) -> list[str]:
    """One device per trainer rank ("cuda:N", or "cpu" without GPUs); a ConfigError for overlap with the
    engine (unless `colocate`), unknown or repeated devices, or too few GPUs."""
    if visible == 0:
        if devices and any(d != "cpu" for d in devices):
            raise ConfigError(f"trainer_devices {list(devices)} name GPUs, but no GPU is visible")
        return ["cpu"] * world_size
    if devices is not None:
        indices = []
        for d in devices:
            head, _, index = d.partition(":")
            if head != "cuda" or not index.isdigit() or int(index) >= visible:
                raise ConfigError(f"trainer device {d!r} is not one of the {visible} visible GPUs (cuda:0.."
                                  f"cuda:{visible - 1})")
            indices.append(int(index))
        if len(set(indices)) != len(indices):
            raise ConfigError(f"trainer_devices {list(devices)} name a GPU twice: one rank per GPU")
        shared = sorted(set(indices) & set(engine))
        if shared and not (colocate or visible == 1):
            raise ConfigError(f"trainer_devices {list(devices)} overlap the engine's GPUs {list(engine)} (on {shared}); "
                              f"set colocate=True to share them (and lower gpu_memory_utilization), or pick others")
        return list(devices)
    free = [g for g in range(visible) if g not in engine]
    if len(free) >= world_size:
        return [f"cuda:{g}" for g in free[:world_size]]
    if world_size > visible:
        raise ConfigError(f"{world_size} trainer ranks need {world_size} GPUs (NCCL runs one rank per GPU), but "
                          f"{visible} are visible; lower world_size")
    if colocate or visible == 1:  # one GPU: sharing is the only layout there is
        return [f"cuda:{r % visible}" for r in range(world_size)]
    raise ConfigError(f"too few GPUs: the engine uses {list(engine)} and {world_size} trainer rank(s) need their own, "
                      f"but only {len(free)} of {visible} are free; lower world_size, or set colocate=True to share "
                      f"the engine's GPUs (and lower gpu_memory_utilization)")
