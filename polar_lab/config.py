"""Configuration dataclasses, one per component; `LabConfig` groups them and maps 1:1 onto YAML.

Each field carries a one-line help string (`dataclasses.fields(EngineConfig)[i].metadata["help"]`).
Cross-field checks live in `__post_init__` and quote both values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_lab.errors import ConfigError
from polar_lab.types import CONTINUITY

DEFAULT_MODEL = "data/models/tiny-calc"


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def parse_cores(spec: str) -> list[int]:
    """vLLM's core-list form (VLLM_CPU_OMP_THREADS_BIND, EngineConfig.cpu_bind): "0-2,4" → [0, 1, 2, 4].

    >>> parse_cores("0-2,4")
    [0, 1, 2, 4]
    """
    cores: list[int] = []
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        last = last if dash else first
        if not (first.isdigit() and last.isdigit()) or int(last) < int(first):
            raise ValueError(f"not a core list like '0-2,4': {spec!r}")
        cores += range(int(first), int(last) + 1)
    return cores


@dataclass
class EngineConfig:
    """The vLLM engine the Lab owns."""

    # what to serve
    model: str = _f(DEFAULT_MODEL, "HF model folder (or hub id on a machine that has one)")
    served_model_name: str | None = _f(None, "name reported by /v1/models; defaults to the folder name")
    dtype: str = _f("float32", "weights dtype in the engine; fp32 keeps logprobs comparable on CPU")
    max_model_len: int | None = _f(None, "context length; None = the model's max_position_embeddings")
    tool_parser: str = _f("auto", "how tool calls are read from the output: a `vllm serve --tool-call-parser` "
                                  "name (hermes, qwen3_coder, mistral, llama3_json...), 'auto' (from the markers "
                                  "the chat template renders) or 'none'")
    reasoning_parser: str = _f("auto", "how thoughts are read: a `vllm serve --reasoning-parser` name (qwen3, "
                                       "deepseek_r1, mistral...), 'auto' or 'none'")
    max_lora_rank: int | None = _f(None, "serve LoRA adapters up to this rank (a GRPO run with peft_config syncs "
                                         "only its adapter); None = LoRA off")
    # resources
    tensor_parallel_size: int = _f(1, "GPUs the engine splits the model over (vLLM's tensor parallelism; must "
                                      "divide the attention heads)")
    gpus: list[int] | None = _f(None, "the engine's GPU indices, tensor_parallel_size of them; None = the first "
                                      "ones (engine/layout.py)")
    kv_cache_gib: float = _f(1.0, "CPU KV cache size in GiB, fractions allowed (0.25 holds 130k tokens of the tiny "
                                  "models); VLLM_CPU_KVCACHE_SPACE in the environment, whole GiB, wins")
    gpu_memory_utilization: float = _f(0.5, "GPU only: fraction of memory vLLM may take")
    max_num_seqs: int = _f(256, "most sequences vLLM batches in one step")
    # replicas (engine/replicas.py; Ray: engine/ray_replicas.py, docs/scale.md)
    replicas: int = _f(1, "engines behind the proxy; a session's calls stick to one, one policy version spans all")
    cluster: str = _f("local", "where replicas run: 'local' (processes of this kernel) or 'ray' (Ray actors)")
    ray_address: str | None = _f(None, "cluster='ray': None starts a local Ray cluster bound to 127.0.0.1 (stopped "
                                        "with the Lab); 'auto' or 'host:port' joins a running one")
    replica_cpus: int = _f(1, "cluster='ray' on CPU: the CPUs each replica's bundle reserves (and its threads)")
    replica_queue_bound: int = _f(256, "requests in flight on a replica beyond which a session's call moves to a "
                                       "less loaded one (its prefix cache is lost: the move is recorded)")
    # behaviour
    enforce_eager: bool = _f(True, "skip torch.compile/CUDA graphs: fast start-up, slower steps")
    chunked_prefill: bool = _f(True, "split prefills across steps within a step budget (vLLM's default: 4096 tokens "
                                     "on CPU); a hybrid model's prefix caching needs it. Off: each prompt prefills in "
                                     "one step, and a hybrid model runs without prefix caching")
    seed: int = _f(0, "engine seed (per-request seeds override it)")
    vllm_log_level: str = _f("ERROR", "vLLM's log level inside the kernel")
    tcmalloc: bool = _f(True, "CPU engine: start its process with TCMalloc preloaded where the library is installed "
                              "(vLLM's CPU guide; faster weight loads, docs/benchmarks.md)")
    cpu_bind: str = _f("nobind", "CPU engine: cores for its OpenMP threads — 'nobind', 'auto' (all but the last, as "
                                 "`vllm serve` does) or a list like '0-2,4' (engine/process_env.py)")
    cpu_small_batch: int = _f(2, "CPU engine: steps of at most this many requests run on one OpenMP thread, "
                                 "leaving the other cores to the proxy and harnesses (a small step gains nothing from "
                                 "more; engine/step_threads.py); larger steps, long prefills and weight loads use "
                                 "every thread; 0 = every step on every thread")
    cpu_small_prefill: int = _f(128, "CPU engine: a small step may prefill at most this many prompt tokens and stay on "
                                     "one thread (a longer prefill gains from every thread); 0 = every prefill on "
                                     "every thread")
    # faults
    max_restarts: int = _f(3, "times the Lab restarts a dead engine process by itself, over its life; 0 = never "
                              "(calls then get 503 until lab.restart_engine())")
    standby_weights: bool | None = _f(None, "keep a second copy of the model in the engine that a sync loads while "
                                            "the engine serves, so its pause is a swap (the weights' memory twice; "
                                            "engine/standby.py); None = on for a local CPU engine that can have one")
    standby_share: float = _f(0.2, "while the engine serves requests, a load into the standby takes at most this "
                                    "share of the wall time and sleeps the rest, leaving the step loop the cores and "
                                    "the interpreter (engine/standby.py, `Pacer`); idle, it loads at full speed; "
                                    "1.0 = never sleeps")
    keep_weights: bool = _f(True, "keep the last loaded weights as a file in /dev/shm (one copy, outside the "
                                  "kernel's memory) so a restarted engine serves them again")
    weights_transport: str = _f("memory", "how a sync's weights reach the engine: 'memory' — two files in shared "
                                          "memory the Lab reuses, written in place through a mapping and cast to "
                                          "the engine's dtype (engine/weights.py) —, 'file' — a fresh file each "
                                          "sync —, or vLLM's weight-transfer API from an in-process trainer: 'nccl' "
                                          "(GPU), 'ipc' (co-located GPU), 'gloo' (its CPU stand-in; "
                                          "engine/weight_transfer.py)")

    def __post_init__(self) -> None:
        if self.chunked_prefill is None:  # what config.json files of earlier versions hold for the default
            self.chunked_prefill = True
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.weights_transport not in ("memory", "file", "nccl", "ipc", "gloo"):
            raise ConfigError(f"weights_transport must be memory, file, nccl, ipc or gloo, got "
                              f"{self.weights_transport!r}")
        if self.weights_transport not in ("memory", "file") and self.replicas > 1:
            raise ConfigError(f"weights_transport={self.weights_transport!r} sends to one engine; with "
                              f"replicas={self.replicas} use 'memory'")
        if self.kv_cache_gib <= 0:
            raise ConfigError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.max_lora_rank is not None and self.max_lora_rank not in (1, 8, 16, 32, 64, 128, 256, 320, 512):
            raise ConfigError(f"max_lora_rank must be one of vLLM's 1, 8, 16, 32, 64, 128, 256, 320, 512 (or None), "
                              f"got {self.max_lora_rank}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.cpu_small_batch < 0:
            raise ConfigError(f"cpu_small_batch must be >= 0, got {self.cpu_small_batch}")
        if self.cpu_small_prefill < 0:
            raise ConfigError(f"cpu_small_prefill must be >= 0, got {self.cpu_small_prefill}")
        if self.replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {self.replicas}")
        if self.cluster not in ("local", "ray"):
            raise ConfigError(f"cluster must be 'local' or 'ray', got {self.cluster!r}")
        if self.replica_cpus < 1 or self.replica_queue_bound < 1:
            raise ConfigError(f"replica_cpus and replica_queue_bound must be >= 1, got {self.replica_cpus} and "
                              f"{self.replica_queue_bound}")
        if self.ray_address is not None and self.cluster != "ray":
            raise ConfigError(f"ray_address={self.ray_address!r} needs cluster='ray'")
        if self.cpu_bind not in ("auto", "nobind"):
            try:
                parse_cores(self.cpu_bind)
            except ValueError:
                raise ConfigError(f"cpu_bind must be 'auto', 'nobind' or a core list like '0-2,4', got "
                                  f"{self.cpu_bind!r}") from None
        if self.cpu_bind != "nobind" and (self.replicas > 1 or self.cluster == "ray"):
            raise ConfigError(f"cpu_bind={self.cpu_bind!r} binds one engine process: with replicas={self.replicas} "
                              f"(cluster={self.cluster!r}) they would share its cores, and Ray places its own actors")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0 < self.standby_share <= 1:
            raise ConfigError(f"standby_share must be in (0, 1], got {self.standby_share}")
        if self.standby_weights and self._standby_obstacle():
            raise ConfigError(f"standby_weights=True: {self._standby_obstacle()}")

    def _standby_obstacle(self) -> str | None:
        """Why this engine cannot keep a standby copy of its model (engine/standby.py), or None."""
        if self.max_lora_rank is not None:
            return f"max_lora_rank={self.max_lora_rank} (vLLM wraps the served layers for LoRA; an adapter sync is small)"
        if self.tensor_parallel_size > 1:
            return f"tensor_parallel_size={self.tensor_parallel_size} (the swap runs in one vLLM worker)"
        if not self.enforce_eager:
            return "enforce_eager=False (compiled graphs hold the served tensors)"
        return None

    def standby_enabled(self, cuda: bool) -> bool:
        """Whether the engine builds a standby copy: as asked, or (None) for a local CPU engine where nothing stands
        in the way (a Ray replica's weights may reach its node only at the load: engine/ray_replicas.py)."""
        if self.standby_weights is None:  # weights through vLLM's transfer API load in place: no standby to fill
            return not cuda and self.cluster == "local" and self._standby_obstacle() is None and \
                self.weights_transport in ("memory", "file")
        return self.standby_weights

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).name


