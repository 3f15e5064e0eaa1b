"""Making a Lab's engine: which engine a config asks for (one process, local replicas, Ray actors), and the
folder in shared memory where the served weights are kept for restarts.

`EngineLauncher(config, log_dir, weights)` is the factory the Lab starts its first engine with and its supervisor
restarts with; `WeightsFolder` is a context manager that owns the kept-weights folder, the two slots a sync's
weights are written into (`slot`), and every weights path handed out (`new_path`) that nobody synced: closing it
removes them.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from polar_lab.config import EngineConfig
from polar_lab.engine.base import Engine
from polar_lab.engine.layout import check_heads, engine_gpus, replica_gpus, visible_gpus
from polar_lab.engine.weights import SLOT_PREFIX, remove_weights, unmap


def shared_memory() -> str:
    """Where weights files go: /dev/shm (memory, not disk) where there is one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class WeightsFolder:
    """The weights paths of one Lab: with `keep`, a folder in shared memory that holds the served weights' file (for
    restarts) and a lock its Lab holds on it for its whole life; always, the paths `new_path` handed out that no
    sync took (`taken`). Closing removes both.

    Folders whose lock nobody holds belong to kernels that died without closing their Lab (SIGKILL): they are
    removed when a new folder is made, so they do not hold RAM for good. (A lock, not a pid: kernels in other PID
    namespaces may share /dev/shm.)"""

    def __init__(self, *, keep: bool, reuse: bool = True):
        """keep: the engine keeps the served weights' file here. reuse: `slot` hands out two files in turn."""
        self.path: str | None = None
        self._lock: int | None = None
        self._handed_out: set[Path] = set()
        self.reuse = reuse
        self._slots: list[Path] = []
        if keep:
            self.path, self._lock = _locked_folder()

    def slot(self, serving: Path | None) -> Path:
        """Where the next full weights go: of two files kept for reuse, the one the engine is not `serving` (a write
        then lands in pages mapped before, and the served file stays whole for a restart); without `reuse`, a fresh
        path. The slots live in the locked folder (made now if the engine keeps nothing), so a kernel that dies
        leaves nothing behind for good."""
        if not self.reuse:
            return self.new_path()
        if not self._slots:
            if self.path is None:
                self.path, self._lock = _locked_folder()
            self._slots = [Path(self.path) / f"{SLOT_PREFIX}{i}.safetensors" for i in (0, 1)]
        return self._slots[1] if serving == self._slots[0] else self._slots[0]

    def new_path(self) -> Path:
        """A fresh path for a weights file (or a LoRA adapter's folder); removed at close unless `taken`."""
        path = Path(self.path or shared_memory()) / f"polar-lab-weights-{uuid.uuid4().hex}"
        self._handed_out.add(path)
        return path

    def taken(self, path: Path, *, kept: bool) -> None:
        """A sync used `path`: it is the engine's to keep (`kept`), or removed now."""
        if path in self._handed_out:
            self._handed_out.discard(path)
            if not kept:
                remove_weights(path)

    def close(self) -> None:
        for path in self._handed_out:
            remove_weights(path)
        self._handed_out.clear()
        for slot in self._slots:
            unmap(slot)  # this process's standing mapping of it (engine/weights.py)
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._lock)
            self.path = self._lock = None
        self._slots = []

    def __enter__(self) -> WeightsFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _locked_folder() -> tuple[str, int]:
    shm = shared_memory()
    for old in Path(shm).glob("polar-lab-weights-*"):
        if old.is_dir() and (old / "lock").exists() and _lockable(old / "lock"):
            shutil.rmtree(old, ignore_errors=True)
    folder = tempfile.mkdtemp(prefix="polar-lab-weights-", dir=shm)
    fd = os.open(os.path.join(folder, "lock"), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return folder, fd


def _lockable(path: Path) -> bool:
    """True when no process holds the lock on `path` (its owner is gone)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing releases a lock we took


def check_engine_layout(config: EngineConfig) -> list[int]:
    """The engine's GPUs, and its tensor-parallel size against the model's heads (engine/layout.py)."""
    gpus = engine_gpus(config, visible_gpus())
    if config.tensor_parallel_size > 1:
        from transformers import AutoConfig  # not before the engine launches: ~2 s of imports

        check_heads(AutoConfig.from_pretrained(config.model), config.tensor_parallel_size)
    return gpus


class EngineLauncher:
    """Launches the engine a config asks for; called once for a Lab's first engine and again for each restart
    (the supervisor waits for it and sets its on_exit)."""

    def __init__(self, config: EngineConfig, *, log_dir: Path, weights_dir: str | None):
        """log_dir: where each engine process writes its log (engine.log, engine-<slot>.log); weights_dir: the
        kept weights' folder (WeightsFolder.path), None when weights are not kept."""
        self.config, self.log_dir, self.weights_dir = config, Path(log_dir), weights_dir

    def __call__(self) -> Engine:
        """One engine process, or a ReplicaSet of `replicas` processes (cluster="local") or Ray actors
        (cluster="ray")."""
        from polar_lab.engine.vllm_engine import VLLMEngine  # the engine's imports wait until one is launched

        cfg = self.config
        if cfg.cluster == "ray":
            from polar_lab.engine.ray_replicas import ray_replica_set  # Ray is an optional extra

            return ray_replica_set(cfg, log_dir=self.log_dir, weights_dir=self.weights_dir)
        if cfg.replicas == 1:
            return VLLMEngine(cfg, log_path=self.log_dir / "engine.log", weights_dir=self.weights_dir).launch()
        return self._local_replicas()

    def _local_replicas(self) -> Engine:
        from polar_lab.engine.replicas import ReplicaSet
        from polar_lab.engine.vllm_engine import VLLMEngine

        cfg = self.config
        layouts = replica_gpus(cfg, visible_gpus())

        def replica(slot: int) -> VLLMEngine:
            own = dataclasses.replace(cfg, replicas=1, gpus=layouts[slot])
            return VLLMEngine(own, log_path=self.log_dir / f"engine-{slot}.log").launch()

        engines = []
        try:
            for slot in range(cfg.replicas):
                engines.append(replica(slot))
        except BaseException:
            for engine in engines:
                engine.close()
            raise
        return ReplicaSet(engines, factory=replica, weights_dir=self.weights_dir, max_restarts=cfg.max_restarts,
                          queue_bound=cfg.replica_queue_bound)
