"""What the engine forkserver (engine/forkserver.py) does before it forks anything: import what every engine process
imports, and do once what vLLM's build does identically in each. Runs in the server process only; owns nothing."""

from __future__ import annotations

import importlib
import logging

from polar_lab._imports import frozen_imports

log = logging.getLogger(__name__)

# What a CPU engine imports while vllm.LLM builds, beyond `import vllm` (~1 s of a forked engine's start otherwise):
# the CPU worker and its model runner, the model loader, and the model classes of the families polar_lab ships; then
# what a build still imported after those (2026-12-05: the scheduler, the CPU attention backend, the quantisation
# check that pulls compressed_tensors, and the worker's own modules for the standby, its threads and weights)
PRELOAD = ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.model_loader",
           "vllm.model_executor.models.qwen3", "vllm.model_executor.models.llama", "vllm.v1.core.sched.scheduler",
           "vllm.v1.attention.backends.cpu_attn", "vllm.model_executor.layers.quantization.online.base",
           "vllm.model_executor.layers.quantization.compressed_tensors.utils", "polar_lab.engine.standby",
           "polar_lab.engine.step_threads", "polar_lab.engine.weights")


def preload() -> None:
    """Import what every engine process imports before it builds vLLM, frozen out of the garbage collector's reach
    (`frozen_imports`; vLLM collects several times while it builds, and frozen objects are not walked)."""
    with frozen_imports():
        import torch  # noqa: F401
        import vllm  # noqa: F401
        from vllm import LLM, SamplingParams  # noqa: F401 - vllm's top level imports these lazily

        from polar_lab.engine import worker  # noqa: F401

        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - another vLLM build: the engine imports what it needs itself
                log.info("not preloaded: %s (%r)", name, exc)
        try:
            once_for_every_fork()
        except Exception as exc:  # noqa: BLE001 - another vLLM build: each engine does it itself, as before
            log.info("not done once for every fork: %r", exc)


def once_for_every_fork() -> None:
    """Two steps of vLLM's engine build that give every process the same result, done here once instead of in each
    forked engine (0.86 → 0.57 s for a forked tiny-calc `vllm.LLM`, 2026-12-05):
    - its logging configuration (`configure_logging_if_needed`): a `dictConfig` over every logger the preloaded
      modules made, 0.2 s. A fork whose configuration equals this one skips it; vLLM's logging variables are
      import-time ones (`IMPORT_TIME`), so a fork's equals the server's.
    - the CPU platform's overrides of Triton kernels (`register_triton_kernel_overrides`, called by each worker's
      `init_worker`): a scan of every module's namespace for references to the kernels, 0.5 s. Its result is module
      attributes pointing at the overrides, which forks inherit; a second call would scan again for the same result,
      so in this server and its forks the call becomes a no-op."""
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging_if_needed
    from vllm.platforms import current_platform

    configure_logging_if_needed(LoggingConfig())
    platform = type(current_platform)
    if hasattr(platform, "register_triton_kernel_overrides"):
        platform.register_triton_kernel_overrides()
        platform.register_triton_kernel_overrides = classmethod(lambda cls: None)
