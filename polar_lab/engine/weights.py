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

**In memory, not a fresh file each time.** The writer maps the file and copies each tensor into the mapping. A
file that already has the layout is written in place: a Lab hands its trainer one of two *slots* (`is_slot`;
engine/launch.py `WeightsFolder.slot`), the one the engine is not serving, so a sync's bytes land in pages both
processes have mapped before — no new file, no page faults, no parse (SmolLM2: 0.04 s against 0.22–0.34 s for a
fresh file). Given the engine's dtype, floating matrices are cast as they are copied (a GPU tensor on the GPU, before
it crosses to the host), and half the bytes cross for a bf16 engine. A fresh file per sync
(`EngineConfig.weights_transport="file"`) stays as the fallback and for checkpoints.

A LoRA adapter travels the same way, as a PEFT folder (adapter_config.json + adapter_model.safetensors).
"""

from __future__ import annotations

import atexit
import json
import math
import mmap
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any
from pathlib import Path

import torch

_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
SLOT_PREFIX = "polar-lab-slot-"  # the two files a Lab reuses for its syncs (WeightsFolder.slot)


def wire_dtype(kind: torch.dtype, shape, dtype: torch.dtype | None) -> torch.dtype:
    """What a tensor of `kind` and `shape` crosses to an engine of `dtype` as: floating matrices (2+ dimensions) in
    the engine's dtype, which its layers hold them in; vectors as given — an engine keeps some in float32 whatever its
    dtype (vLLM's Gated DeltaNet `A_log`), and its loader rounds them from what it gets; they are few bytes.

    >>> wire_dtype(torch.float32, (4, 4), torch.bfloat16), wire_dtype(torch.float32, (4,), torch.bfloat16)
    (torch.bfloat16, torch.float32)
    """
    return dtype if dtype is not None and kind.is_floating_point and len(shape) >= 2 else kind


def is_slot(path: str | Path) -> bool:
    """A file a Lab reuses sync after sync: an engine that no longer serves it leaves it for the next write."""
    return Path(path).name.startswith(SLOT_PREFIX)


class WeightsWriter:
    """Writes named tensors into a safetensors file whose layout is fixed up front, through a mapping of it; a file
    that has that layout already is written in place (its pages are reused)."""

    def __init__(self, path: str | Path, layout: list[tuple[str, torch.dtype, tuple[int, ...]]], *,
                 dtype: torch.dtype | None = None):
        """dtype: the engine's dtype, what floating matrices are stored as (`wire_dtype`; None: as the layout says)."""
        self.path = Path(path)
        layout = [(name, wire_dtype(kind, shape, dtype), tuple(shape)) for name, kind, shape in layout]
        # widest elements first (stable: tied tensors keep their order): every tensor then starts at a multiple of
        # its element size, and the mapping can be viewed as its dtype (the format allows no padding)
        layout.sort(key=lambda entry: -entry[1].itemsize)
        header, offset = {}, 0
        for name, kind, shape in layout:
            if kind not in _DTYPE_NAMES:
                raise ValueError(f"{name}: dtype {kind} has no safetensors name")
            size = math.prod(shape) * kind.itemsize
            header[name] = {"dtype": _DTYPE_NAMES[kind], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned (the format allows trailing spaces)
        self._header, self._start = header, 8 + len(text)
        self.bytes = self._start + offset
        self._missing = set(header)
        self.reused = _has_header(self.path, len(text).to_bytes(8, "little") + text, self.bytes)
        if not self.reused:
            _create(self.path, len(text).to_bytes(8, "little") + text, self.bytes)
        self._data: torch.Tensor | None = mapped(self.path)  # (bytes,) over the file

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one tensor to its place (cast to the file's dtype, if floating); its shape must be the layout's."""
        entry = self._header.get(name)
        if entry is None:
            raise KeyError(f"{name} is not in this file's layout")
        kind = _DTYPES[entry["dtype"]]
        if list(tensor.shape) != entry["shape"] or (tensor.dtype != kind and not (
                tensor.is_floating_point() and kind.is_floating_point)):
            raise ValueError(f"{name}: got {tensor.dtype} {tuple(tensor.shape)}, the layout says {entry['dtype']} "
                             f"{tuple(entry['shape'])}")
        first, last = (self._start + at for at in entry["data_offsets"])
        source = tensor.detach()
        if source.device.type != "cpu" and kind.itemsize < source.element_size():
            # narrow where the tensor lives, then move only the engine's bytes to the host (a temporary of this one
            # tensor's size on its device). A copy that cast on the way wrote Qwen3.5-4B's bf16 slot from an H100 in
            # 12-14 s in place, no faster than its whole fp32 file (11-15 s); cast first, 1.06 s (docs/benchmarks.md)
            source = source.to(kind)
        self._data[first:last].view(kind).view(tensor.shape).copy_(source)  # a CPU tensor is cast as it is copied
        self._missing.discard(name)

    def close(self) -> None:
        """Finish the file; an error if a tensor of the layout was never written (its bytes would be stale)."""
        if self._data is None:
            return
        self._done()
        if self._missing:
            self._remove()
            raise ValueError(f"{len(self._missing)} tensors were never written, e.g. {sorted(self._missing)[:3]}")

    def _done(self) -> None:
        self._data = None
        if not is_slot(self.path):  # a slot stays mapped for the next sync; another file is done with
            unmap(self.path)

    def _remove(self) -> None:
        unmap(self.path)
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> WeightsWriter:
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self.close()
        elif self._data is not None:  # a failed write leaves no half-written file behind
            self._data = None
            self._remove()


def _has_header(path: Path, header: bytes, size: int) -> bool:
    """`path` is a file of `size` bytes that starts with `header` (a layout written before: it can be reused)."""
    try:
        with open(path, "rb") as fh:
            return os.fstat(fh.fileno()).st_size == size and fh.read(len(header)) == header
    except OSError:
        return False


def _create(path: Path, header: bytes, size: int) -> None:
    """A new file (a new inode: whoever mapped the old one keeps its pages) of `size` bytes after `header`."""
    unmap(path)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # no room in /dev/shm is an error now, not mid-write
        os.pwrite(fd, header, 0)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


# ---- mappings a process keeps ----------------------------------------------------------------------------
# A slot is mapped once per process and stays mapped: a sync's copy then touches pages that are already in the
# process's page tables (SmolLM2's 540 MB: 0.04 s, against 0.10 s to map and fault them in again and 0.16 s for a
# fresh file). Rewritten in place, the file keeps its inode and every mapping sees the new bytes. At most two (one
# Lab's slots) per process; older ones are unmapped, and a Lab unmaps its own when it closes.
_MAPPED: OrderedDict[str, tuple[tuple[int, int], mmap.mmap, torch.Tensor]] = OrderedDict()
_MAPPED_MAX = 2
_mapped_lock = threading.Lock()


def mapped(path: str | Path) -> torch.Tensor:
    """The bytes of `path` as one (bytes,) uint8 tensor over a shared mapping, its pages faulted in at once
    (MAP_POPULATE); the same tensor again while the file is the same (inode and size)."""
    key, stat = str(path), os.stat(path)
    ident = (stat.st_ino, stat.st_size)
    with _mapped_lock:
        held = _MAPPED.get(key)
        if held is not None and held[0] == ident:
            _MAPPED.move_to_end(key)
            return held[2]
        _drop(key)
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, stat.st_size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        _MAPPED[key] = (ident, mapping, torch.frombuffer(mapping, dtype=torch.uint8))
        while len(_MAPPED) > _MAPPED_MAX:
            _drop(next(iter(_MAPPED)))
        return _MAPPED[key][2]


def unmap(path: str | Path) -> None:
    """Stop keeping `path` mapped in this process (tensors still viewing it keep it until they go)."""
    with _mapped_lock:
        _drop(str(path))


def _drop(key: str) -> None:
    held = _MAPPED.pop(key, None)
    if held is not None:
        _, mapping, data = held
        del data, held
        try:
            mapping.close()
        except BufferError:  # a view of it is still alive somewhere: the mapping goes with the last one
            pass


def write_weights(path: str | Path, state_dict: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None
                  ) -> int:
    """Write a whole state dict (tied tensors are written once per name; floating matrices as `dtype`, if given:
    `WeightsWriter`); returns the file's size in bytes."""
    layout = [(name, t.dtype, tuple(t.shape)) for name, t in state_dict.items()]
    with WeightsWriter(path, layout, dtype=dtype) as out:
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
    embeddings do in vLLM: the later one wins). A slot's tensors are views of this process's standing mapping of
    it (`mapped`): no open, no parse of more than the header, no page faults."""
    if is_slot(path):
        yield from _slot_tensors(mapped(path))
        return
    from safetensors import safe_open

    with open(path, "rb") as fh:
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    header.pop("__metadata__", None)
    with safe_open(str(path), framework="pt") as f:
        for name in sorted(header, key=lambda n: header[n]["data_offsets"][0]):
            yield name, f.get_tensor(name)


def _slot_tensors(data: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a file `WeightsWriter` wrote (each aligned to its element size), as views of its bytes."""
    length = int.from_bytes(data[:8].numpy().tobytes(), "little")
    header = json.loads(data[8:8 + length].numpy().tobytes())
    header.pop("__metadata__", None)
    start = 8 + length
    for name in sorted(header, key=lambda n: header[n]["data_offsets"][0]):
        entry = header[name]
        first, last = entry["data_offsets"]
        yield name, data[start + first:start + last].view(_DTYPES[entry["dtype"]]).view(entry["shape"])


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

    with safe_open(str(path), framework="pt") as f:
        return unplaced_of(worker, list(f.keys()))


def unplaced_of(worker, names: list[str]) -> list[str]:
    """`unplaced_names` for tensor names (a weight transfer's, before anything moves)."""
    model = worker.model_runner.model
    # an engine serving LoRA wraps its layers: the base weight is `<layer>.base_layer.weight`
    params = {name.replace(".base_layer.", ".") for name, _ in model.named_parameters(remove_duplicate=False)}
    return [name for name in names if engine_target(model, name)[0] not in params]


def engine_target(model, name: str) -> tuple[str | None, object]:
    """The engine parameter a checkpoint tensor loads into (None: the model's mapper drops it), by the model's own
    checkpoint mapper (`hf_to_vllm_mapper`) and fused layers (`packed_modules_mapping`), and its shard there: the
    mapper's shard id ("q", "k", "v", 0, 1, ...), else the tensor's index among a fused layer's parts, else None (the
    whole parameter)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None and hasattr(mapper, "_map_name_with_shard"):
        mapped = mapper._map_name_with_shard(name)
        if mapped is None:
            return None, None
        name, shard = mapped
        if shard is not None:
            return name, shard
    elif mapper is not None and hasattr(mapper, "map_name"):
        name = mapper.map_name(name)
        if name is None:
            return None, None
    for whole, pieces in (getattr(model, "packed_modules_mapping", None) or {}).items():
        for index, piece in enumerate(pieces):
            if f".{piece}." in name:
                return name.replace(f".{piece}.", f".{whole}.", 1), index
    return name, None


def reload_from_file(worker, path: str) -> None:
    """Run inside each vLLM worker (`LLM.collective_rpc(reload_from_file, args=(path,))`): load the file's
    tensors into that worker's shard of the model. A function, not an iterator, crosses to tensor-parallel
    worker processes (arguments are pickled there; a generator cannot be)."""
    worker.reload_weights(weights_iterator=read_weights(path))