@dataclass
class ProxyConfig:
    """The HTTP proxy the harnesses talk to."""

    host: str = _f("127.0.0.1", "bind address; anything but loopback exposes session keys to the network")
    port: int | None = _f(None, "TCP port. None: a free port, chosen once per process, so re-running a cell "
                                "returns the running Lab and a JupyterLab on a fixed port never collides; "
                                "0: a new free port (and a new Lab) every time; N: that port")
    auto_sessions: bool = _f(False, "unknown keys create a session instead of getting 401")
    shared_key: str | None = _f(None, "one key for frameworks that share a client among rollouts: a request under "
                                      "it names its session (session_header / session_field). 'auto': a random "
                                      "one (lab.shared_key); None: off")
    session_header: str = _f("X-Session-ID", "the header that names a request's session under the shared key")
    session_field: str | None = _f(None, "a body field that names the session under the shared key when the "
                                         "header is absent, dotted for nested fields (e.g. 'metadata.session_id')")
    create_named_sessions: bool = _f(False, "a name under the shared key that no session has creates a session "
                                            "(else 401)")
    default_max_tokens: int = _f(1024, "max_tokens when a request sets none (clipped to the context)")
    max_body_bytes: int = _f(32 * 1024 * 1024, "larger request bodies get 413")
    inline_render_bytes: int = _f(8 * 1024, "bodies up to this size are rendered and tokenised on the proxy's "
                                            "loop; larger ones in a worker thread so they never stall it")
    continuity: str = _f("splice", "how an echoed assistant turn the proxy produced goes back into the prompt: "
                                   "'splice' (its sampled ids) or 'template' (re-rendered by the chat template)")
    keep_alive_s: int = _f(300, "how long an idle keep-alive connection stays open (uvicorn's timeout_keep_alive; "
                                "longer than clients keep theirs, so the proxy is not the side that closes first: "
                                "proxy/keepalive.py)")
    uvicorn_log_level: str = _f("warning", "uvicorn's log level")
    engine_wait_s: float = _f(900.0, "how long a call that meets a dead engine waits for its replacement before "
                                     "it gets a 503")

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.default_max_tokens < 1:
            raise ConfigError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.continuity not in CONTINUITY:
            raise ConfigError(f"continuity must be one of {CONTINUITY}, got {self.continuity!r}")
        if self.shared_key is not None and self.shared_key != "auto" and len(self.shared_key) < 16:
            raise ConfigError("shared_key must be 'auto' or a secret of at least 16 characters")
        if not self.session_header:
            raise ConfigError("session_header must name a header")


