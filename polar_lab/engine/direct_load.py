"""A standby load that hands each layer its new weight straight to vLLM's own processing, without vLLM's loaders.

Runs in the engine process, in the standby's thread (engine/standby.py `load` calls `load` here first). Owns one
cache: the last plan it made, keyed by the file's layout (a slot's layout is the same sync after sync).

Why: vLLM's layerwise reload, which a standby load otherwise runs, costs more in Python than in copying. For
SmolLM2-135M (fp32) it spent ~0.11 s of a 0.37 s load in bookkeeping: every parameter re-created on the meta device,
each weight loader run twice (once on meta tensors to count what it would copy), the layer re-materialised and copied
into, then its processed values copied back. What the load must produce is small: on a CPU engine every linear
layer's weight lives only in its packed oneDNN kernel (`cpu_linear`; the parameter itself is left empty), and the
rest are embeddings and norms. So for a model whose layout this module knows:

- a linear layer gets its new weight as one tensor — the fused q/k/v or gate/up parts side by side, a view of the
  slot's bytes where the writer put them next to each other (no copy), else concatenated — and vLLM's own
  `quant_method.process_weights_after_loading` packs it, as it does after any load; the kernel packs a copy, so the
  slot can be rewritten afterwards (checked: tests/engine/test_direct_load.py);
- an embedding (and a head, tied or not) and a norm are copied into, as vLLM's weight loaders copy; an embedding's
  rows past the vocabulary are zeroed, as its loader zeroes them; then the embeddings are processed.

The result is the same kernels from the same bytes: tests/engine/test_standby.py compares a swapped-in direct load
with vLLM's in-place reload of the same file, logprob for logprob, bit for bit.

What it refuses (`Unsupported`; the layerwise reload runs instead, as before): a model class outside `CLASSES`
(their `load_weights` is the plain one this mirrors: names mapped by `hf_to_vllm_mapper`, fused parts stacked in
order, nothing transformed); a layer of another kind or quantised, or one whose kernel keeps its weight (an engine
dtype oneDNN cannot pack here, e.g. bf16 on AVX2); a file name that maps to no parameter, a parameter no name covers,
or a shape that does not fit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

log = logging.getLogger("polar_lab.engine.direct_load")

# the model classes whose `load_weights` does nothing this module does not (read in vLLM 0.32's models/llama.py,
# qwen2.py, qwen3.py: the checkpoint mapper, stacked q/k/v and gate/up, default copies for the rest)
CLASSES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


class Unsupported(Exception):
    """Why a load cannot go the direct way (the layerwise reload runs instead)."""


@dataclass
class Step:
    """One module's part of a load: its parameters, each from the file's tensors in part order."""
    module: torch.nn.Module
    kind: str  # "linear" (packed kernel), "embedding" (copied, then processed) or "copy" (a norm)
    sources: dict[str, list[str]] = field(default_factory=dict)  # parameter ("weight", "bias") -> file names


@dataclass
class Plan:
    """The steps of a load, in order: copies, then linear layers, then the output head's processing.

    Of two names for one tied tensor only the later one in the file is copied: in vLLM's loader, which copies both
    in the file's order, the later one wins. Only the head's embedding is processed: vLLM packs a kernel for every
    embedding, but calls it only on the head (its logits); an input embedding's lookups read its weight. So the
    standby's input embedding keeps the packed kernel of an older load — never called, and swapped in with the rest.
    """
    copies: list[tuple[str, Step, str]]  # (file name, step, parameter)
    linears: list[Step]
    embeddings: list[Step]  # the head, if it is an embedding vLLM packs (processed after every copy)


_cache: dict[tuple, Plan] = {}  # one entry: (id of the model, the file's layout) -> its plan


def load(model, tensors: dict[str, torch.Tensor], pace=None) -> None:
    """Load `tensors` (file name -> tensor, in the file's order) into `model`, the standby; raises `Unsupported`
    before anything is written when the direct way does not apply. pace: called between two steps (engine/standby.py
    `Pacer`)."""
    key = (id(model), tuple((name, tuple(t.shape), t.dtype) for name, t in tensors.items()))
    if key not in _cache:
        _cache.clear()
        _cache[key] = plan(model, {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()})
    steps = _cache[key]
    for name, step, param in steps.copies:
        _copy(step, param, tensors[name])
        _pace(pace)
    for step in steps.linears:
        _linear(step, tensors)
        _pace(pace)
    for step in steps.embeddings:
        step.module.quant_method.process_weights_after_loading(step.module)
        _pace(pace)


def _pace(pace) -> None:
    if pace is not None:
        pace()


def plan(model, layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> Plan:
    """The steps that load a file of `layout` (name -> (shape, dtype)) into `model`; `Unsupported` if any part of it
    is not one this module knows."""
    if type(model).__name__ not in CLASSES:
        raise Unsupported(f"{type(model).__name__} is not one of the classes the direct load knows")
    owners = _owners(model)
    parts: dict[str, list[tuple[int, str]]] = {}  # engine parameter name -> [(part index, file name)]
    for name in layout:
        target, index = target_of(model, name)
        if target not in owners:
            raise Unsupported(f"{name} maps to {target}, which is no parameter of the model")
        parts.setdefault(target, []).append((index, name))
    uncovered = sorted(set(owners) - set(parts))
    if uncovered:
        raise Unsupported(f"the file does not cover {len(uncovered)} parameters, e.g. {uncovered[:3]}")
    steps: dict[int, Step] = {}
    for target, found in parts.items():
        module, param = owners[target]
        step = steps.setdefault(id(module), Step(module, _kind(module)))
        names = [name for _, name in sorted(found)]
        if step.kind != "linear" and len(found) > 1:
            raise Unsupported(f"{target} would take {len(found)} tensors: {names}")
        step.sources[param] = names
        _check(step, param, [layout[name] for name in names], target)
    order = {name: i for i, name in enumerate(layout)}
    last: dict[int, tuple[str, Step, str]] = {}  # a tied tensor, two names: only the later one's copy stays
    for name, step, param in sorted(((name, step, param) for step in steps.values() if step.kind != "linear"
                                     for param, names in step.sources.items() for name in names),
                                    key=lambda entry: order[entry[0]]):
        last[id(getattr(step.module, param))] = (name, step, param)
    head = getattr(model, "lm_head", None)
    return Plan(sorted(last.values(), key=lambda entry: order[entry[0]]),
                [s for s in steps.values() if s.kind == "linear"],
                [s for s in steps.values() if s.kind == "embedding" and s.module is head])


def _owners(model) -> dict[str, tuple[torch.nn.Module, str]]:
    """Every parameter name, tied ones under each of their names -> (its module, its key there)."""
    return {f"{prefix}.{key}" if prefix else key: (module, key)
            for prefix, module in model.named_modules(remove_duplicate=False)
            for key, param in module._parameters.items() if param is not None}


def target_of(model, name: str) -> tuple[str, int]:
    """The engine parameter a file tensor loads into, and its part there (0 unless it is one of a fused layer's parts:
    q, k, v of qkv_proj are 0, 1, 2), by the model's own checkpoint mapper (`hf_to_vllm_mapper`) and fused layers
    (`packed_modules_mapping`)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    shard = None
    if mapper is not None:
        mapped = mapper._map_name_with_shard(name)
        if mapped is None:
            raise Unsupported(f"the model's mapper drops {name}")
        name, shard = mapped
    if isinstance(shard, str) and shard in ("q", "k", "v"):
        return name, "qkv".index(shard)
    if isinstance(shard, int):
        return name, shard
    if shard is not None:
        raise Unsupported(f"{name} loads into shards {shard!r}")
    for whole, pieces in (getattr(model, "packed_modules_mapping", None) or {}).items():
        for index, piece in enumerate(pieces):
            if f".{piece}." in name:
                return name.replace(f".{piece}.", f".{whole}.", 1), index
    return name, 0


def _kind(module) -> str:
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (UnquantizedEmbeddingMethod,
                                                                     VocabParallelEmbedding)

    if isinstance(module, LinearBase) and type(module.quant_method) is UnquantizedLinearMethod:
        if module.weight.numel() != 0 or getattr(module, "_cpu_skip_gemm_dispatch", False):
            raise Unsupported(f"{type(module).__name__}'s kernel keeps its weight (not a packed CPU kernel)")
        if getattr(module, "tp_size", 1) != 1:
            raise Unsupported("tensor-parallel layers")
        return "linear"
    if isinstance(module, VocabParallelEmbedding) and type(module.quant_method) is UnquantizedEmbeddingMethod:
        return "embedding"
    if type(module) is RMSNorm:
        return "copy"
    raise Unsupported(f"no direct load for a {type(module).__name__}")


def _check(step: Step, param: str, shapes: list[tuple[tuple[int, ...], torch.dtype]], target: str) -> None:
    """The file's parts fit the parameter: a norm's shape exactly, an embedding's up to its padded vocabulary, a linear
    layer's parts stacked along its output rows in its own part sizes."""
    module = step.module
    if step.kind == "linear":
        rows, cols = module.output_size_per_partition, module.input_size_per_partition
        sizes = list(getattr(module, "output_sizes", None) or [rows]) if param == "weight" or param == "bias" else []
        want = [(size, cols) if param == "weight" else (size,) for size in sizes]
        if len(shapes) != len(want) or any(tuple(s) != w for (s, _), w in zip(shapes, want)):
            raise Unsupported(f"{target}: the file's parts {[s for s, _ in shapes]} are not its {want}")
        if param == "bias" and module.bias is None:
            raise Unsupported(f"{target}: no bias to load")
        return
    have = tuple(getattr(module, param).shape)
    (shape, _), = shapes
    fits = shape == have or (step.kind == "embedding" and shape[1:] == have[1:] and shape[0] <= have[0])
    if not fits:
        raise Unsupported(f"{target}: the file's {shape} does not fit its {have}")


def _copy(step: Step, param: str, source: torch.Tensor) -> None:
    """A copy into a parameter, as vLLM's loaders copy: an embedding's padding rows zeroed."""
    data = getattr(step.module, param).data
    data[:source.shape[0]].copy_(source)
    if data.shape[0] > source.shape[0]:
        data[source.shape[0]:].zero_()


def _linear(step: Step, tensors: dict[str, torch.Tensor]) -> None:
    """Pack a linear layer's new weight into its kernel with vLLM's own processing; the layer keeps its parameter
    objects (the layerwise reload, which a later load may run, finds its loaders on them)."""
    module = step.module
    if "bias" in step.sources:
        bias = module.bias.data
        at = 0
        for name in step.sources["bias"]:
            bias[at:at + tensors[name].shape[0]].copy_(tensors[name])
            at += tensors[name].shape[0]
    kernel = module._parameters["weight"]
    weight = _stacked([tensors[name] for name in step.sources["weight"]]).to(kernel.dtype)
    module._parameters["weight"] = torch.nn.Parameter(weight, requires_grad=False)
    try:
        module.quant_method.process_weights_after_loading(module)
        if module.weight.numel() != 0:  # the kernel would read the slot's bytes, which the next sync rewrites
            raise RuntimeError(f"{type(module).__name__}'s kernel kept its weight")
    finally:
        module._parameters["weight"] = kernel


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts stacked along rows: a view when they already lie back to back in one buffer (as `WeightsWriter`
    writes a layer's parts when the trainer lists them in order), else a new tensor."""
    first = parts[0]
    if len(parts) == 1:
        return first.contiguous()
    rows = sum(p.shape[0] for p in parts)
    back_to_back = all(p.is_contiguous() and p.dtype == first.dtype and p.shape[1:] == first.shape[1:] for p in parts)
    at = first.data_ptr()
    for p in parts:
        back_to_back = back_to_back and p.data_ptr() == at
        at += p.numel() * p.element_size()
    if back_to_back:
        return first.as_strided((rows, *first.shape[1:]), (first[0].numel(), *first.stride()[1:]))
    return torch.cat(parts)
