"""Weights on their way to the engine: a safetensors file in shared memory, written tensor by tensor.

A safetensors file is a JSON header (names, dtypes, shapes, byte offsets) followed by the raw bytes. When
the names, dtypes and shapes are known before the tensors exist — a sharded trainer knows them from its
parameters' global shapes — the header can be written first and each tensor copied to its offset as soon
as it is gathered, then freed: the writer never holds more than one full tensor, and the engine maps the
file (`read_weights`) instead of receiving a copy through a socket. safetensors' own writer needs every
tensor at once, so this one writes the documented format itself; `safetensors.safe_open` reads it.

    with WeightsWriter(path, [(name, dtype, shape), ...]) as out:
        for name, tensor in gathered:
            out.write(name, tensor)
    for name, tensor in read_weights(path): ...

A LoRA adapter travels the same way, as a PEFT folder (adapter_config.json + adapter_model.safetensors).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping
from typing import Any
from pathlib import Path

import torch

_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


class WeightsWriter:
    """Writes named tensors into a safetensors file whose layout is fixed up front."""

    def __init__(self, path: str | Path, layout: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        self.path = Path(path)
        header, offset = {}, 0
        for name, dtype, shape in layout:
            if dtype not in _DTYPE_NAMES:
                raise ValueError(f"{name}: dtype {dtype} has no safetensors name")
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned (the format allows trailing spaces)
        self._header, self._start = header, 8 + len(text)
        self.bytes = self._start + offset
        self._missing = set(header)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(self._fd, 0, self.bytes)  # no room in /dev/shm is an error now, not mid-write
            os.pwrite(self._fd, len(text).to_bytes(8, "little") + text, 0)
        except BaseException:
            os.close(self._fd)
            self.path.unlink(missing_ok=True)
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one tensor to its place; it must have the dtype and shape the layout gave it."""
        entry = self._header.get(name)
        if entry is None:
            raise KeyError(f"{name} is not in this file's layout")
        if _DTYPE_NAMES.get(tensor.dtype) != entry["dtype"] or list(tensor.shape) != entry["shape"]:
            raise ValueError(f"{name}: got {tensor.dtype} {tuple(tensor.shape)}, the layout says {entry['dtype']} "
                             f"{tuple(entry['shape'])}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        os.pwrite(self._fd, memoryview(data), self._start + entry["data_offsets"][0])
        self._missing.discard(name)

    def close(self) -> None:
        """Finish the file; an error if a tensor of the layout was never written (its bytes would be zeros)."""
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        if self._missing:
            self.path.unlink(missing_ok=True)
            raise ValueError(f"{len(self._missing)} tensors were never written, e.g. {sorted(self._missing)[:3]}")

    def __enter__(self) -> WeightsWriter:
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self.close()
        else:  # a failed write leaves no half-written file behind
            os.close(self._fd)
            self._fd = -1
            self.path.unlink(missing_ok=True)


def write_weights(path: str | Path, state_dict: Mapping[str, torch.Tensor]) -> int:
    """Write a whole state dict (tied tensors are written once per name); returns the file's size in bytes."""
    layout = [(name, t.dtype, tuple(t.shape)) for name, t in state_dict.items()]
    with WeightsWriter(path, layout) as out:
        for name, tensor in state_dict.items():
            out.write(name, tensor)
    return out.bytes


def load_through_file(engine, state_dict: Mapping[str, torch.Tensor], **load: Any) -> int:
    """`load_weights` for an engine that loads files (a VLLMEngine, a ReplicaSet): write the tensors once as a
    file in the engine's `weights_dir` (else shared memory), `engine.load_weights_file` it with `load`, and
    delete it unless the engine kept it as its `weights_file`."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # memory, not disk
    fd, path = tempfile.mkstemp(prefix="polar-lab-weights-", suffix=".safetensors", dir=engine.weights_dir or shm)
    os.close(fd)
    try:
        write_weights(path, state_dict)
        engine.preload_weights_file(path)  # into a standby copy while the engine serves, where it keeps one
        return engine.load_weights_file(path, **load)
    finally:
        if engine.weights_file != Path(path):
            os.unlink(path)


def read_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a safetensors file, mapped from it one at a time, in the order they were
    written (`safe_open` lists names sorted; the order matters when two names share a weight, as tied
    embeddings do in vLLM: the later one wins)."""
    from safetensors import safe_open

    with open(path, "rb") as fh:
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    header.pop("__metadata__", None)
    with safe_open(str(path), framework="pt") as f:
        for name in sorted(header, key=lambda n: header[n]["data_offsets"][0]):
            yield name, f.get_tensor(name)


def remove_weights(path: str | Path) -> None:
    """Delete a weights file, or a LoRA adapter's folder; gone already is fine."""
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


_removals: list[threading.Thread] = []  # removals still freeing their pages (joined at exit)


def remove_weights_soon(path: str | Path) -> None:
    """`remove_weights` in a thread of its own: freeing a large file's pages takes time (~50 ms for SmolLM2's
    651 MB in /dev/shm) that a superseded file should not add to a sync's pause."""
    removal = threading.Thread(target=remove_weights, args=(path,), name="polar-lab-remove-weights", daemon=True)
    removal.start()
    _removals[:] = [r for r in _removals if r.is_alive()] + [removal]


@atexit.register
def wait_for_removals() -> None:
    """Until every `remove_weights_soon` has removed its file (none is left in /dev/shm by a fast exit)."""
    for removal in list(_removals):
        removal.join()


def weights_size(path: str | Path) -> int:
    """Bytes of a weights file, or of every file in an adapter's folder."""
    path = Path(path)
    return sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size


def unplaced_names(worker, path: str) -> list[str]:
    """Run inside a vLLM worker before a load: the file's tensors for which the served model has no parameter.
    vLLM's `load_weights` passes over a name it does not know in silence, so a trainer tensor the engine would never
    receive (a renamed layer, a hybrid's projection under another name) is found here and the load refused. A name is
    placed when the model's own checkpoint mapper (`hf_to_vllm_mapper`: prefixes; None drops a name, which counts as
    unplaced) and its fused projections (`packed_modules_mapping`: q/k/v into qkv_proj, gate/up into gate_up_proj,
    Qwen3.5's in_proj_qkv/z into in_proj_qkvz and in_proj_b/a into in_proj_ba) lead to one of its parameters."""
    from safetensors import safe_open

    model = worker.model_runner.model
    # an engine serving LoRA wraps its layers: the base weight is `<layer>.base_layer.weight`
    params = {name.replace(".base_layer.", ".") for name, _ in model.named_parameters(remove_duplicate=False)}
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    packed = getattr(model, "packed_modules_mapping", None) or {}
    fused = [(f".{part}.", f".{whole}.") for whole, parts in packed.items() for part in parts]
    with safe_open(str(path), framework="pt") as f:
        names = list(f.keys())
    out = []
    for name in names:
        mapped = mapper.map_name(name) if mapper is not None and hasattr(mapper, "map_name") else name
        for part, whole in fused if mapped is not None else ():
            mapped = mapped.replace(part, whole)
        if mapped not in params:
            out.append(name)
    return out


def reload_from_file(worker, path: str) -> None:
    """Run inside each vLLM worker (`LLM.collective_rpc(reload_from_file, args=(path,))`): load the file's
    tensors into that worker's shard of the model. A function, not an iterator, crosses to tensor-parallel
    worker processes (arguments are pickled there; a generator cannot be)."""
    worker.reload_weights(weights_iterator=read_weights(path))
