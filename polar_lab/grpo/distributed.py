"""Trainer ranks as worker processes started from the kernel.

Why processes: a notebook re-runs cells, and a kernel that joined a torch.distributed group cannot join
another (one default group per process); the ranks also keep CUDA and OpenMP state out of the kernel. Each rank
is a process forked from Python's forkserver (or `spawn`ed; `rank_context`) running
`Policy`, which wraps its model in DistributedDataParallel or shards it with FSDP2 (`strategy`; gloo on
CPU, nccl on GPU). The kernel talks to each rank
over a pipe (pickled commands, a timeout on every answer, a dead rank is an error, never a hang).

How a batch is split: samples are dealt round-robin by length, so ranks get similar token counts. Their
per-token weights were computed for the whole batch (batch.py), so the ranks' losses are exact shards of
one loss and the gradient average (DDP's all-reduce, FSDP's reduce-scatter; × world size in Policy.update)
is the full-batch gradient: 2 ranks make the same update as 1 (tested for both strategies).

With FSDP every rank holds 1/N of the parameters, gradients and Adam state; commands that need the whole
model (logprobs, weights for the engine, checkpoints) run on every rank together, and only rank 0 answers.

GPU placement (one node, engine/layout.py): the engine uses its `gpus` (default the first
`tensor_parallel_size`); trainer rank r uses `trainer_devices[r]`, by default the GPUs after the engine's;
sharing the engine's GPUs needs `colocate=True`, or a machine with one GPU (then lower the engine's
`gpu_memory_utilization`); one rank per GPU (NCCL). Weights reach the engine through shared memory that rank 0
writes tensor by tensor (gathered from the shards one at a time with FSDP); vLLM's own NCCL / CUDA-IPC weight
transfer (`weights_transport`, engine/weight_transfer.py) takes one trainer rank and has not run on a GPU yet
(docs/scale.md).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from polar_lab.engine.layout import trainer_gpus, visible_gpus
from polar_lab.errors import TrainerError
from polar_lab.grpo.batch import Sample
from polar_lab.grpo.config import GRPOConfig
from polar_lab.grpo.policy import UpdateStats, resolve_device


class DistributedPolicy:
    """Same interface as Policy (update, logprobs, state_dict, write_weights, save/load_training_state, close),
    N worker processes."""

    def __init__(self, model_path: str, config: GRPOConfig, *, devices: list[str] | None = None,
                 start_timeout: float = 300.0, step_timeout: float = 1800.0, ray_address: str | bool = False):
        """devices: one per rank (default: `trainer_devices(config)`). ray_address: run the ranks as Ray actors
        on that cluster (None: this process's local one; see engine/ray_replicas.py); False: local processes."""
        self.config = config
        self.world_size = config.world_size
        self.step_timeout = step_timeout
        self.sharded = config.strategy == "fsdp"
        self._broken = ""  # why the ranks were stopped after answers could not be read (then nothing is sent)
        self._ray = None  # the ranks' Ray actors, when they run there
        self._conns, self._procs = [], []
        if ray_address is not False:
            from polar_lab.engine.ray_replicas import RayRanks  # Ray is an optional extra

            self._ray = RayRanks(self.world_size, ray_address)
            self.devices = self._ray.devices
        else:
            self.devices = devices if devices is not None else trainer_devices(config)
        backend = "nccl" if self.devices[0].startswith("cuda") else "gloo"
        if backend == "nccl" and config.cpu_offload:  # offloaded shards and gradients live on the CPU
            backend = "cpu:gloo,cuda:nccl"
        threads = max(1, (os.cpu_count() or 1) // self.world_size)
        try:
            if self._ray is not None:
                master = self._ray.master_address()
                for rank in range(self.world_size):
                    conn, proc = self._ray.start(rank, "polar_lab.grpo.distributed:rank_main", (
                        rank, self.world_size, master, backend, self.devices[rank], self._ray.threads,
                        model_path, config.to_dict()))
                    self._conns.append(conn)
                    self._procs.append(proc)
            else:
                ctx = rank_context()
                master = ("127.0.0.1", _free_port())
                for rank in range(self.world_size):
                    parent, child = ctx.Pipe()
                    proc = ctx.Process(target=_worker, name=f"polar-lab-trainer-{rank}", daemon=True,
                                       args=(rank, self.world_size, master, backend, self.devices[rank], threads,
                                             model_path, config.to_dict(), child))
                    proc.start()
                    child.close()
                    self._conns.append(parent)
                    self._procs.append(proc)
            self._gather(start_timeout)  # each rank says it is ready
        except BaseException:
            self.close()
            raise

    @property
    def on_ray(self) -> bool:
        """The ranks are Ray actors (engine/ray_replicas.py RayRanks), not processes of this kernel."""
        return self._ray is not None

    def update(self, samples: list[Sample]) -> UpdateStats:
        shards = shard(samples, self.world_size)
        for rank, part in enumerate(shards):
            self._tell(rank, ("update", part))
        first, *rest = self._gather(self.step_timeout)
        return sum(rest, start=first)  # grad_norm: rank 0's, identical on every rank after the all-reduce

    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        return self._ask(("logprobs", samples), collective=self.sharded)  # FSDP: every rank gathers layers

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._ask(("state_dict", None), collective=self.sharded)

    def gradients(self) -> dict[str, torch.Tensor]:
        return self._ask(("gradients", None), collective=self.sharded)

    def write_weights(self, path: str, dtype: torch.dtype | None = None) -> int:
        """The weights as a safetensors file, written by rank 0 tensor by tensor (see Policy.write_weights)."""
        return self._ask(("write_weights", (str(path), dtype)), collective=self.sharded)

    def write_adapter(self, folder: str) -> int:
        """LoRA: the adapter alone as a PEFT folder (Policy.write_adapter), written by rank 0."""
        return self._ask(("write_adapter", str(folder)), collective=self.sharded)

    def save_training_state(self, folder: str) -> None:
        self._ask(("save_training_state", str(folder)), collective=True)  # each rank writes its shards

    def load_training_state(self, folder: str) -> None:
        self._ask(("load_training_state", str(folder)), collective=True)

    def close(self, timeout: float = 30.0) -> None:
        """Ask every rank to stop; kill any that does not within `timeout` s. Safe to call twice."""
        for conn in self._conns:
            try:
                _send(conn, ("stop", None))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        if self._ray is not None:
            self._ray.close()  # the actors and their placement group, for good
            self._ray = None

    # ---- internals -------------------------------------------------------------------------------
    def memory(self, *, reset_peak: bool = False) -> list[dict[str, int]]:
        """Each rank's memory now and at its peak, in bytes (Policy.memory); `reset_peak` starts a new peak."""
        return self._ask(("memory", reset_peak), collective=True, every=True)

    def _ask(self, message: tuple, *, collective: bool, every: bool = False) -> Any:
        """Rank 0's answer (`every`: all ranks' answers); `collective`: every rank runs the command (it gathers
        shards), else rank 0 alone."""
        ranks = range(self.world_size) if collective else [0]
        for rank in ranks:
            self._tell(rank, message)
        answers = self._gather(self.step_timeout, ranks)
        return answers if every else answers[0]

    def _tell(self, rank: int, message: tuple) -> None:
        if self._broken:
            raise TrainerError(f"this trainer's ranks are stopped: {self._broken}. Start a new trainer")
        try:
            _send(self._conns[rank], message)
        except OSError as exc:  # its end of the pipe is gone: the rank died
            self._procs[rank].join(timeout=5)
            raise TrainerError(f"trainer rank {rank} died (exit code {self._procs[rank].exitcode}): {exc!r}") from None

    def _gather(self, timeout: float, ranks=None) -> list[Any]:
        """Every asked rank's answer. A rank that failed (an exception, the rank alive) is raised only once every
        rank has answered: an unread answer would be taken for the next command's. After a failure the others
        get `FAILED_PEER_WAIT_S` more: a rank that failed inside a collective leaves its peers waiting there for
        good. Whenever answers cannot all be read (a death, a timeout, peers stuck), every rank is stopped and
        this policy refuses further commands: their pipes would be out of step."""
        answers, failure = [], None
        try:
            for rank in range(self.world_size) if ranks is None else ranks:
                try:
                    answers.append(self._receive(rank, timeout if failure is None else FAILED_PEER_WAIT_S))
                except _RankFailed as exc:
                    failure = failure or exc
        except TrainerError as exc:
            self._stop(f"{failure or exc}; the trainer ranks were stopped (a rank's answer could not be read)")
            raise TrainerError(self._broken) from None
        if failure is not None:
            raise TrainerError(str(failure)) from None
        return answers

    def _stop(self, reason: str) -> None:
        self._broken = reason
        self.close(timeout=5)

    def _receive(self, rank: int, timeout: float) -> Any:
        conn, proc = self._conns[rank], self._procs[rank]
        deadline = time.monotonic() + timeout
        while not conn.poll(0.2):
            self._raise_if_a_rank_died()  # the others would wait for it in their all-reduce
            if time.monotonic() > deadline:
                raise TrainerError(f"trainer rank {rank} did not answer within {timeout:.0f} s")
        try:
            status, payload = pickle.loads(conn.recv_bytes())
        except EOFError:
            proc.join(timeout=5)
            raise TrainerError(
                f"trainer rank {rank} exited (code {proc.exitcode}) before answering. Started from a script? "
                f"Worker processes are spawned and re-import the main module: put the script's work under "
                f"`if __name__ == '__main__':`") from None
        if status == "error":
            time.sleep(0.5)  # a peer's death fails this rank's all-reduce: name the death, not its echo
            self._raise_if_a_rank_died()
            raise _RankFailed(f"trainer rank {rank} failed:\n{payload}")
        return payload

    def _raise_if_a_rank_died(self) -> None:
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                raise TrainerError(f"trainer rank {rank} died (exit code {proc.exitcode})")


FAILED_PEER_WAIT_S = 60.0  # after one rank failed, how long the others may take to answer before all are stopped


class _RankFailed(TrainerError):
    """A rank answered with an exception (it is alive, and answers the next command)."""


def shard(samples: list[Sample], world_size: int) -> list[list[Sample]]:
    """Deal samples round-robin by length. A rank left empty gets a zero-weight copy (DDP needs every
    rank to take part in the gradient all-reduce), which changes nothing in the loss."""
    order = sorted(samples, key=lambda s: len(s.input_ids), reverse=True)
    parts = [order[r::world_size] for r in range(world_size)]
    for part in parts:
        if not part and samples:
            blank = samples[0]
            part.append(Sample(input_ids=blank.input_ids, weights=torch.zeros_like(blank.weights), advantage=0.0,
                               behavior_logprobs=blank.behavior_logprobs, versions=blank.versions,
                               temperature=blank.temperature, session_id="padding"))
    return parts


def trainer_devices(config: GRPOConfig, engine: Sequence[int] = ()) -> list[str]:
    """Device of each rank: CPU processes, or GPUs beside the engine's `engine` GPUs (engine/layout.py: the
    default split and its errors)."""
    if resolve_device(config.device) == "cpu":
        return list(config.trainer_devices) if config.trainer_devices is not None else ["cpu"] * config.world_size
    return trainer_gpus(config.trainer_devices, config.world_size, engine, visible_gpus(), colocate=config.colocate)


def _send(conn, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(conn, *args: Any) -> int:
    """A trainer rank in a Ray actor (engine/ray_replicas.py `Host.serve`): `_worker` over `conn`."""
    _worker(*args, conn)
    return 0


# What every rank imports before it builds its Policy, imported once, in the forkserver (`rank_context`)
RANK_PRELOAD = ["polar_lab.grpo.rank_preload"]


def rank_context():
    """How rank processes start: Python's forkserver, whose server process imports RANK_PRELOAD once and forks each rank
    from there (a rank then starts without paying torch's and transformers' imports: ~2-5 s of each on 2 cores), or
    `spawn` where there is no forkserver. Either way a rank inherits no vLLM and no CUDA state from the kernel: the
    server is a fresh interpreter that imports only RANK_PRELOAD (torch initialises CUDA lazily, at a rank's first use).
    The server lives as long as this process (Python ends it when its parent exits)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


def _worker(rank: int, world_size: int, master: tuple[str, int], backend: str, device: str, threads: int,
            model_path: str, config: dict[str, Any], conn) -> None:
    """One trainer rank: build the Policy, join the group (rendezvous at `master`), answer commands until
    "stop"."""
    import torch.distributed as dist

    from polar_lab.grpo.policy import Policy

    def reply(status: str, payload: Any) -> None:
        conn.send_bytes(pickle.dumps((status, payload), protocol=pickle.HIGHEST_PROTOCOL))

    try:
        torch.set_num_threads(threads)
        os.environ.update({"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])})
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        policy = Policy(model_path, GRPOConfig.from_dict(config), device=device, world_size=world_size)
        reply("ok", "ready")
    except BaseException:  # noqa: BLE001 - reported to the kernel, then this rank exits
        reply("error", traceback.format_exc())
        return
    handlers = {"update": policy.update, "logprobs": policy.logprobs,
                "write_weights": lambda args: policy.write_weights(*args), "write_adapter": policy.write_adapter,
                "save_training_state": policy.save_training_state, "load_training_state": policy.load_training_state,
                "memory": lambda reset: policy.memory(reset_peak=reset),
                "state_dict": lambda _: policy.state_dict(), "gradients": lambda _: policy.gradients()}
    try:
        while True:
            command, payload = pickle.loads(conn.recv_bytes())
            if command == "stop":
                return
            try:
                reply("ok", handlers[command](payload))
            except BaseException:  # noqa: BLE001 - the kernel decides what to do
                reply("error", traceback.format_exc())
    except EOFError:
        return  # the kernel went away
    finally:
        dist.destroy_process_group()