@dataclass
class StoreConfig:
    """Where call records go."""

    runs_dir: str = _f("data/runs", "parent folder of run folders")
    run_name: str | None = _f(None, "run folder name; None = a timestamped name")
    fsync: bool = _f(False, "fsync after each record (survives power loss, not only a killed process)")


SANDBOX_LEVELS = ("isolated", "process")  # polar_lab/sandbox: the one place that implements them


@dataclass
class HarnessConfig:
    """How the Lab runs code it does not trust: harness programs (`Command`) and unit-test evaluators."""

    sandbox: str = _f("isolated", "'isolated' (own unprivileged user, namespaces via bubblewrap: the program "
                                  "sees its workdir, a read-only system and the proxy, nothing of the Lab) or "
                                  "'process' (own workdir, environment, limits; same user and filesystem)")
    sandbox_fallback: bool = _f(False, "where 'isolated' cannot run (no bubblewrap, no user namespaces), run at "
                                       "'process' after saying so once, instead of refusing to run programs")
    sandbox_uid: int | None = _f(None, "the sandbox user's uid (and gid) when the kernel runs as root; None = "
                                       "the first free id from 61000, chosen at Lab start")

    def __post_init__(self) -> None:
        if self.sandbox not in SANDBOX_LEVELS:
            raise ConfigError(f"sandbox must be one of {SANDBOX_LEVELS}, got {self.sandbox!r}")
        if self.sandbox_uid is not None and not 0 < self.sandbox_uid < 2**31:
            raise ConfigError(f"sandbox_uid must be a positive uid (not root's 0), got {self.sandbox_uid}")


