"""A standby load that hands each layer its new weight straight to vLLM's own processing, without vLLM's loaders.

Runs in the engine process, in the standby's thread (engine/standby.py `load` calls `load` here first). Owns one
cache: the last plan it made, keyed by the model and the file's layout (a slot's layout is the same sync after sync).

Why: vLLM's layerwise reload, which a standby load otherwise runs, costs more in Python than in copying. For
SmolLM2-135M (fp32) ~0.11 s of a 0.37 s load went to vLLM's weight loaders, the reload's bookkeeping and the messages:
every parameter re-created on the meta device, each weight loader run twice (once on meta tensors to count what it
would copy), the layer re-materialised and copied into, then its processed values copied back. What the load must
produce is small: on a CPU engine every linear layer's weight lives only in its packed oneDNN kernel (`cpu_linear`;
the parameter itself is left empty), and the rest are embeddings and norms. So for a model whose layout this module
knows:

- a linear layer gets its new weight as one tensor — the fused q/k/v or gate/up parts side by side, a view of the
  slot's bytes where the writer put them next to each other (no copy), else concatenated — and vLLM's own
  `quant_method.process_weights_after_loading` packs it, as it does after any load; the kernel packs a copy, so the
  slot can be rewritten afterwards (tests/engine/test_standby.py, the no-view test);
- embeddings (a head too, tied or not) and norms are copied into, as vLLM's weight loaders copy; then the head alone
  is processed (packed).

The result is the same kernels from the same bytes: a swapped-in direct load samples the same tokens and logprobs as
vLLM's in-place reload of the same file, bit for bit — tested on tiny-calc (Qwen3, tests/engine/test_standby.py) and
SmolLM2 (Llama, tests/integration/test_smollm2.py), fp32.

What it refuses (`Unsupported`, before anything is written; the layerwise reload runs instead, as before): a model
class outside `CLASSES`; a layer of another kind, quantised, with a bias or tensor-parallel, or whose kernel may keep
its weight (anything but vLLM's packed CPU kernels: zentorch, or the `torch.nn.functional.linear` fallback); an
embedding with padding rows; a file name that maps to no parameter, a parameter no name covers, a part whose shape is
not the layer's; a tied head whose own name is not the later of its tensor's two. Any other error while loading falls
back too (engine/standby.py): the layerwise reload rewrites and re-packs every layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

log = logging.getLogger("polar_lab.engine.direct_load")

# the model classes whose `load_weights` (vLLM 0.32's models/llama.py, qwen3.py, AutoWeightsLoader) maps names by the
# checkpoint mapper, stacks q/k/v and gate/up, and copies the rest; what else it does — pass over rotary and kv-scale
# names, unexpected biases, tied aliases — concerns names and layers `plan` refuses
CLASSES = frozenset({"LlamaForCausalLM", "Qwen3ForCausalLM"})


class Unsupported(Exception):
    """Why a load cannot go the direct way (the layerwise reload runs instead)."""


@dataclass
class Step:
    """One module's part of a load: its parameters, each from the file's tensors in part order."""
    module: torch.nn.Module
    kind: str  # "linear" (packed kernel), "embedding" (copied; the head's then processed) or "copy" (a norm)
    sources: dict[str, list[str]] = field(default_factory=dict)  # parameter key ("weight") -> file names


@dataclass
class Plan:
    """The steps of a load, in order: copies, then linear layers, then the output head's processing.

    Of two names for one tied tensor only the head's is copied, and `plan` refuses a file where it is not the later
    one: vLLM's layerwise reload loads both names, each into its own layer, packs the head from its own name's tensor,
    and leaves the shared tensor with the layer processed last — the head's, when its name comes later. Only the head
    is processed: vLLM packs a kernel for every embedding but calls it only on the head (its logits); an input
    embedding's lookups read its weight. So the standby's input embedding keeps the packed kernel of an older load —
    never called, and swapped in with the rest.
    """
    model: torch.nn.Module  # the model it was made for
    copies: list[tuple[str, Step, str]]  # (file name, step, parameter key)
    linears: list[Step]
    embeddings: list[Step]  # the head, if it is an embedding vLLM packs


_cache: dict[tuple, Plan] = {}  # one entry: (id of the model, the file's layout) -> its plan


def load(model, tensors: dict[str, torch.Tensor], pace=None) -> None:
    """Load `tensors` (file name -> tensor, in the file's order) into `model`, the standby; raises `Unsupported`
    before anything is written when the direct way does not apply. pace: called between two modules (engine/standby.py
    `Pacer`). Another error may leave the standby partly written: the caller then loads it all another way."""
    key = (id(model), tuple((name, tuple(t.shape), t.dtype) for name, t in tensors.items()))
    steps = _cache.get(key)
    if steps is None or steps.model is not model:
        _cache.clear()
        steps = _cache[key] = plan(model, {name: tuple(t.shape) for name, t in tensors.items()})
    try:
        for name, step, param in steps.copies:
            getattr(step.module, param).data.copy_(tensors[name])
            _pace(pace)
        for step in steps.linears:
            _linear(step, [tensors[name] for name in step.sources["weight"]])
            _pace(pace)
        for step in steps.embeddings:
            step.module.quant_method.process_weights_after_loading(step.module)
            _pace(pace)
    except BaseException:
        _cache.clear()  # the next load plans afresh rather than repeat what failed part-way
        raise


def _pace(pace) -> None:
    if pace is not None:
        pace()


def plan(model, layout: dict[str, tuple[int, ...]]) -> Plan:
    """The steps that load a file of `layout` (name -> shape, in the file's order) into `model`; `Unsupported` if any
    part of it is not one this module knows."""
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
        if step.kind != "linear" and len(names) > 1:
            raise Unsupported(f"{target} would take {len(names)} tensors: {names}")
        step.sources[param] = names
        check(step, param, [layout[name] for name in names], target)
    head = getattr(model, "lm_head", None)
    return Plan(model, _copies(steps.values(), list(layout), head),
                [s for s in steps.values() if s.kind == "linear"],
                [s for s in steps.values() if s.kind == "embedding" and s.module is head])


def _owners(model) -> dict[str, tuple[torch.nn.Module, str]]:
    """Every parameter name, tied ones under each of their names -> (its module, its key there)."""
    return {f"{prefix}.{key}" if prefix else key: (module, key)
            for prefix, module in model.named_modules(remove_duplicate=False)
            for key, param in module._parameters.items() if param is not None}


def _copies(steps, order: list[str], head) -> list[tuple[str, Step, str]]:
    """The copies of a load, in the file's order: one per tensor, a tied one's from the head's name (`Plan`)."""
    at = {name: i for i, name in enumerate(order)}
    by_tensor: dict[int, list[tuple[str, Step, str]]] = {}
    for step in steps:
        for param, names in step.sources.items() if step.kind != "linear" else ():
            by_tensor.setdefault(id(getattr(step.module, param)), []).append((names[0], step, param))
    copies = []
    for names in by_tensor.values():
        names.sort(key=lambda entry: at[entry[0]])
        if len(names) > 1 and names[-1][1].module is not head:
            raise Unsupported(f"a tied tensor's names {[n for n, _, _ in names]}: the head's is not the later one")
        copies.append(names[-1])
    return sorted(copies, key=lambda entry: at[entry[0]])


def target_of(model, name: str) -> tuple[str, int]:
    """The engine parameter a file tensor loads into, and its part there (0 unless it is one of a fused layer's parts:
    q, k, v of qkv_proj are 0, 1, 2): engine/weights.py `engine_target`, the mapping the load's check uses too."""
    from polar_lab.engine.weights import engine_target

    target, shard = engine_target(model, name)
    if target is None:
        raise Unsupported(f"the model's mapper drops {name}")
    if shard is None:
        return target, 0
    if isinstance(shard, str) and shard in ("q", "k", "v"):
        return target, "qkv".index(shard)
    if isinstance(shard, int):
        return target, shard
    raise Unsupported(f"{name} loads into shards {shard!r}")


def _kind(module) -> str:
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (UnquantizedEmbeddingMethod,
                                                                     VocabParallelEmbedding)
    from vllm.platforms import current_platform

    if isinstance(module, LinearBase) and type(module.quant_method) is UnquantizedLinearMethod:
        # the kernel must hold a packed copy: the slot under a view of it is rewritten by the next sync
        if module.weight.numel() != 0 or getattr(module, "_cpu_skip_gemm_dispatch", False):
            raise Unsupported(f"{type(module).__name__}'s kernel keeps its weight (not a packed CPU kernel)")
        if current_platform.is_zen_cpu():
            raise Unsupported("zentorch's kernels may keep a view of the weight they are given")
        if getattr(module, "tp_size", 1) != 1 or module.bias is not None:
            raise Unsupported(f"a {type(module).__name__} with tensor parallelism or a bias")
        return "linear"
    if isinstance(module, VocabParallelEmbedding) and type(module.quant_method) is UnquantizedEmbeddingMethod:
        if module.num_embeddings_padded != module.org_vocab_size:
            raise Unsupported("an embedding with padding rows")
        return "embedding"
    if type(module) is RMSNorm:
        return "copy"
    raise Unsupported(f"no direct load for a {type(module).__name__}")


def check(step: Step, param: str, shapes: list[tuple[int, ...]], target: str) -> None:
    """The file's parts fit the parameter: a linear layer's stacked along its output rows in the layer's own part sizes
    (q, k and v cannot trade rows and still fill qkv_proj), anything else exactly its shape (an embedding's rows: its
    vocabulary, as vLLM's loader asserts)."""
    module = step.module
    if step.kind == "linear":
        cols = module.input_size_per_partition
        want = [(size, cols) for size in getattr(module, "output_sizes", None) or [module.output_size_per_partition]]
    else:
        want = [tuple(getattr(module, param).shape)]
    if [tuple(shape) for shape in shapes] != want:
        raise Unsupported(f"{target}: the file's parts {[tuple(s) for s in shapes]} are not its {want}")


def _linear(step: Step, parts: list[torch.Tensor]) -> None:
    """Pack a linear layer's new weight into its kernel with vLLM's own processing. The layer keeps the Parameter
    object it had (empty, as vLLM's processing leaves it): the swap exchanges the two instances' objects by name."""
    module = step.module
    kernel = module._parameters["weight"]
    module._parameters["weight"] = torch.nn.Parameter(_stacked(parts).to(kernel.dtype), requires_grad=False)
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