@dataclass
class LabConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    harness: HarnessConfig = field(default_factory=HarnessConfig)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LabConfig:
        """Build from a nested dict (parsed YAML); unknown keys are an error, not a silent no-op."""
        parts = {}
        for f in dataclasses.fields(cls):
            section = dict(data.get(f.name) or {})
            known = {g.name for g in dataclasses.fields(f.default_factory)}
            unknown = set(section) - known
            if unknown:
                raise ConfigError(f"unknown keys in '{f.name}': {sorted(unknown)}; known: {sorted(known)}")
            parts[f.name] = f.default_factory(**section)
        unknown = set(data) - set(parts)
        if unknown:
            raise ConfigError(f"unknown config sections {sorted(unknown)}; known: {sorted(parts)}")
        return cls(**parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_record(self) -> dict[str, Any]:
        """What the run folder keeps (`config.json`): everything but secrets — a shared key given as a string is
        written "(set)"."""
        out = self.to_dict()
        if out["proxy"]["shared_key"] not in (None, "auto"):
            out["proxy"]["shared_key"] = "(set)"
        return out


def make_config(model: str | None, config: LabConfig | None, overrides: dict[str, Any]) -> LabConfig:
    """Merge `model` and flat keyword overrides into a LabConfig (each name belongs to one section)."""
    base = config.to_dict() if config is not None else LabConfig().to_dict()
    if model is not None:
        base["engine"]["model"] = str(model)
    sections = {"engine": EngineConfig, "proxy": ProxyConfig, "store": StoreConfig, "harness": HarnessConfig}
    for name, value in overrides.items():
        owner = [s for s, cls in sections.items() if name in cls.__dataclass_fields__]
        if not owner:
            raise TypeError(f"Lab() got an unexpected keyword '{name}'")
        base[owner[0]][name] = value
    return LabConfig.from_dict(base)


def engine_settings(model: str | None, config: LabConfig | None, engine: Any) -> tuple[LabConfig | None, Any]:
    """`Lab(model, engine=EngineConfig(...))`: settings for the engine the Lab builds, not an engine — moved into the
    config. A dict, a string or a path where the engine goes is a TypeError that says what to write."""
    if isinstance(engine, EngineConfig):
        if config is not None:
            raise TypeError("Lab(config=..., engine=EngineConfig(...)): give the engine's settings once, as "
                            "config=LabConfig(engine=EngineConfig(...)) or as engine=EngineConfig(...)")
        if model is not None and engine.model not in (DEFAULT_MODEL, str(model)):
            raise TypeError(f"Lab({model!r}, engine=EngineConfig(model={engine.model!r})): two models; name one")
        return LabConfig(engine=engine), None
    if isinstance(engine, (dict, str, Path)):  # settings or a model, where an engine goes
        raise TypeError(f"Lab(engine=...) takes an engine (VLLMEngine, ScriptedEngine...) or an EngineConfig, not "
                        f"{type(engine).__name__}; engine settings by name go as keywords: "
                        f"Lab(model, max_model_len=..., dtype=...)")
    return config, engine
